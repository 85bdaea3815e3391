"""Work-conserving program admission on real sockets: kvgate -> real smg -> two simulated engines of 4,000
tokens (ceilings 3,600). The same two shapes as the real-engine tier's tests, fast: a new program whose prefix
sits on a full engine goes to the empty one at once; one-turn jobs never wait out the aging bound beside KV they
no longer use."""

import asyncio

import aiohttp
import orjson

POLL = 0.1
# the program policy's rules whatever re-prefill costs (admission_pause_start_ratio 0: the gate is off)
CONFIG = dict(agentic_program_admission=True, admission_policy="program", admission_pause_start_ratio=0,
              agentic_session_lifecycle=True,
              session_placement="kvgate", admission_poll_interval_s=POLL, discovery_interval_s=0.2,
              agentic_admission_max_wait_s=60.0)


async def _post(http, kv, body, headers=None):
    async with http.post(kv + "/generate", data=orjson.dumps(body),
                         headers={"Content-Type": "application/json", **(headers or {})}) as r:
        return r.status, orjson.loads(await r.read()), r.headers


def _body(ids, max_new):
    return {"input_ids": ids, "sampling_params": {"max_new_tokens": max_new, "ignore_eos": True}}


async def _fleet(sim_factory, router_factory, kvgate_factory, speed, **extra):
    engines = [await sim_factory(max_total_num_tokens=4000, speed=speed) for _ in range(2)]
    router = await router_factory([e.url for e in engines])
    gw, kv = await kvgate_factory(upstream=router, **{**CONFIG, **extra})
    await gw.directory.first_refresh.wait()
    while gw.gate.ledger.snapshot is None or len(gw.gate.ledger.snapshot.engines) < 2:
        await gw.poller.round_done.wait()
    return engines, gw, kv


async def test_a_new_program_placed_on_a_full_engine_goes_to_the_empty_one_at_once(sim_factory, router_factory,
                                                                                   kvgate_factory):
    engines, gw, kv = await _fleet(sim_factory, router_factory, kvgate_factory, 20.0,
                                   placement_pressure_threshold=0.95)
    first = list(range(1000, 2500))
    async with aiohttp.ClientSession() as http:
        st, t1, _ = await _post(http, kv, _body(first, 100), {"X-Session-ID": "home"})
        assert st == 200
        second = first + t1["output_ids"] + list(range(3000, 4500))
        st, t2, h2 = await _post(http, kv, _body(second, 100), {"X-Session-ID": "home"})
        assert st == 200 and h2["X-Kvgate-Admission"] == "admit"
        home = gw.placement.engine_of("home")[0]
        assert gw.gate.ledger.reserved_on(home) == 3200  # home's context, held between turns
        st, obj, h = await _post(http, kv, _body(first + list(range(5000, 6800)), 100), {"X-Session-ID": "new"})
        async with http.get(kv + "/kvgate/sessions/new") as r:
            new = await r.json()
    assert st == 200 and obj["meta_info"]["completion_tokens"] == 100
    assert (h["X-Kvgate-Admission"], h["X-Kvgate-Queue-Ms"]) == ("admit", "0")
    other = next(e.url for e in engines if e.url != home)
    # placement's projected KV sees that it does not fit beside home's 3,200 (it would add 3,300 - the shared
    # 1,500): it places the session on the empty engine itself, so admission has nothing to move (admission's
    # move is tested in test_admission_gate.py)
    assert new["engine"]["url"] == other and new["engine"]["moves"] == 0, new
    assert gw.placement.counts["kv_moved"] == 1
    counters = gw.gate.stats()["counters"]
    assert counters["moved"] == 0 and counters["pause"] == 0, counters
    assert gw.gate.ledger.reserved_on(home) == 3200  # home keeps its context: nothing was paused


async def test_one_turn_jobs_never_wait_out_the_aging_bound(sim_factory, router_factory, kvgate_factory):
    engines, gw, kv = await _fleet(sim_factory, router_factory, kvgate_factory, 4.0)
    system = list(range(100, 400))
    async with aiohttp.ClientSession() as http:
        jobs = await asyncio.gather(*(_post(http, kv, _body(system + list(range(10_000 * (i + 1), 10_000 * (i + 1) + 1200)),
                                                            300)) for i in range(7)))
    decisions = [h["X-Kvgate-Admission"] for *_, h in jobs]
    queued_s = sorted(int(h["X-Kvgate-Queue-Ms"]) / 1000 for *_, h in jobs)
    assert decisions == ["admit"] * 7, decisions
    assert queued_s[:4] == [0.0] * 4, queued_s  # two jobs per engine at once
    counters = gw.gate.stats()["counters"]
    assert counters["reclaimed"] >= 3 and counters["bypass_aged"] == 0, counters
    assert max(queued_s) < 30.0, queued_s
