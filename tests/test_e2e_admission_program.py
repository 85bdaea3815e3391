"""admission_policy: program on real sockets: kvgate -> real smg -> a simulated engine. Programs are
sessions (top-level session_id); the engine lookup is injected as a placement would provide it."""

import asyncio

import aiohttp
import orjson

from conftest import CloseWatcher
from kvgate.admission.program import ProgramState

POLL = 0.1


async def _turn(http, kv, sid, ids, max_new=200):
    body = {"session_id": sid, "input_ids": ids, "sampling_params": {"max_new_tokens": max_new, "ignore_eos": True}}
    async with http.post(kv + "/generate", data=orjson.dumps(body), headers={"Content-Type": "application/json"}) as r:
        payload = orjson.loads(await r.read())
        return r.status, r.headers.get("X-Kvgate-Admission"), int(r.headers.get("X-Kvgate-Queue-Ms", "-1")), payload


async def _until(gw, pred, what, timeout=15.0):
    try:
        await gw.gate.wait_until(pred, timeout)
    except asyncio.TimeoutError:
        raise AssertionError(f"timed out waiting for {what}") from None


async def test_program_policy_pauses_an_in_tool_program_and_resumes_it(sim_factory, router_factory, kvgate_factory):
    e = await sim_factory(max_total_num_tokens=2000, speed=4.0)  # ceiling 2,000 x 0.9 = 1,800
    watcher = CloseWatcher(e)
    router = await router_factory([e.url])
    gw, kv = await kvgate_factory(upstream=router, agentic_program_admission=True, admission_policy="program", admission_pause_start_ratio=0,
                                  agentic_session_lifecycle=True, session_inference=False,
                                  admission_poll_interval_s=POLL, discovery_interval_s=0.2,
                                  agentic_admission_max_wait_s=60.0)
    gw.engine_of = lambda sid: (e.url, None)  # what placement will answer: every session goes to this engine
    await gw.directory.first_refresh.wait()
    while gw.gate.ledger.snapshot is None or gw.gate.ledger.ceiling == 0:
        await gw.poller.round_done.wait()
    co = gw.gate.coord
    assert gw.gate.ledger.ceiling == 1800
    a_ids = list(range(10_000, 10_600))
    b_ids = list(range(20_000, 20_600))
    async with aiohttp.ClientSession() as http:
        # two programs' first turns: 600 + 200 each; then both are in a tool call with 800 resident each
        st, dec, q, a1 = await _turn(http, kv, "A", a_ids)
        assert (st, dec, q) == (200, "admit", 0)
        st, dec, q, b1 = await _turn(http, kv, "B", b_ids)
        assert (st, dec, q) == (200, "admit", 0)
        assert co.state_of("A") is ProgramState.IN_TOOL and co.resident_of("A") == 800
        assert gw.gate.ledger.reserved == 1600
        # a new program does not start: 1,600 + 800 > 1,800
        c = asyncio.create_task(_turn(http, kv, "C", list(range(30_000, 30_600))))
        await _until(gw, lambda: co.waiting == 1, "C waits")
        # A continues (never held): 600 + 200 output + 300 tool result = 1,100 prompt + 200 -> 800 + 1,300 > 1,800
        a_ids = a_ids + a1["output_ids"] + list(range(11_000, 11_300))
        st, dec, q, a2 = await _turn(http, kv, "A", a_ids)
        assert (st, dec, q) == (200, "admit", 0)
        assert a2["meta_info"]["cached_tokens"] >= 600  # A's own prefix was still there
        # B was in its tool call: paused, and its engine session closed so its KV goes first
        assert co.state_of("B") is ProgramState.PAUSED
        await watcher.wait_for("B")
        assert gw.lifecycle.registry.get("B").state == "closed"
        # B's next turn waits in kvgate, ahead of the new program C
        b_ids = b_ids + b1["output_ids"] + list(range(21_000, 21_300))
        b = asyncio.create_task(_turn(http, kv, "B", b_ids))
        await _until(gw, lambda: co.waiting == 2, "B waits")
        assert gw.gate.stats()["waiting_resume"] == 1
        # A ends: B resumes (1,300 fits), C still waits (1,300 + 800 > 1,800)
        async with http.post(kv + "/close_session", json={"session_id": "A"}) as r:
            assert r.status == 200
        st, dec, q, _ = await b
        assert (st, dec) == (200, "admit") and q > 0
        assert co.waiting == 1 and not c.done()
        async with http.post(kv + "/close_session", json={"session_id": "B"}) as r:
            assert r.status == 200
        st, dec, q, _ = await c
        assert (st, dec) == (200, "admit") and q > 0
    assert co.pauses == {e.url: 1} and co.resumes == {e.url: 1}
    m = gw.metrics.render()[0].decode()
    assert f'agentic_kv_program_pauses_total{{engine="{e.url}"}} 1.0' in m
    assert f'agentic_kv_program_resumes_total{{engine="{e.url}"}} 1.0' in m
    assert f'agentic_kv_programs{{engine="{e.url}",state="in_tool"}} 1.0' in m  # C
    assert 'agentic_kv_session_close_total{reason="pause"} 1.0' in m
    co.forget("C", gw.gate.clock())
    assert gw.gate.ledger.reserved == 0 and gw.gate.ledger.lease_count == 0


