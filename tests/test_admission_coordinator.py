"""Global FIFO coordinator with a hand-driven clock (issue 3 "The behaviour", "Ledger and queue")."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgate.admission.capacity import ClusterSnapshot, EngineCapacity
from kvgate.admission.coordinator import AdmissionCoordinator, Kind
from kvgate.admission.ledger import Ledger


def snap(now, cap=10_000, usage=0.1, engines=("http://e0",)):
    return ClusterSnapshot.build({u: EngineCapacity.from_pools([(cap, int(cap * usage), usage)]) for u in engines}, now)


def make(max_wait_s=30.0, cap=10_000, usage=0.1, stale_after_s=1e6, lease_ttl_s=1e6, window_s=60.0):
    lg = Ledger(headroom=0.9, pressure_threshold=0.92, stale_after_s=stale_after_s, lease_ttl_s=lease_ttl_s, window_s=window_s)
    co = AdmissionCoordinator(lg, max_wait_s=max_wait_s)
    co.reconcile(snap(0.0, cap=cap, usage=usage), 0.0)
    return co, lg


def kinds(decisions):
    return [(d.ticket, d.kind) for d in decisions]


def test_admit_when_room_and_fifo_empty():
    co, lg = make()  # ceiling 9000
    d = co.submit("a", 4000, False, 1.0)
    assert d.kind is Kind.ADMIT and d.lease.tokens == 4000 and d.waited_s == 0 and not d.queued
    assert d.header == "admit" and d.queue_ms == 0
    assert lg.reserved == 4000
    assert co.release("a", 2.0) == []
    assert lg.reserved == 0


def test_protected_reserves_degraded_does_not():
    co, lg = make(stale_after_s=6.0)
    d = co.submit("p", 100_000, True, 1.0)
    assert d.kind is Kind.BYPASS_PROTECTED and d.header == "bypass-protected"
    assert d.lease.forced and lg.reserved == 10_000  # clamped to the engine's max_total_num_tokens
    d = co.submit("late", 100, False, 6.0)  # snapshot from t=0 is stale at t=6
    assert d.kind is Kind.BYPASS_DEGRADED and d.header == "bypass-degraded" and d.lease is None
    assert lg.reserved == 10_000 and co.waiting == 0
    co.release("p", 7.0)
    assert lg.reserved == 0
    assert co.counters["bypass_protected"] == 1 and co.counters["bypass_degraded"] == 1 and co.counters["bypass"] == 2


def test_protected_goes_first_even_when_degraded():
    lg = Ledger(stale_after_s=6.0)
    co = AdmissionCoordinator(lg, 30.0)  # never reconciled: degraded
    assert co.submit("p", 1, True, 0.0).kind is Kind.BYPASS_PROTECTED
    assert co.submit("q", 1, False, 0.0).kind is Kind.BYPASS_DEGRADED


def test_fifo_order_under_pressure():
    co, lg = make()  # ceiling 9000
    assert co.submit("a", 5000, False, 0.0).kind is Kind.ADMIT
    w = co.submit("b", 5000, False, 1.0)
    assert w.kind is Kind.WAIT and w.reason == "capacity_exhausted"
    assert co.pump(1.0) == []
    assert co.submit("c", 3000, False, 2.0).kind is Kind.WAIT
    assert co.submit("d", 1000, False, 3.0).kind is Kind.WAIT
    assert co.waiting_tickets() == ["b", "c", "d"]
    out = co.release("a", 10.0)
    # b (5000) then c (3000) fit into 9000; d (1000) would fit too: 9000 total
    assert kinds(out) == [("b", Kind.ADMIT), ("c", Kind.ADMIT), ("d", Kind.ADMIT)]
    assert [d.waited_s for d in out] == [9.0, 8.0, 7.0]
    assert [d.queue_ms for d in out] == [9000, 8000, 7000]
    assert lg.reserved == 9000 and co.waiting == 0


def test_head_of_line_blocking_small_request_does_not_jump_ahead():
    co, lg = make()  # ceiling 9000
    co.submit("a", 6000, False, 0.0)
    assert co.submit("big", 8000, False, 1.0).kind is Kind.WAIT  # 6000 + 8000 > 9000
    small = co.submit("small", 100, False, 2.0)  # would fit (6100 <= 9000) but an earlier waiter exists
    assert small.kind is Kind.WAIT and small.reason == "fifo"
    assert co.pump(2.0) == []
    assert lg.reserved == 6000
    out = co.release("a", 5.0)
    assert kinds(out) == [("big", Kind.ADMIT), ("small", Kind.ADMIT)]
    assert lg.reserved == 8100


def test_pressure_guard_makes_requests_wait_and_reconcile_releases_them():
    co, lg = make(usage=0.95)
    w = co.submit("a", 10, False, 1.0)
    assert w.kind is Kind.WAIT and w.reason == "pressure_guard"
    assert co.submit("b", 10, False, 1.5).kind is Kind.WAIT
    out = co.reconcile(snap(2.0, usage=0.5), 2.0)
    assert kinds(out) == [("a", Kind.ADMIT), ("b", Kind.ADMIT)]
    assert [d.waited_s for d in out] == [1.0, 0.5]


def test_aging_bypass_exactly_at_max_wait():
    co, lg = make(max_wait_s=30.0)
    co.submit("a", 9000, False, 0.0)
    assert co.submit("b", 10, False, 5.0).kind is Kind.WAIT
    assert co.submit("c", 10, False, 10.0).kind is Kind.WAIT
    assert co.next_deadline(10.0) == 35.0
    assert co.pump(34.999) == []
    out = co.pump(35.0)
    assert kinds(out) == [("b", Kind.BYPASS_AGED)]
    assert out[0].waited_s == 30.0 and out[0].header == "bypass-aged" and out[0].reason == "capacity_exhausted"
    assert co.next_deadline(35.0) == 40.0
    assert kinds(co.pump(40.0)) == [("c", Kind.BYPASS_AGED)]
    assert co.counters["bypass_aged"] == 2 and lg.reserved == 9020  # aged bypasses still reserve


def test_max_wait_zero_bypasses_on_first_pump():
    co, lg = make(max_wait_s=0.0)
    co.submit("a", 9000, False, 0.0)
    assert co.submit("b", 10, False, 1.0).kind is Kind.WAIT
    assert kinds(co.pump(1.0)) == [("b", Kind.BYPASS_AGED)]


def test_admit_preferred_over_aging_when_room():
    co, lg = make(max_wait_s=5.0)
    co.submit("a", 9000, False, 0.0)
    co.submit("b", 100, False, 0.0)
    out = co.release("a", 50.0)
    assert kinds(out) == [("b", Kind.ADMIT)] and out[0].waited_s == 50.0


def test_degraded_lets_whole_queue_bypass_in_order():
    co, lg = make(stale_after_s=6.0)
    co.submit("a", 9000, False, 0.0)
    for i, t in enumerate(["b", "c", "d"]):
        assert co.submit(t, 10, False, 1.0 + i).kind is Kind.WAIT
    assert co.next_deadline(3.0) == 6.0  # staleness comes before aging (31.0)
    assert co.pump(5.9) == []
    out = co.pump(6.0)
    assert kinds(out) == [("b", Kind.BYPASS_DEGRADED), ("c", Kind.BYPASS_DEGRADED), ("d", Kind.BYPASS_DEGRADED)]
    assert [d.waited_s for d in out] == [5.0, 4.0, 3.0]
    assert co.waiting == 0 and lg.reserved == 9000


def test_cancel_while_waiting_leaves_nothing_reserved():
    co, lg = make()
    co.submit("a", 9000, False, 0.0)
    co.submit("b", 5000, False, 1.0)
    co.submit("c", 1000, False, 2.0)
    assert co.cancel("b", 3.0) is True
    assert co.cancel("b", 3.0) is False  # idempotent
    assert co.waiting_tickets() == ["c"]
    assert co.pump(3.0) == []
    out = co.release("a", 4.0)
    assert kinds(out) == [("c", Kind.ADMIT)]
    co.release("c", 5.0)
    assert lg.reserved == 0 and lg.lease_count == 0
    assert co.counters["cancelled"] == 1


def test_cancel_of_head_unblocks_next():
    co, lg = make()
    co.submit("a", 6000, False, 0.0)
    co.submit("big", 8000, False, 1.0)
    co.submit("small", 100, False, 2.0)
    assert co.cancel("big", 3.0)
    assert kinds(co.pump(3.0)) == [("small", Kind.ADMIT)]


def test_cancel_racing_grant_releases_lease():
    co, lg = make()
    co.submit("a", 9000, False, 0.0)
    co.submit("b", 4000, False, 1.0)
    out = co.release("a", 2.0)  # pump grants b; the shell resolves b's future ...
    assert kinds(out) == [("b", Kind.ADMIT)] and lg.reserved == 4000
    # ... but b's client disconnected in the same instant: the shell cancels
    assert co.cancel("b", 2.0) is True
    assert lg.reserved == 0 and lg.lease_count == 0
    assert co.counters["cancelled"] == 1
    assert co.release("b", 2.0) == []  # the shell's finally: idempotent
    assert lg.reserved == 0


def test_cancel_after_consumed_does_not_count_and_release_frees():
    co, lg = make()
    co.submit("a", 9000, False, 0.0)
    co.submit("b", 4000, False, 1.0)
    co.release("a", 2.0)
    co.consumed("b")
    assert co.cancel("b", 3.0) is False
    assert lg.reserved == 4000
    co.release("b", 4.0)
    assert lg.reserved == 0 and co.counters["cancelled"] == 0


def test_release_of_a_waiting_ticket_cancels_it():
    co, lg = make()
    co.submit("a", 9000, False, 0.0)
    co.submit("b", 10, False, 0.0)
    assert co.release("b", 1.0) == []
    assert co.waiting == 0 and co.counters["cancelled"] == 1


def test_oversized_request_does_not_wait_for_aging():
    co, lg = make(max_wait_s=30.0)  # ceiling 9000
    co.submit("a", 100, False, 0.0)
    w = co.submit("huge", 50_000, False, 1.0)
    assert w.kind is Kind.WAIT
    out = co.release("a", 2.0)  # nothing else reserved -> huge admitted long before 31.0
    assert kinds(out) == [("huge", Kind.ADMIT)] and out[0].lease.oversized and out[0].waited_s == 1.0
    # when nothing is reserved at all it is admitted at once
    co.release("huge", 3.0)
    assert co.submit("huge2", 50_000, False, 3.0).kind is Kind.ADMIT


def test_submit_idempotent():
    co, lg = make()
    assert co.submit("a", 9000, False, 0.0).kind is Kind.ADMIT
    again = co.submit("a", 9000, False, 0.5)
    assert again.kind is Kind.ADMIT and lg.reserved == 9000
    assert co.submit("b", 10, False, 1.0).kind is Kind.WAIT
    w = co.submit("b", 10, False, 2.0)
    assert w.kind is Kind.WAIT and w.waited_s == 1.0
    assert co.waiting == 1 and co.counters["admit"] == 1 and co.counters["wait"] == 1


def test_lease_ttl_reclaim_through_pump():
    co, lg = make(lease_ttl_s=100.0)
    co.submit("stranded", 9000, False, 0.0)
    co.submit("b", 10, False, 1.0)
    assert co.next_deadline(1.0) == 31.0  # aging first
    out = co.pump(31.0)
    assert kinds(out) == [("b", Kind.BYPASS_AGED)]
    assert co.next_deadline(31.0) == 100.0  # lease expiry
    assert co.pump(100.0) == []
    assert lg.reserved == 10 and lg.lease_expired_total == 1  # the aged bypass's lease is live


def test_stats_rates_over_window():
    co, lg = make(stale_after_s=1e6, window_s=60.0)
    co.submit("a", 9000, False, 0.0)  # admit
    co.submit("b", 10, False, 1.0)  # wait
    co.submit("p", 10, True, 2.0)  # bypass protected
    co.release("a", 3.0)  # b admitted after 2 s
    s = co.stats(3.0)
    assert s["counters"]["admit"] == 2 and s["counters"]["wait"] == 1 and s["counters"]["bypass"] == 1
    assert s["window"]["admit"] == 2 and s["window"]["wait"] == 1 and s["window"]["bypass"] == 1
    assert s["defer_rate"] == pytest.approx(1 / 4)
    assert s["degraded_rate"] == 0.0
    assert s["wait_s"] == {"count": 1, "mean": 2.0, "p50": 2.0, "max": 2.0}
    assert s["waiting"] == 0 and s["ledger"]["reserved"] == 20  # b's lease and the aged bypass's
    # degraded: new snapshot without engines
    co.reconcile(ClusterSnapshot.build({"http://e0": None}, 4.0), 4.0)
    assert co.submit("x", 10, False, 4.0).kind is Kind.BYPASS_DEGRADED
    s = co.stats(4.0)
    assert s["degraded_rate"] == pytest.approx(1 / 5) and s["ledger"]["degraded"] is True
    # the window forgets old events, lifetime counters keep them
    s = co.stats(63.5)
    assert s["window"]["admit"] == 0 and s["window"]["bypass_degraded"] == 1
    assert s["defer_rate"] == 0.0 and s["degraded_rate"] == 1.0
    assert s["counters"]["admit"] == 2
    import json

    json.dumps(s)


def test_bad_args():
    lg = Ledger()
    with pytest.raises(ValueError):
        AdmissionCoordinator(lg, -1)
    co = AdmissionCoordinator(lg, 1)
    with pytest.raises(ValueError):
        co.submit("t", -5, False, 0.0)


def test_both_policies_refuse_a_reservation_that_is_not_an_int_of_zero_or_more():
    """The fifo and the program coordinators take the usual int at once and anything else through the same
    rule as the ledger: a bool, a float, a str or a negative count raises before anything is decided, also
    when the ledger is degraded (no snapshot: the request would bypass, the ledger is never asked)."""
    from kvgate.admission.program import ProgramCoordinator

    for coord in (AdmissionCoordinator, ProgramCoordinator):
        for fresh in (True, False):
            lg = make()[1] if fresh else Ledger()  # a fresh snapshot with room to spare, or none at all
            co = coord(lg, 1)
            for bad in (-1, 1.5, True, "3"):
                with pytest.raises(ValueError):
                    co.submit("t", bad, False, 0.0, session_id="s")
            want = Kind.ADMIT if fresh else Kind.BYPASS_DEGRADED
            assert co.submit("t", 5, False, 0.0, session_id="s").kind is want


def test_invalidate_flushes_queue_degraded():
    co, lg = make()
    co.submit("a", 9000, False, 0.0)
    co.submit("b", 10, False, 1.0)
    out = co.invalidate(2.0)
    assert kinds(out) == [("b", Kind.BYPASS_DEGRADED)] and out[0].waited_s == 1.0
    assert co.submit("c", 10, False, 2.0).kind is Kind.BYPASS_DEGRADED
    assert lg.reserved == 9000  # a's lease is still released normally
    co.release("a", 3.0)
    assert lg.reserved == 0


_TALLY_NAMES = ("admit", "wait", "bypass", "bypass_protected", "bypass_degraded", "bypass_aged", "cancelled")


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 3, allow_nan=False), st.sampled_from(_TALLY_NAMES), st.booleans()),
                max_size=300),
       st.floats(0.5, 5, allow_nan=False))
def test_tally_window_counts_what_a_list_of_events_would(events, window_s):
    """The compact window gives the figures of the plain rule: every event at or after now - window_s."""
    from kvgate.admission.coordinator import DecisionTally

    tally = DecisionTally(_TALLY_NAMES, window_s)
    kept, waits, now = [], [], 0.0
    for dt, name, waited in events:
        now += dt
        tally.count(name, now)
        kept.append((now, name))
        if waited:
            tally._w_t.append(now)
            tally._w_s.append(dt)
            waits.append((now, dt))
        if len(kept) % 37 == 0:  # read now and then, as a scrape would
            tally.window(now)
    w = tally.window(now)
    live = [n for t, n in kept if t >= now - window_s]
    want = {k: live.count(k) for k in _TALLY_NAMES}
    want["bypass"] += sum(v for k, v in want.items() if k.startswith("bypass_"))
    assert w["window"] == want
    live_waits = sorted(s for t, s in waits if t >= now - window_s)
    assert w["wait_s"]["count"] == len(live_waits)
    assert w["wait_s"]["max"] == (live_waits[-1] if live_waits else 0.0)


def test_tally_window_stays_bounded_when_nobody_reads_it():
    from kvgate.admission.coordinator import DecisionTally

    tally = DecisionTally(_TALLY_NAMES, 10.0)
    for i in range(200_000):  # 1,000 decisions a second for 200 s, never scraped
        tally.count("admit", i / 1000)
    assert len(tally._ev_t) - tally._ev_head <= 10_000 + 1024
    assert len(tally._ev_t) <= 2 * (10_000 + 1024) + 4096
    assert tally.window(200.0)["window"]["admit"] == 10_000  # events at t >= 190.0 s
