"""The shared state's write batch (kvgate.shared.batch), pure: merging, order, batches, what falls back.

The property: any sequence of a replica's session writes (turn starts and ends, closes, idle claims on a few
sessions), queued and sent in batches at arbitrary points (one in flight at a time), leaves Redis as the same
writes sent one by one would. A small model of the batch script's session ops stands in for Redis here;
tests/test_shared_batch_redis.py runs the real script.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from kvgate.shared.batch import LINGER_S, Op, WriteBatch, encode, fallbacks


def turn(sid: str, delta: int, at: float) -> Op:
    return Op("turn", "turn", (f"sess:{sid}", f"place:{sid}"), session=sid, delta=delta, started=delta > 0,
              at=at)


def other(kind: str, sid: str) -> Op:
    return Op(kind, "turn" if kind == "closed" else "idle", (f"sess:{sid}",), session=sid)


class Model:
    """The batch script's session ops on one replica (state, turns in flight, last activity, epoch)."""

    def __init__(self):
        self.s: dict[str, dict] = {}

    def apply(self, op: Op) -> None:
        h = self.s.setdefault(op.session, {"state": None, "n": 0, "last": 0.0, "epoch": 0})
        if op.kind == "turn":
            h["n"] += op.delta
            if op.started:
                if h["state"] == "closing":
                    h["epoch"] += 1
                h["state"] = "active"
            h["last"] = max(h["last"], op.at)
            h["state"] = h["state"] or "active"
        elif op.kind == "closed":
            if h["state"] is not None:
                h["state"] = "closing"
        else:  # idle claim with threshold 0 on an idle session: the first one closes it
            if h["state"] in (None, "active") and h["n"] <= 0:
                h["state"] = "closing"


def test_a_turns_start_and_end_queued_together_are_one_write():
    b = WriteBatch()
    b.add(turn("s", 1, 1.0), 0.0)
    b.add(turn("s", -1, 2.0), 0.0)
    b.add(turn("t", 1, 1.5), 0.0)
    assert len(b) == 2 and b.merged == 1
    s = b.queued[0]
    assert (s.delta, s.started, s.at) == (0, True, 2.0)


def test_merging_stops_at_a_close_or_an_idle_claim_and_at_the_batch_in_flight():
    b = WriteBatch()
    b.add(turn("s", 1, 1.0), 0.0)
    b.add(other("closed", "s"), 0.0)
    b.add(turn("s", 1, 2.0), 0.0)          # after the close: its own write (it re-opens the session)
    assert [o.kind for o in b.queued] == ["turn", "closed", "turn"]
    sent = b.take(0.0)
    assert len(sent) == 3 and b.in_flight and b.take(0.0) == []   # one batch in flight at a time
    b.add(turn("s", -1, 3.0), 0.0)                                # not merged into the one in flight
    assert sent[2].delta == 1 and len(b) == 1
    assert b.due_in(1.0) is None                                  # in flight: its answer flushes again
    b.done()
    assert b.due_in(1.0) == 0.0 and b.take(1.0)[0].delta == -1


def test_a_batch_is_at_most_max_ops_oldest_first():
    b = WriteBatch(max_ops=3)
    ops = [turn(f"s{i}", 1, float(i)) for i in range(7)]
    for o in ops:
        b.add(o, 0.0)
    assert b.due_in(0.0) == 0.0   # max_ops queued: no lingering
    got = []
    while batch := b.take(0.0):
        got.append(batch)
        b.done()
    assert [len(x) for x in got] == [3, 3, 1] and sum(got, []) == ops
    with pytest.raises(ValueError):
        WriteBatch(max_ops=0)
    with pytest.raises(ValueError):
        WriteBatch(linger_s=-1)


