"""The admission gate's edges that need no network: the place the request path gives it, a call it moves,
and the pause action reaching the injected closer."""

from kvgate.admission.capacity import ClusterSnapshot, EngineCapacity
from kvgate.admission.gate import AdmissionGate
from kvgate.admission.program import Action
from kvgate.config import validate
from kvgate.common.metrics import Metrics


def _gate(policy="fifo", **kw):
    cfg = validate({"agentic_program_admission": True, "admission_policy": policy,
                    "admission_pause_start_ratio": 0})  # the program policy's rules, paused whatever re-prefill costs
    return AdmissionGate(cfg, Metrics(), clock=lambda: 0.0, **kw)


async def test_the_place_stage_decides_where_the_lease_counts_and_a_movable_call_may_move():
    """The gate counts a call where the placement stage sent it (RequestInfo.place); a call kvgate places
    (movable) that finds its engine full is admitted on another engine with room, and the ticket names it."""
    import orjson

    from kvgate.common.admission_seam import RequestInfo
    from kvgate.common.classify import classify

    g = _gate("program")
    g.reconcile(ClusterSnapshot.build({"http://e0": EngineCapacity.from_pools([(10_000, 0, 0.0)]),
                                       "http://e1": EngineCapacity.from_pools([(10_000, 0, 0.0)])}, 0.0))

    def info(sid, n, place, movable):
        raw = orjson.dumps({"input_ids": list(range(n * 10_000, n * 10_000 + 4000)),
                            "sampling_params": {"max_new_tokens": 1000}})
        return RequestInfo(classify("POST", "/generate", raw), {}, sid, place, movable)

    t = await g.acquire(info("a", 1, ("http://e0", None), False))
    assert (t.decision, t.place) == ("admit", None) and g.ledger.reserved_on("http://e0") == 5000
    t = await g.acquire(info("b", 2, ("http://e0", None), True))  # 10,000 > e0's 9,000: e1 has room
    assert (t.decision, t.place) == ("admit", ("http://e1", None))
    assert g.ledger.reserved_on("http://e1") == 5000 and g.coord.counters["moved"] == 1


def test_the_resident_bound_reaches_the_program_policy_and_its_series():
    from prometheus_client import generate_latest

    cfg = validate({"agentic_program_admission": True, "admission_policy": "program", "admission_pause_start_ratio": 0,
                    "admission_program_max_resident": 1})
    g = AdmissionGate(cfg, Metrics(), clock=lambda: 0.0)
    co = g.coord
    assert co.max_resident == 1 and _gate("program").coord.max_resident is None
    co.reconcile(ClusterSnapshot.build({"http://e0": EngineCapacity.from_pools([(10_000, 0, 0.0)])}, 0.0), 0.0)
    co.submit(1, 1000, False, 0.0, place="http://e0", session_id="a")
    assert co.submit(2, 1000, False, 0.0, place="http://e0", session_id="b").reason == "resident-bound"
    text = generate_latest(g.metrics.registry).decode()
    assert "agentic_kv_program_waiting_bound 1.0" in text
    assert "agentic_kv_program_resident_bound_waits_total 1.0" in text
    assert g.stats()["seats"] == {"http://e0": {"resident": 1, "kept_for_paused": 0, "limit": 1}}


def test_pause_actions_reach_the_closer_and_a_failing_closer_is_contained():
    closed = []
    g = _gate("program", pause_session=closed.append)
    co = g.coord
    co.reconcile(ClusterSnapshot.build({"http://e0": EngineCapacity.from_pools([(10_000, 0, 0.0)])}, 0.0), 0.0)
    co.submit(1, 4000, False, 0.0, session_id="a")
    co.release(1, 0.0, {"prompt_tokens": 3900, "completion_tokens": 100})
    co.submit(2, 3000, False, 0.0, session_id="b")
    co.release(2, 0.0, {"prompt_tokens": 2900, "completion_tokens": 100})
    co.submit(3, 7000, False, 0.0, session_id="c", prompt_tokens=6000)  # new: waits
    co.submit(4, 7000, False, 0.0, session_id="a", prompt_tokens=6500)  # a continues: 3,000 + 7,000 > 9,000
    g._run_actions()
    assert closed == ["b"]

    def broken(sid):
        raise RuntimeError("lifecycle down")

    g.pause_session = broken
    co._actions.append(Action("close", "x", None))
    g._run_actions()  # logged and counted, never raised
    assert g.metrics.faults.labels("admission")._value.get() == 1


