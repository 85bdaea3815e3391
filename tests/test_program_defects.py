"""Three defects of the program policy and of placement, each with its numbers (each fails on the code before
the fix): admission decided before placement; a program that ended without a close held its KV until the TTL;
siblings over one long shared prompt all went to one engine while the other idled."""

import orjson

from kvgate.admission.capacity import ClusterSnapshot, EngineCapacity
from kvgate.admission.coordinator import Kind
from kvgate.admission.gate import AdmissionGate
from kvgate.admission.ledger import Ledger
from kvgate.admission.program import ProgramCoordinator, ProgramState
from kvgate.common.admission_seam import RequestInfo
from kvgate.common.classify import classify
from kvgate.common.metrics import Metrics
from kvgate.config import validate
from kvgate.fleet.placement import Placement, Target
from kvgate.sessions.inference import prefix_keys

E0, E1 = "http://e0", "http://e1"


def _snapshot(now=0.0, used=(0, 0)):
    return ClusterSnapshot.build({E0: EngineCapacity.from_pools([(10_000, used[0], used[0] / 10_000)]),
                                  E1: EngineCapacity.from_pools([(10_000, used[1], used[1] / 10_000)])}, now)


def _turn(sid, ids, max_new=500):
    raw = orjson.dumps({"input_ids": ids, "sampling_params": {"max_new_tokens": max_new}})
    return RequestInfo(classify("POST", "/generate", raw), {}, sid)


async def test_place_first_then_admit_a_new_sessions_first_turn_reserves_on_its_engine():
    """Two engines of 10,000 tokens (ceilings 9,000). A program in a tool call holds 8,400 tokens on e0; e1
    is empty. Before: a new session's first turn was checked against the fleet (18,000 - 8,400 free) and
    counted nowhere in particular, so first turns placed on e0 (its prefix is there) all went into e0's
    queue (4 of 4 admitted, e0's working set 8,400 + 4 x 1,500 = 14,400 against its 9,000). Now placement
    picks the engine first and the turn reserves there: on e0 it waits (working set stays 8,400); placed on
    e1 by free KV, e1's reservation is exactly the turn's 1,500 tokens."""
    cfg = validate({"agentic_program_admission": True, "admission_policy": "program", "admission_pause_start_ratio": 0,
                    "agentic_session_lifecycle": True})
    placement = Placement()
    placement.set_engines([(E0, True), (E1, True)])
    placement.set_capacity({E0: [(10_000, 0)], E1: [(10_000, 0)]}, 0.0)
    gate = AdmissionGate(cfg, Metrics(), clock=lambda: 0.0)

    def placed(info):
        """The placement stage, before admission: the call carries the engine it goes to."""
        keys = prefix_keys(info.classified.body["input_ids"])
        t = placement.place(info.session_id, keys, 0.0)
        placement.remember_prefix(keys, t)
        info.place = (t.engine, t.dp_rank)
        return info
    gate.reconcile(_snapshot())
    task = list(range(1, 1001))  # the group's task prompt, 1,000 token ids
    old = placement.place("old", prefix_keys(task), 0.0)
    placement.remember_prefix(prefix_keys(task), old)
    assert old == Target(E0)
    co = gate.coord
    co.submit("o1", 8500, False, 0.0, place=E0, session_id="old", prompt_tokens=8000)
    co.release("o1", 0.0, {"prompt_tokens": 8000, "completion_tokens": 400})
    assert gate.ledger.reserved_on(E0) == 8400 and co.state_of("old") is ProgramState.IN_TOOL

    # a sibling of "old" (same task prompt): placement sends it to e0, where the working set is full
    sibling = await _acquire_now(gate, placed(_turn("sib", task)))
    assert sibling is None  # it waits in kvgate instead of queueing in e0
    assert gate.ledger.reserved_on(E0) == 8400 and gate.ledger.reserved_on(None) == 0

    # another task: placement sends it to e1 (most free KV) and it reserves there
    t = await _acquire_now(gate, placed(_turn("other", list(range(50_000, 51_000)))))
    assert t is not None and t.decision == "admit"
    assert placement.engine_of("other") == (E1, None)
    assert gate.ledger.reserved_on(E1) == 1500 and gate.ledger.reserved_on(None) == 0


async def _acquire_now(gate, info):
    """The ticket if ``gate.acquire`` decides without waiting, else None (the waiter is cancelled)."""
    import asyncio

    task = asyncio.ensure_future(gate.acquire(info))
    for _ in range(3):
        await asyncio.sleep(0)
    if task.done():
        return task.result()
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    return None


def _coordinator(**kw):
    lg = Ledger(headroom=0.9, pressure_threshold=0.92, stale_after_s=1e6, lease_ttl_s=1e6)
    co = ProgramCoordinator(lg, max_wait_s=30.0, program_ttl_s=600.0, **kw)
    co.reconcile(ClusterSnapshot.build({E0: EngineCapacity.from_pools([(10_000, 0, 0.0)])}, 0.0), 0.0)
    return co, lg


