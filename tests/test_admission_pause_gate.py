"""Pause only where it can pay: the re-prefill ratio (call seconds re-prefilling KV the engines had evicted, per
engine second; kvgate.admission.pause_gate), and the program policy admitting as lifecycle alone does below it."""

import pytest
from hypothesis import given, settings, strategies as st

from kvgate.admission.capacity import ClusterSnapshot, EngineCapacity
from kvgate.admission.coordinator import Kind
from kvgate.admission.ledger import Ledger
from kvgate.admission.pause_gate import PauseGate
from kvgate.admission.program import ProgramCoordinator, ProgramState
from program_helpers import programs, teach_prefill_rate

E0, E1 = "http://e0", "http://e1"


def test_ratio_is_reprefill_seconds_over_engine_seconds_in_the_window():
    g = PauseGate(0.3, window_s=10.0, min_span_s=2.0)
    g.started(0.0)
    g.observe(1.0, 500, 1.0)
    assert g.ratio(1.5, 2) is None  # before min_span_s: no figure, closed
    assert g.update(1.5, 2) is False
    assert g.ratio(2.0, 2) == pytest.approx(1.0 / (2 * 2.0))
    g.observe(4.0, 1000, 2.0)
    assert g.ratio(5.0, 2) == pytest.approx(3.0 / (2 * 5.0))
    assert g.ratio(12.0, 2) == pytest.approx(2.0 / (2 * 10.0))  # the first left the window
    assert g.ratio(15.0, 2) == 0.0
    assert g.reprefill_tokens == 1500 and g.reprefill_s == pytest.approx(3.0)


def test_hysteresis_opens_at_start_ratio_and_closes_below_stop_ratio():
    g = PauseGate(0.4, 0.2, window_s=10.0, min_span_s=1.0)
    g.started(0.0)
    g.observe(0.5, 100, 3.0)
    assert g.update(0.5, 1) is False  # 3 s in 0.5 s, but the span is under min_span_s
    assert g.update(4.0, 1) is True and g.opened == 1  # 3 / 4 = 0.75 >= 0.4
    assert g.update(10.0, 1) is True  # 3 / 10 = 0.3: below open, above close: stays open
    assert g.update(11.0, 1) is False and g.closed == 1  # the event left the window: 0


def test_off_gate_is_always_open_and_bad_values_are_refused():
    g = PauseGate(0.0)
    assert g.update(0.0, 4) is True and g.is_open
    for bad in (-0.1, float("nan"), float("inf"), "0.3", None):
        with pytest.raises(ValueError):
            PauseGate(bad)
    with pytest.raises(ValueError):
        PauseGate(0.3, 0.5)
    with pytest.raises(ValueError):
        PauseGate(0.3, window_s=0)
    with pytest.raises(ValueError):
        PauseGate(0.3, min_span_s=-1)


@settings(max_examples=200, deadline=None)
@given(events=st.lists(st.tuples(st.floats(0.0, 5.0), st.integers(0, 5000), st.floats(0.0, 3.0)), max_size=60),
       start_ratio=st.floats(0.01, 2.0), engines=st.integers(1, 8), window=st.floats(1.0, 100.0))
def test_ratio_matches_a_direct_sum_and_the_gate_state_its_thresholds(events, start_ratio, engines, window):
    """Over any sequence of answers: the ratio equals the re-prefill seconds inside the window over engines x
    span, and the gate is open after an update only if the ratio reached start_ratio at some update and has
    not fallen below stop_ratio since."""
    g = PauseGate(start_ratio, window_s=window, min_span_s=0.0)
    t, seen = 0.0, []
    g.started(0.0)
    prev_open = False
    for dt, tokens, sec in events:
        t += dt
        g.observe(t, tokens, sec)
        if tokens > 0 and sec > 0:
            seen.append((t, sec))
        s = g.ratio(t, engines)
        span = min(window, t)
        if span <= 0:
            continue
        want = sum(x for u, x in seen if u >= t - window) / (engines * span)
        assert s == pytest.approx(want, rel=1e-6, abs=1e-9)
        now_open = g.update(t, engines)
        if now_open != prev_open:
            assert (s >= start_ratio) if now_open else (s < g.stop_ratio)
        prev_open = now_open