async def test_a_waiter_holds_its_raw_bytes_not_its_parsed_body():
    """A 64K-token prompt parsed is ~2.3 MB of int objects: a request waiting in the FIFO keeps only its raw
    bytes and a compact record (traced memory while it waits), and reads the same body once admitted."""
    import asyncio
    import tracemalloc

    import orjson

    from kvgate.common.admission_seam import RequestInfo
    from kvgate.common.classify import classify

    g = _gate()
    full = lambda used: ClusterSnapshot.build(  # noqa: E731
        {"http://e0": EngineCapacity.from_pools([(200_000, used, used / 200_000)])}, 0.0)
    g.reconcile(full(199_000))
    ids = [(i * 7919) % 150_000 + 1000 for i in range(65_536)]  # ids above the small-int cache
    raw = orjson.dumps({"input_ids": ids, "sampling_params": {"max_new_tokens": 16}})
    del ids
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        c = classify("POST", "/generate", raw)
        parsed = tracemalloc.get_traced_memory()[0] - base
        task = asyncio.ensure_future(g.acquire(RequestInfo(c, {}, None)))
        await g.wait_until(lambda: g.coord.waiting == 1)
        waiting = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert parsed > 2_000_000  # the parsed prompt, for scale
    assert waiting < 200_000, waiting  # the record and 1,024 block hashes; not the parsed prompt
    g.reconcile(full(0))
    ticket = await task
    assert ticket.decision == "admit" and ticket.handle is not None
    assert c.body["input_ids"][:2] == [1000, 8919] and len(c.body["input_ids"]) == 65_536  # parsed again
    g.release(ticket)
    assert g.coord.ledger.stats(0.0)["lease_count"] == 0


async def test_memory_is_given_back_once_a_burst_of_waiters_drains(monkeypatch):
    import asyncio

    import kvgate.admission.gate as gate_mod
    from kvgate.common.admission_seam import RequestInfo
    from kvgate.common.classify import classify

    calls = []
    monkeypatch.setattr(gate_mod, "GIVE_BACK_AFTER_WAITERS", 3)
    monkeypatch.setattr(gate_mod, "GIVE_BACK_DELAY_S", 0.0)
    monkeypatch.setattr(gate_mod, "give_back", lambda: calls.append(1) or 0.0)
    g = _gate()
    g.reconcile(ClusterSnapshot.build({"http://e0": EngineCapacity.from_pools([(10_000, 9_990, 0.999)])}, 0.0))
    raw = b'{"input_ids":[1,2,3],"sampling_params":{"max_new_tokens":8}}'
    tasks = [asyncio.ensure_future(g.acquire(RequestInfo(classify("POST", "/generate", raw), {}, None)))
             for _ in range(3)]
    await g.wait_until(lambda: g.coord.waiting == 3)
    tasks[0].cancel()
    await asyncio.gather(tasks[0], return_exceptions=True)
    assert g.given_back == 0 and g._give_back is None  # still two waiting
    for t in tasks[1:]:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await g.wait_until(lambda: g.given_back == 1)
    assert calls == [1] and g.stats()["memory_given_back"] == 1 and g.coord.waiting == 0
    # a small queue that drains gives nothing back (the peak was reset)
    t = asyncio.ensure_future(g.acquire(RequestInfo(classify("POST", "/generate", raw), {}, None)))
    await g.wait_until(lambda: g.coord.waiting == 1)
    t.cancel()
    await asyncio.gather(t, return_exceptions=True)
    assert g._give_back is None and calls == [1]