def test_writes_linger_for_company_and_an_asker_or_a_start_takes_them_along_at_once():
    b = WriteBatch(linger_s=0.005)
    assert b.due_in(0.0) is None
    b.add(turn("s", -1, 1.0), 10.0)
    assert b.due_in(10.0) == pytest.approx(0.005)
    b.add(turn("t", -1, 1.0), 10.003)
    assert b.due_in(10.003) == pytest.approx(0.002)   # the oldest write sets the deadline
    assert b.due_in(10.006) == 0.0
    grant = Op("grant", "admission", ["lease:fleet"], ["1.0"], waiter=object())
    b.add(grant, 10.004)
    assert b.due_in(10.004) == 0.0                    # someone waits: now, with the writes before it
    assert [o.kind for o in b.take(10.004)] == ["turn", "turn", "grant"]
    b.done()
    assert b.due_in(10.004) is None
    b.add(turn("s", -1, 2.0), 20.0)                   # a fresh deadline after the queue emptied
    assert b.due_in(20.001) == pytest.approx(0.004)
    b.add(turn("s", 1, 3.0), 20.002)                  # a start merged into it: the write goes now
    assert len(b) == 1 and b.due_in(20.002) == 0.0
    b.take(20.002)
    b.done()
    b.add(turn("u", 1, 4.0), 30.0)                    # a start alone: now too
    assert b.due_in(30.0) == 0.0
    b.take(30.0)
    b.add(Op("release", "admission", ["lease:fleet"], ["m"]), 30.001)   # queued while the start is in flight
    b.done()
    assert b.due_in(30.002) == pytest.approx(0.004)   # a release lingers
    assert LINGER_S <= 0.01   # other replicas see a write this late at most: far under any idle threshold


def test_what_a_failed_batch_falls_back_as():
    rel = Op("release", "admission", ["lease:fleet"], ["r:1|5"], release=(["lease:fleet"], "r:1|5"))
    ops = [turn("s", 1, 1.0), rel, Op("link", "inference", ("link:k",), ["3|ab", "s"]), turn("t", -1, 1.0)]
    by, releases = fallbacks(ops)
    assert by == {"turn": 2, "admission": 1, "inference": 1}
    assert releases == [(["lease:fleet"], "r:1|5")]


def test_encode_declares_each_key_once_after_the_fixed_ones():
    ops = [turn("s", 1, 1.0), Op("grant", "admission", ["q:lease:fleet", "q:lease:e0"], ["1.0", 7]),
           Op("release", "admission", ["q:lease:fleet"], ["m"]), turn("s", -1, 2.0)]
    keys, rows = encode(ops, ["q:queue", "q:queue:exp", "q:queue:seq"])
    assert keys == ["q:queue", "q:queue:exp", "q:queue:seq", "sess:s", "place:s", "q:lease:fleet", "q:lease:e0"]
    assert rows == [["turn", [4, 5], "1.0", 1, 1], ["grant", [6, 7], "1.0", 7], ["release", [6], "m"],
                    ["turn", [4, 5], "2.0", -1, 0]]


session_op = st.tuples(st.sampled_from(["turn+", "turn-", "closed", "idle", "flush", "answer"]),
                       st.sampled_from(["a", "b", "c"]))


@settings(max_examples=300, deadline=None)
@given(steps=st.lists(session_op, max_size=60), max_ops=st.integers(1, 8))
def test_batched_and_merged_writes_leave_what_one_by_one_writes_leave(steps, max_ops):
    """Nothing lost, nothing reordered on a session: every op queued is sent exactly once (on its own or
    merged into an earlier queued one), batches go out one at a time in queue order, and applying them
    gives the state the same ops applied one by one give."""
    b = WriteBatch(max_ops=max_ops)
    one_by_one, batched = Model(), Model()
    t, added, flight = 0.0, 0, []
    sent: list[Op] = []
    for kind, sid in steps:
        t += 1.0
        if kind == "flush":
            if not flight:
                flight = b.take(t)
            continue
        if kind == "answer":
            for op in flight:
                batched.apply(op)
            sent += flight
            flight = []
            b.done()
            continue
        op = turn(sid, 1 if kind == "turn+" else -1, t) if kind.startswith("turn") else other(kind, sid)
        one_by_one.apply(Op(op.kind, op.label, op.keys, session=op.session, delta=op.delta, started=op.started,
                            at=op.at))
        b.add(op, t)
        added += 1
    for op in flight:
        batched.apply(op)
    sent += flight
    b.done()
    while batch := b.take(t):
        for op in batch:
            batched.apply(op)
        sent += batch
        b.done()
    assert len(sent) + b.merged == added and len({id(o) for o in sent}) == len(sent)
    assert batched.s == one_by_one.s