async def test_an_idle_close_ends_the_program_and_frees_its_room(sim_factory, router_factory, kvgate_factory):
    """A session kvgate closes for idleness ends its program as a client's close does: the ledger stops
    counting the KV the engine drops, and a program waiting for that room starts."""
    e = await sim_factory(max_total_num_tokens=2000, speed=4.0)  # ceiling 2,000 x 0.9 = 1,800
    watcher = CloseWatcher(e)
    router = await router_factory([e.url])
    gw, kv = await kvgate_factory(upstream=router, agentic_program_admission=True, admission_policy="program", admission_pause_start_ratio=0,
                                  agentic_session_lifecycle=True, session_inference=False,
                                  session_idle_close_mode="fixed", session_idle_close_s=30.0,
                                  admission_poll_interval_s=POLL, discovery_interval_s=0.2,
                                  agentic_admission_max_wait_s=60.0)
    gw.engine_of = lambda sid: (e.url, None)
    await gw.directory.first_refresh.wait()
    while gw.gate.ledger.snapshot is None or gw.gate.ledger.ceiling == 0:
        await gw.poller.round_done.wait()
    co = gw.gate.coord
    async with aiohttp.ClientSession() as http:
        for sid, base in (("A", 10_000), ("B", 20_000)):
            st, dec, q, _ = await _turn(http, kv, sid, list(range(base, base + 600)))
            assert (st, dec, q) == (200, "admit", 0)
        assert co.state_of("A") is ProgramState.IN_TOOL and gw.gate.ledger.reserved == 1600
        c = asyncio.create_task(_turn(http, kv, "C", list(range(30_000, 30_600))))
        await _until(gw, lambda: co.waiting == 1, "C waits")
        # A's and B's tool calls outlast the idle threshold: the sweep closes both sessions
        real = gw.lifecycle.clock
        gw.lifecycle.clock = lambda: real() + 60.0
        assert await gw.lifecycle.sweep_idle() == 2
        assert gw.lifecycle.registry.get("A").close_reason == "idle"
        st, dec, q, _ = await c
        assert (st, dec) == (200, "admit") and q >= 0  # it waited (above) until the closes; under 1 ms after them
        await watcher.wait_for("A")
        await watcher.wait_for("B")
    assert co.state_of("A") is None and co.state_of("B") is None
    assert gw.gate.stats()["counters"]["programs_ended"] == 2
    assert gw.gate.ledger.reserved == 800  # C alone, in its tool call
    assert co.pauses == {}  # the room came from the idle closes, not from pausing anyone


