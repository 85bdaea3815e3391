"""The program policy's parts on their own: the deadline heap, the turn-gap rule, the victim order, the rule and
reason enums (and that config offers exactly the rules the coordinator takes)."""

import json
import math
from types import SimpleNamespace

import orjson
import pytest
from hypothesis import given, settings, strategies as st

from kvgate.admission.deadlines import Deadlines
from kvgate.admission.ledger import REFUSAL_REASONS
from kvgate.admission.program import BOUND_REASON, RESUME_ORDERS, VICTIM_RULES, ProgramCoordinator
from kvgate.admission.records import WaitReason
from kvgate.admission.turn_gaps import FLEET_GAPS, MIN_GAPS, TurnGaps, _quantile
from kvgate.admission.victims import ResumeOrder, VictimRule, resume_key, victim_order
from kvgate.config import KEYS


def test_wait_reasons_are_the_ledgers_strings_and_serialise_as_them():
    assert {r.value for r in WaitReason} == set(REFUSAL_REASONS) | {"resident-bound"}
    for reason in REFUSAL_REASONS:
        member = WaitReason.of(reason)
        assert member == reason and hash(member) == hash(reason) and str(member) == reason
        assert f"{member}" == reason and {reason: 1}[member] == 1
        assert json.dumps({"r": member}) == json.dumps({"r": reason}) and orjson.dumps(member) == orjson.dumps(reason)
    assert BOUND_REASON == "resident-bound" and BOUND_REASON is WaitReason.RESIDENT_BOUND


def test_the_rule_names_come_from_the_enums_and_config_offers_exactly_them():
    assert VICTIM_RULES == ("smallest", "largest", "longest-idle", "ahead") == tuple(VictimRule)
    assert RESUME_ORDERS == ("smallest", "largest", "fifo") == tuple(ResumeOrder)
    keys = {k.name: k for k in KEYS}
    assert keys["admission_pause_victim"].choices == VICTIM_RULES
    assert keys["admission_resume_order"].choices == RESUME_ORDERS
    with pytest.raises(ValueError, match=r"victim must be one of \('smallest', 'largest', 'longest-idle', 'ahead'\)"):
        ProgramCoordinator(_ledger(), victim="biggest")
    co = ProgramCoordinator(_ledger(), victim="longest-idle", resume="smallest")
    s = co.stats(0.0)
    assert (s["victim"], s["resume_order"]) == ("longest-idle", "smallest") and type(s["victim"]) is str


def _ledger():
    from kvgate.admission.ledger import Ledger
    return Ledger()


@settings(max_examples=200, deadline=None)
@given(ops=st.one_of(st.lists(st.tuples(st.integers(0, 9), st.floats(0, 100), st.booleans()), max_size=30),
                    st.lists(st.tuples(st.integers(0, 9), st.floats(0, 100), st.booleans()), min_size=120,
                             max_size=300)),
       now=st.floats(0, 100))
def test_the_deadline_heap_reads_the_earliest_current_entry_and_stays_bounded(ops, now):
    """Against a plain dict of each key's current deadline: first() and pop_due() see exactly the current
    entries, and the heap never holds more than 2 x live + 64 entries after a push (the long runs of pushes
    here go past that bound, so the stale entries are dropped at once)."""
    truth: dict[int, tuple[float, int]] = {}  # key -> (deadline, stamp) it is current with
    stamp = 0
    d = Deadlines(lambda e: truth.get(e[2]) == (e[0], e[3]), lambda: len(truth))
    for key, at, drop in ops:
        if drop:
            truth.pop(key, None)  # its entries go stale
            continue
        stamp += 1
        truth[key] = (at, stamp)
        d.push(at, key, stamp)
        assert len(d) <= 2 * len(truth) + 64
    want = min((at for at, _ in truth.values()), default=None)
    assert d.first() == want
    due = sorted((e[0], e[2]) for e in d.pop_due(now))
    assert due == sorted((at, k) for k, (at, _) in truth.items() if at <= now)
    assert d.first() == min((at for at, _ in truth.values() if at > now), default=None)


def test_the_deadline_heap_keeps_push_order_on_ties_and_takes_entries_back():
    d = Deadlines(lambda e: True, lambda: 0)
    for k in "abc":
        d.push(5.0, k)
    e = d.pop()
    assert e[2] == "a"
    d.push_entry(e)
    assert [x[2] for x in d.pop_due(5.0)] == ["a", "b", "c"] and not d