def _fleet(start, cap=2000, engines=(E0, E1)):
    lg = Ledger(headroom=1.0, pressure_threshold=0.99, stale_after_s=1e9, lease_ttl_s=1e9)
    co = ProgramCoordinator(lg, max_wait_s=30.0, program_ttl_s=600.0, overdue_default_s=100.0,
                            reclaim_after_s=None, pause_start_ratio=start, pause_stop_ratio=start / 2,
                            pause_min_span_s=1.0)
    co.reconcile(ClusterSnapshot.build({e: EngineCapacity.from_pools([(cap, 0, 0.0)]) for e in engines}, 0.0), 0.0)
    return co


def _teach_rate(co, t, place=E0, per_token=0.001):
    """Ten one-turn answers timed as 0.05 s + per_token x prefilled: the prefill rate is learned."""
    return teach_prefill_rate(co, t, place, per_token, [100 + 50 * i for i in range(10)], reserve=50,
                              prompt_tokens=40, completion_tokens=5)


def test_closed_gate_admits_as_lifecycle_alone_and_pauses_nobody():
    """A full engine and no evidence that re-prefill costs anything: new programs go at once (over the
    ceiling), nobody pauses, and the figures say why."""
    co = _fleet(start=0.3, engines=(E0,))
    t = _teach_rate(co, 0.0)
    for i in range(6):  # six programs of 900 tokens on a 2,000-token engine
        d = co.submit(f"a{i}", 900, False, t, place=E0, session_id=f"s{i}", prompt_tokens=880)
        assert d.kind is Kind.ADMIT, d
        co.release(f"a{i}", t + 0.5, {"prompt_tokens": 880, "cached_tokens": 0, "completion_tokens": 20})
        assert co.take_actions() == []
    assert co.counters["pause"] == 0 and co.counters["wait"] == 0
    assert co.counters["admit_gate_closed"] >= 4
    st_ = co.stats(t + 1)["pause_gate"]
    assert st_["open"] is False and st_["reprefill_tokens"] == 0


def test_gate_opens_when_reprefill_dominates_and_the_policy_pauses_again():
    """Programs whose engine keeps re-prefilling their own prefix (cached_tokens far below what they held) make
    the ratio large: the gate opens and the next new program waits for room, an in-tool program pauses."""
    co = _fleet(start=0.3, engines=(E0,))
    t = _teach_rate(co, 0.0)  # 0.001 s a token

    def answer(ticket, prompt, cached):  # timed as the engine's rate says
        co.release(ticket, t + 0.05 + 0.001 * (prompt - cached), {"prompt_tokens": prompt, "cached_tokens": cached,
                                                                   "completion_tokens": 5})

    for i in range(2):
        assert co.submit(f"a{i}", 900, False, t, place=E0, session_id=f"s{i}", prompt_tokens=880).kind is Kind.ADMIT
        answer(f"a{i}", 880, 0)
    # each comes back and finds its 885-token context gone: ~0.9 s of re-prefill per turn
    for k in range(4):
        t += 1.0
        for i in range(2):
            tk = f"b{k}{i}"
            assert co.submit(tk, 920, False, t, place=E0, session_id=f"s{i}", prompt_tokens=900).kind is Kind.ADMIT
            answer(tk, 900, 0)
    stats = co.stats(t)["pause_gate"]
    assert stats["ratio"] >= 0.3 and stats["reprefill_tokens"] == 2 * 885 + 6 * 900
    d = co.submit("new", 900, False, t + 0.2, place=E0, session_id="s9", prompt_tokens=880)
    assert co.gate.is_open
    assert d.kind is Kind.WAIT or co.counters["pause"] >= 1


@settings(max_examples=150, deadline=None)
@given(ops=st.one_of(programs(), st.lists(st.tuples(st.sampled_from(["turn", "end", "tick", "close"]),
                                                     st.integers(0, 9), st.integers(50, 1500), st.floats(0.0, 2.0)),
                                           min_size=20, max_size=80)),
       cap=st.integers(800, 2500), engines=st.integers(1, 2))