def test_give_back_runs_and_reports_its_time():
    from kvgate.common.memory import give_back

    took = give_back()
    assert 0.0 <= took < 5.0


async def _timer_asleep(g, until=None):
    """Let the started gate's timer task run up to its wait (it records the deadline it sleeps to), and, with
    ``until``, until that deadline is ``until``. Yields to the loop only (no wall-clock wait); a timer that never
    gets there fails the test instead of hanging it."""
    import asyncio
    import math
    for _ in range(100_000):
        if g._sleep_until != -math.inf and (until is None or g._sleep_until == until):
            return
        await asyncio.sleep(0)
    raise AssertionError(f"the admission timer never slept to {until}: {g._sleep_until}")


async def test_a_release_wakes_the_timer_only_for_a_deadline_sooner_than_its_own():
    """The timer is woken by a release only when a deadline now comes before the one it sleeps to: a lease
    granted while it slept with none (grants do not wake it), or, with the program policy, a session's program
    going idle (it counts as ended, and is paused, after admission_program_overdue_default_s until gaps between
    turns are known). A release that leaves nothing to watch wakes nobody:
    at one request at a time, no timer wake-up per request."""
    import math

    import orjson

    from kvgate.common.admission_seam import RequestInfo
    from kvgate.common.classify import classify

    raw = orjson.dumps({"input_ids": [1] * 16, "sampling_params": {"max_new_tokens": 16}})

    def req(sid=None):
        return RequestInfo(classify("POST", "/generate", raw), {}, sid)

    for policy in ("fifo", "program"):
        g = _gate(policy)
        g.reconcile(ClusterSnapshot.build({"http://e0": EngineCapacity.from_pools([(1_000_000, 0, 0.0)])}, 0.0))
        await g.start()
        try:
            await _timer_asleep(g)
            assert g._sleep_until == math.inf  # nothing held: no deadline
            t = await g.acquire(req())
            g.release(t)
            assert not g._kick.is_set()  # nothing left to watch
            t1, t2 = await g.acquire(req()), await g.acquire(req())
            assert t1.decision == t2.decision == "admit"
            g.release(t1)
            assert g._kick.is_set()  # it slept with no deadline: woken, so t2's expiry is watched
            await _timer_asleep(g, until=g.cfg.admission_lease_ttl_s)  # t2's expiry (clock 0)
            g.release(t2)
            assert not g._kick.is_set()
        finally:
            await g.stop()
        g = _gate(policy)
        g.reconcile(ClusterSnapshot.build({"http://e0": EngineCapacity.from_pools([(1_000_000, 0, 0.0)])}, 0.0))
        await g.start()
        try:
            await _timer_asleep(g)
            g.release(await g.acquire(req("a")))
            # the program policy: session a's program is idle now, and counts as ended unless a turn comes
            assert g._kick.is_set() is (policy == "program")
            if policy == "program":
                await _timer_asleep(g, until=g.cfg.admission_program_overdue_default_s)
        finally:
            await g.stop()


def test_the_pause_gate_keys_reach_the_program_policy():
    """The shipped default holds and pauses only once re-prefill costs 1.5 s per engine second, stops below 0.2;
    a stop ratio above the start ratio stops startup naming the key."""
    import pytest

    from kvgate.config import ConfigError

    from prometheus_client import generate_latest

    cfg = validate({"agentic_program_admission": True, "admission_policy": "program"})
    g = AdmissionGate(cfg, Metrics(), clock=lambda: 0.0)
    co = g.coord
    assert (co.gate.start_ratio, co.gate.stop_ratio, co.gate.is_open) == (1.5, 0.2, False)
    text = generate_latest(g.metrics.registry).decode()
    assert "agentic_kv_program_pausing 0.0" in text and "agentic_kv_program_reprefill_ratio NaN" in text
    assert g.stats()["pause_gate"]["start_ratio"] == 1.5
    assert _gate("program").coord.gate.is_open  # 0: always
    with pytest.raises(ConfigError, match="^admission_pause_stop_ratio: must be <= admission_pause_start_ratio"):
        validate({"agentic_program_admission": True, "admission_policy": "program",
                  "admission_pause_start_ratio": 0.5, "admission_pause_stop_ratio": 0.8})