async def test_place_first_then_admit_through_the_proxy(sim_factory, router_factory, kvgate_factory):
    """kvgate placing sessions (session_placement: kvgate) in front of two engines: a new session's first
    turn is placed before admission, so its reservation and then its resident KV count on the engine it went
    to, never fleet-wide (before, the first turn counted on the fleet until the session's next turn)."""
    e0, e1 = await sim_factory(max_total_num_tokens=20_000), await sim_factory(max_total_num_tokens=20_000)
    router = await router_factory([e0.url, e1.url])
    gw, kv = await kvgate_factory(upstream=router, agentic_program_admission=True, admission_policy="program", admission_pause_start_ratio=0,
                                  agentic_session_lifecycle=True, session_inference=False,
                                  session_placement="kvgate", admission_poll_interval_s=POLL,
                                  discovery_interval_s=0.2)
    await gw.directory.first_refresh.wait()
    while gw.gate.ledger.snapshot is None or len(gw.gate.ledger.snapshot.engines) < 2:
        await gw.poller.round_done.wait()
    co = gw.gate.coord
    async with aiohttp.ClientSession() as http:
        for sid, base in (("s0", 100_000), ("s1", 200_000)):
            st, dec, q, _ = await _turn(http, kv, sid, list(range(base, base + 600)))
            assert (st, dec, q) == (200, "admit", 0)
    where = {sid: gw.placement.engine_of(sid)[0] for sid in ("s0", "s1")}
    assert sorted(where.values()) == sorted([e0.url, e1.url])  # free KV, then fewer requests: one each
    states = co.program_states()
    assert "fleet" not in states
    assert {url: s["in_tool"] for url, s in states.items()} == {e0.url: 1, e1.url: 1}
    assert gw.gate.ledger.reserved_on(where["s0"]) == 800 and gw.gate.ledger.stats(0.0)["reserved_unplaced"] == 0


async def test_an_ended_program_with_pausing_off_holds_nothing_and_counts_nowhere_until_it_comes_back(
        sim_factory, router_factory, kvgate_factory):
    """The program policy with its pause gate closed (the default, on an engine with room): a session's turn
    ends and the session stays open, idle past what its gaps predict (here 0.3 s, before any gap is seen). It is
    ended: its reservation goes, and session placement stops counting its KV, although its session stays open
    (no close is sent) and the gate stays closed. Its next turn continues it on the same engine, counted again."""
    e = await sim_factory(max_total_num_tokens=20_000, speed=4.0)
    watcher = CloseWatcher(e)
    router = await router_factory([e.url])
    gw, kv = await kvgate_factory(upstream=router, agentic_program_admission=True, admission_policy="program",
                                  agentic_session_lifecycle=True, session_inference=False,
                                  admission_poll_interval_s=POLL, discovery_interval_s=0.2,
                                  admission_program_overdue_default_s=0.3)
    await gw.directory.first_refresh.wait()
    while gw.gate.ledger.snapshot is None or gw.gate.ledger.ceiling == 0:
        await gw.poller.round_done.wait()
    co = gw.gate.coord
    ids = list(range(10_000, 10_600))
    async with aiohttp.ClientSession() as http:
        st, dec, q, a1 = await _turn(http, kv, "A", ids)
        assert (st, dec, q) == (200, "admit", 0)
        engine = gw.placement.engine_of("A")[0]
        assert engine == e.url and gw.placement.as_json()[engine]["held_tokens"] == 800
        await _until(gw, lambda: gw.placement._sessions["A"].dormant, "A ended")
        assert co.gate.is_open is False and gw.gate.ledger.holding("A") == 0 and gw.gate.ledger.reserved == 0
        assert gw.gate.stats()["programs"] == {e.url: {"live": 0, "in_tool": 0, "paused": 0, "ended": 1}}
        assert gw.placement.as_json()[engine]["held_tokens"] == 0 and gw.placement.sessions_on(engine) == 0
        now = gw.gate.clock()
        assert co.next_deadline(now) is None or co.next_deadline(now) > now  # the timer sleeps
        assert gw.lifecycle.registry.get("A").state == "active" and watcher.ids == []
        st, dec, q, _ = await _turn(http, kv, "A", ids + a1["output_ids"] + list(range(11_000, 11_100)))
        assert (st, dec, q) == (200, "admit", 0)
        assert gw.placement.engine_of("A")[0] == engine and gw.placement.sessions_on(engine) == 1
        assert gw.placement.as_json()[engine]["held_tokens"] == 1_100