def test_a_gate_that_never_opens_never_holds_or_pauses(ops, cap, engines):
    """Over random fleets, programs and event orders (most outgrowing a pool, where an open gate would hold a
    turn or pause a program): with the gate closed the policy is lifecycle alone: every turn is admitted when it
    arrives, nothing waits, nothing pauses, and no ended program keeps a reservation."""
    places = [f"http://e{i}" for i in range(engines)]
    co = _fleet(start=1000.0, cap=cap, engines=tuple(places))
    t, inflight, n = 0.0, {}, 0
    for op, i, size, dt in ops:
        t += dt
        sid = f"s{i}"
        if op == "turn" and sid not in inflight:
            n += 1
            d = co.submit(f"t{n}", size, False, t, place=places[i % engines], session_id=sid,
                          prompt_tokens=size - 10)
            assert d.kind is Kind.ADMIT, d
            inflight[sid] = f"t{n}"
        elif op == "end" and sid in inflight:
            co.release(inflight.pop(sid), t, {"prompt_tokens": size, "cached_tokens": size // 3,
                                              "completion_tokens": 10})
        elif op == "close" and sid not in inflight:
            co.forget(sid, t)
            assert co.ledger.holding(sid) == 0
        else:
            assert co.pump(t) == []
        # no close (no pause); an ended program is only reported, for placement to stop counting it
        assert all(a.kind == "ended" for a in co.take_actions()) and co.waiting == 0
        for p in co._programs.values():
            if p.state is ProgramState.IN_TOOL and p.overdue_at <= t:
                assert co.ledger.holding(p.sid) == 0, p.sid
    assert co.counters["pause"] == 0 and co.counters["wait"] == 0


@settings(max_examples=150, deadline=None)
@given(decode=st.lists(st.booleans(), min_size=1, max_size=4),
       turns=st.lists(st.tuples(st.integers(0, 3), st.integers(100, 1500), st.floats(0.0, 1.0), st.floats(0.1, 2.0)),
                      min_size=10, max_size=60))
def test_a_decode_workers_misses_are_transfers_and_never_open_the_gate(decode, turns):
    """Over random fleets of regular engines and PD decode workers and random turns whose engine lost part of
    what the program held: the gate counts as re-prefill exactly the misses on regular engines; a decode
    worker's come back by KV transfer (counted apart), so a fleet of decode workers alone never opens the gate."""
    places = [f"http://e{i}" for i in range(len(decode))]
    decode_urls = [p for p, d in zip(places, decode) if d]
    co = _fleet(start=0.3, cap=100_000, engines=tuple(places))
    co.reconcile(ClusterSnapshot.build({e: EngineCapacity.from_pools([(100_000, 0, 0.0)]) for e in places}, 0.0,
                                       decode_urls), 0.0)
    t = 0.0
    for e in places:
        t = _teach_rate(co, t, place=e, per_token=0.01)  # a slow engine: a miss costs seconds of re-prefill
    held: dict[str, int] = {}
    want_reprefill = want_transfer = 0
    for n, (i, prompt, kept, dt) in enumerate(turns):
        t += dt
        sid, place = f"s{i}", places[i % len(places)]
        before = held.get(sid, 0)
        d = co.submit(f"t{n}", prompt + 20, False, t, place=place, session_id=sid, prompt_tokens=prompt)
        assert d.kind is not Kind.WAIT or co.gate.is_open
        if d.kind is Kind.WAIT:
            continue
        cached = min(prompt, int(before * kept))
        # answered as the engine's rate says: a miss on a regular engine costs its re-prefill's seconds
        co.release(f"t{n}", t + 0.05 + 0.01 * (prompt - cached), {"prompt_tokens": prompt, "cached_tokens": cached,
                                                                   "completion_tokens": 10})
        miss = min(before, prompt) - cached if before > cached else 0
        if miss > 0:
            if place in decode_urls:
                want_transfer += miss
            else:
                want_reprefill += miss
        held[sid] = prompt + 10
        co.take_actions()
    assert co.gate.reprefill_tokens == want_reprefill
    assert co.counters["transfer_refill_tokens"] == want_transfer
    if all(decode):
        assert not co.gate.is_open and co.counters["pause"] == 0 and co.counters["wait"] == 0


def test_the_snapshot_names_decode_workers_on_the_wire_and_an_older_replicas_names_none():
    snap = ClusterSnapshot.build({E0: EngineCapacity.from_pools([(1000, 10, 0.01)]), E1: None}, 5.0, [E0, E1, "x"])
    assert snap.decode_workers == frozenset({E0, E1})
    back = ClusterSnapshot.from_wire(snap.to_wire(), 7.0)
    assert back.decode_workers == frozenset({E0, E1}) and back.taken_at == 7.0
    old = {k: v for k, v in snap.to_wire().items() if k != "decode_workers"}
    assert ClusterSnapshot.from_wire(old, 7.0).decode_workers == frozenset()