def test_foresight_reaches_the_program_policy_and_says_when_it_opens_the_gate(caplog):
    """admission_foresee_cycles (20 by default, 0 off) reaches the policy; the gauge shows the last reading;
    the log says once what foresight read at the first overflow and when pausing starts, with the figures."""
    import logging

    from prometheus_client import generate_latest

    on = validate({"agentic_program_admission": True, "admission_policy": "program"})
    assert AdmissionGate(on, Metrics(), clock=lambda: 0.0).coord.gate.foresee_cycles == 20.0
    off = validate({"agentic_program_admission": True, "admission_policy": "program",
                    "admission_foresee_cycles": 0})
    assert AdmissionGate(off, Metrics(), clock=lambda: 0.0).coord.gate.foresee_cycles == 0.0
    g = AdmissionGate(on, Metrics(), clock=lambda: 5.0)
    text = generate_latest(g.metrics.registry).decode()
    assert "agentic_kv_program_pause_foresight NaN" in text
    assert [g.stats()["pause_gate"][k] for k in ("foresight", "foresight_first", "foresight_peak")] == [None] * 3
    caplog.set_level(logging.INFO, logger="kvgate.admission")
    gate = g.coord.gate
    gate.foresee(1.0, 7.5)  # below 20: read, the gate stays closed
    g._log_pause_gate()
    g._log_pause_gate()  # nothing new: nothing logged
    gate.foresee(2.0, 31.25)
    g._log_pause_gate()
    gate.foresee(2.5, 3.0)  # a lower reading after it: the line still names the one that opened the gate
    g._log_pause_gate()
    lines = [r.getMessage() for r in caplog.records if r.name == "kvgate.admission"]
    assert lines == ["admission: an engine's working set outgrew its ceiling (or turns waited on it while pausing was "
                     "on); prefilling a whole ceiling takes 7.50 "
                     "program cycles there (pausing starts at 20)",
                     "admission: pausing on: prefilling a whole ceiling takes 31.25 program cycles, at least "
                     "admission_foresee_cycles 20 (re-prefill ratio unknown; it stops below 0.2 once no reading "
                     f"reached 20 for {gate.window_s:g} s)"]
    text = generate_latest(g.metrics.registry).decode()
    assert "agentic_kv_program_pause_foresight 3.0" in text and "agentic_kv_program_pausing 1.0" in text
    # no program left and no re-prefill: the next poll closes it, saying what closed it
    caplog.clear()
    gate.started(2.0)
    gate.update(2.0 + gate.window_s + 30.0, 2)
    g._log_pause_gate()
    assert [r.getMessage() for r in caplog.records if r.name == "kvgate.admission"] == [
        "admission: pausing off: the re-prefill ratio fell to 0.00, below admission_pause_stop_ratio 0.2, and no "
        f"foresight reading reached 20 for {gate.window_s:g} s"]
    # opened by the measured ratio: the line names the ratio and its threshold
    caplog.clear()
    gate.observe(100.0, 5000, 200.0)
    gate.update(101.0, 2)
    g._log_pause_gate()
    ratio = gate.turned_by[1]
    assert gate.is_open and [r.getMessage() for r in caplog.records if r.name == "kvgate.admission"] == [
        f"admission: pausing on: the re-prefill ratio reached {ratio:.2f}, at least admission_pause_start_ratio 1.5 "
        "(it stops below 0.2)"]