def _turns(co, sid, size, start, gap, n, prompt0=None):
    """``n`` turns of program ``sid`` from ``start``: each answered at once, ``gap`` s of tool call apart;
    its context ``size`` tokens. Returns when its last turn ended."""
    t = start
    for i in range(n):
        d = co.submit(f"{sid}-{i}", size, False, t, place=E0, session_id=sid, prompt_tokens=size - 100)
        assert d.kind is Kind.ADMIT
        co.release(f"{sid}-{i}", t, {"prompt_tokens": size - 100, "completion_tokens": 50})
        t += gap
    return t - gap


def test_a_program_idle_far_past_its_gaps_is_ended_and_pauses_to_make_room():
    """One 10,000-token engine (ceiling 9,000). A multi-turn program shows gaps of 2 s between its turns
    (t=3 ... 11); eight one-turn programs (each named a new session and never closed) hold 1,000 tokens each
    from t=10. At t=12 a new program's 3,000-token first turn finds no room (950 + 8 x 1,000 = 8,950 held).
    Before: nothing paused them (the engine was not over its ceiling), the turn waited the whole max wait
    (30 s) and went bypass-aged at t=42, and they counted until their 600 s TTL. Now: the one-turn programs
    hold KV with no evidence they come back (one turn, no gap), so after one poll interval (2 s, t=14) the
    waiting turn reclaims three of them (longest idle first) and goes; at t=16, 3 x the p90 of the fleet's
    gaps (2 s) after their turn, the other five count as ended and are paused (their KV freed for real); the
    multi-turn program keeps its KV until its own bound (t=17)."""
    co, lg = _coordinator()
    _turns(co, "agent", 1000, 3.0, 2.0, 5)  # gaps 2, 2, 2, 2 s; in a tool call from t=11
    for i in range(8):
        _turns(co, f"one-{i}", 1050, 10.0, 0.0, 1)
    assert lg.reserved == 950 + 8 * 1000 and co.state_of("one-0") is ProgramState.IN_TOOL
    d = co.submit("new-1", 3000, False, 12.0, place=E0, session_id="new", prompt_tokens=2500)
    assert d.kind is Kind.WAIT and d.reason == "capacity_exhausted"
    assert co.next_deadline(12.0) == 14.0  # one poll interval: then KV held without evidence is reclaimed
    assert co.pump(13.9) == []
    out = co.pump(14.0)
    assert [(x.ticket, x.kind, x.waited_s) for x in out] == [("new-1", Kind.ADMIT, 2.0)]
    assert co.counters["reclaimed"] == 3 and co.counters["pause"] == 3
    assert [co.state_of(f"one-{i}") for i in range(4)] == [ProgramState.PAUSED] * 3 + [ProgramState.IN_TOOL]
    assert co.next_deadline(14.0) == 16.0  # when the other one-turn programs count as ended: 10 + 3 x 2 s
    co.pump(16.0)
    assert co.counters["pause_overdue"] == 5
    assert co.program_states(16.0)[E0] == {"live": 1, "in_tool": 1, "paused": 8, "ended": 0}
    assert lg.reserved == 950 + 3000
    assert co.state_of("agent") is ProgramState.IN_TOOL and co.next_deadline(16.0) == 17.0
    co.pump(17.0)
    assert co.state_of("agent") is ProgramState.PAUSED and lg.reserved == 3000


def test_siblings_over_one_long_shared_prompt_spread_over_idle_engines():
    """Eight agents whose first prompt is one ~3,000-token system prompt and task (3 turns each) start at once on two idle
    engines of 200,000 tokens. Before: prefix affinity held until the KV pressure threshold (0.85), and the
    engines' compute load was no input, so all eight went to one engine (8 + 0 sessions, every turn on it).
    Now a prefix engine that is the busier one by more than placement_busier_margin (4) requests (running +
    waiting, counting kvgate's calls its figures cannot include yet) takes no sibling: 5 + 3 (with margin 0,
    4 + 4), and every later turn stays on its engine."""
    p = Placement()
    p.set_engines([(E0, True), (E1, True)])
    p.set_capacity({E0: [(200_000, 0)], E1: [(200_000, 0)]}, 0.0)
    system = list(range(1, 3001))
    prompts = {f"a{i}": list(system) for i in range(8)}
    calls, where = {}, {}
    for sid, prompt in prompts.items():  # every first turn in flight at once
        keys = prefix_keys(prompt)
        t = p.place(sid, keys, 0.0)
        p.remember_prefix(keys, t)
        calls[sid] = (t, p.call_started(t, len(prompt), 0.0))
        where[sid] = t.engine
    per_engine = [sum(1 for e in where.values() if e == url) for url in (E0, E1)]
    assert per_engine == [5, 3]
    assert p.counts["busier_moved"] >= 1
    for turn in (2, 3):  # the engines report the running turns; later turns stay where their prefix is
        p.set_capacity({E0: [(200_000, 4 * 3200, 4)], E1: [(200_000, 4 * 3200, 4)]}, float(turn))
        for sid, (t, h) in calls.items():
            p.call_finished(t, h)
        for sid, prompt in prompts.items():
            own = 10_000 * int(sid[1:]) + turn * 1000
            prompts[sid] = prompt + list(range(500_000 + own, 500_000 + own + 300))
            t = p.place(sid, prefix_keys(prompts[sid]), float(turn))
            assert t.engine == where[sid]
            calls[sid] = (t, p.call_started(t, len(prompts[sid]), float(turn)))
    assert p.sessions_on(E0) == 5 and p.sessions_on(E1) == 3