def test_a_program_is_overdue_after_the_quantile_of_its_and_its_groups_gaps():
    g = TurnGaps(multiple=3.0, quantile=0.9, default_s=60.0, ttl_s=600.0)
    from collections import deque
    p = SimpleNamespace(gaps=deque(maxlen=16), group="G")
    assert g.overdue_after(p) == 60.0  # nothing seen yet: the default
    for gap in (1.0, 2.0, 4.0):
        g.record(p, gap)
    assert len(p.gaps) == MIN_GAPS and g.overdue_after(p) == 3.0 * 4.0
    sibling = SimpleNamespace(gaps=deque(maxlen=16), group="G")
    assert g.overdue_after(sibling) == 12.0  # its group's gaps speak for it
    g.forget_group("G")
    assert g.overdue_after(sibling) == 12.0  # then the fleet's (the same three gaps)
    g.record(p, -1.0)  # a negative gap is ignored
    assert list(p.gaps) == [1.0, 2.0, 4.0]
    long = TurnGaps(multiple=1000.0, quantile=0.9, default_s=60.0, ttl_s=600.0)
    q = SimpleNamespace(gaps=deque(maxlen=16), group=None)
    for gap in (1.0, 2.0, 4.0):
        long.record(q, gap)
    assert long.overdue_after(q) == 600.0  # at most the TTL
    off = TurnGaps(multiple=0.0, quantile=0.9, default_s=60.0, ttl_s=600.0)
    assert off.overdue_after(p) == math.inf


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0.0, 1e4) | st.sampled_from([0.0, 1.0, 2.5]), min_size=0, max_size=FLEET_GAPS * 2 + 40),
       st.sampled_from([0.5, 0.9, 1.0]))
def test_the_fleet_bound_is_the_quantile_of_the_newest_fleet_gaps(gaps, q):
    """The fleet's bound (kept in a sorted list as gaps come and the oldest go, not sorted again) is the quantile of
    the newest FLEET_GAPS gaps at each refresh, ties and evictions included; overdue_after reads it."""
    from collections import deque
    g = TurnGaps(multiple=1.0, quantile=q, default_s=60.0, ttl_s=1e9)
    seen, want = [], None
    for i, gap in enumerate(gaps):
        g.record(SimpleNamespace(gaps=deque(maxlen=16), group=None), gap)
        seen.append(gap)
        if g._fresh == 0:  # just refreshed
            want = _quantile(seen[-FLEET_GAPS:], q)
        assert g._fleet_sorted == sorted(seen[-FLEET_GAPS:])
    lone = SimpleNamespace(gaps=deque(maxlen=16), group=None)
    assert g.overdue_after(lone) == (60.0 if want is None else want)


def test_the_victim_order_puts_ended_programs_first_then_the_rule():
    P = SimpleNamespace
    a = P(sid="a", resident=100, since=0.0, turns=5, group="G", overdue_at=math.inf)
    b = P(sid="b", resident=300, since=5.0, turns=1, group="G", overdue_at=math.inf)
    c = P(sid="c", resident=200, since=8.0, turns=1, group=None, overdue_at=9.0)  # ended at now=10
    progs = {p.sid: p for p in (a, b, c)}
    groups = {"G": {"a", "b"}}
    order = lambda rule: [p.sid for p in victim_order(list(progs.values()), rule, 10.0, groups, progs)]  # noqa: E731
    assert order(VictimRule.SMALLEST) == ["c", "a", "b"]
    assert order(VictimRule.LARGEST) == ["c", "b", "a"]
    assert order(VictimRule.LONGEST_IDLE) == ["c", "a", "b"]
    assert order(VictimRule.AHEAD) == ["c", "a", "b"]  # a is 2 turns ahead of its group's mean
    ws = [P(tokens=5, seq=2), P(tokens=1, seq=3), P(tokens=5, seq=1)]
    assert [w.seq for w in sorted(ws, key=resume_key(ResumeOrder.FIFO))] == [1, 2, 3]
    assert [w.seq for w in sorted(ws, key=resume_key(ResumeOrder.SMALLEST))] == [3, 1, 2]
    assert [w.seq for w in sorted(ws, key=resume_key(ResumeOrder.LARGEST))] == [1, 2, 3]  # the largest first, then by arrival
