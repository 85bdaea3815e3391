"""Program-aware admission on real sockets: kvgate (admission on) -> real smg -> simulated engines."""

import asyncio
import time

import aiohttp
import orjson
import pytest

from kvgate.tools.procs import free_port

POLL = 0.1  # admission_poll_interval_s in these tests (staleness bound: max(3 x POLL, 5 s) = 5 s)


def _gen(n_prompt: int, max_new: int, first: int = 1) -> dict:
    return {"input_ids": list(range(first, first + n_prompt)),
            "sampling_params": {"max_new_tokens": max_new, "ignore_eos": True}}


async def _send(http, url, body, headers=None):
    async with http.post(url + "/generate", data=orjson.dumps(body),
                         headers={"Content-Type": "application/json", **(headers or {})}) as r:
        payload = await r.read()
        return r.status, r.headers.get("X-Kvgate-Admission"), int(r.headers.get("X-Kvgate-Queue-Ms", "-1")), payload


async def _ready(gw):
    """Wait for the first capacity snapshot (an event of the poller, not a sleep)."""
    while gw.gate.ledger.snapshot is None or gw.gate.ledger.ceiling == 0:
        await gw.poller.round_done.wait()


def _spy_order(gw) -> list:
    """Tickets in the order the gate let them go (the coordinator's consumed() is called once per request)."""
    order = []
    original = gw.gate.coord.consumed

    def consumed(ticket):
        order.append(ticket)
        return original(ticket)

    gw.gate.coord.consumed = consumed
    return order


async def _until(gw, pred, what: str, timeout: float = 10.0):
    """Wait on the gate's change events (submit, grant, release, cancel, reconcile) until ``pred()`` holds."""
    try:
        await gw.gate.wait_until(pred, timeout)
    except asyncio.TimeoutError:
        raise AssertionError(f"timed out waiting for {what}") from None


@pytest.fixture
async def fleet(sim_factory, router_factory, kvgate_factory):
    """One small engine (2,000-token KV pool) behind smg, kvgate with admission on (headroom 0.9 -> ceiling 1,800)."""
    async def make(engine_opts=None, **cfg):
        e = await sim_factory(**{"max_total_num_tokens": 2000, "speed": 4.0, **(engine_opts or {})})
        router = await router_factory([e.url])
        gw, kv = await kvgate_factory(upstream=router, agentic_program_admission=True,
                                      admission_poll_interval_s=POLL, discovery_interval_s=0.2,
                                      **{"agentic_admission_max_wait_s": 30.0, **cfg})
        await gw.directory.first_refresh.wait()
        await _ready(gw)
        return e, router, gw, kv
    return make


async def test_under_pressure_requests_wait_then_go_in_arrival_order(fleet):
    e, router, gw, kv = await fleet()
    assert gw.gate.ledger.ceiling == 1800
    order = _spy_order(gw)
    async with aiohttp.ClientSession() as http:
        tasks = []
        for i in range(6):  # each reserves 100 prompt + 400 completion = 500 tokens: 3 fit in 1,800
            tasks.append(asyncio.create_task(_send(http, kv, _gen(100, 400, first=1000 * i + 1))))
            await _until(gw, lambda n=i + 1: gw.gate.coord.counters["admit"] + gw.gate.coord.waiting == n, "submit")
        assert gw.gate.coord.waiting == 3 and gw.gate.ledger.reserved == 1500
        results = await asyncio.gather(*tasks)
    assert [r[0] for r in results] == [200] * 6
    assert [r[1] for r in results] == ["admit"] * 6
    assert [r[2] for r in results[:3]] == [0, 0, 0]
    assert all(r[2] > 0 for r in results[3:])  # the last three waited
    assert order == sorted(order)  # proceeded in arrival order
    c = gw.gate.coord.counters
    assert (c["admit"], c["wait"], c["bypass"]) == (6, 3, 0)
    assert gw.gate.ledger.reserved == 0 and gw.gate.ledger.lease_count == 0
    m = gw.metrics.render()[0].decode()
    assert "agentic_kv_admission_admit_total 6.0" in m and "agentic_kv_admission_wait_total 3.0" in m
    assert "agentic_kv_budget_ceiling_tokens 1800.0" in m
    assert "agentic_kv_admission_wait_seconds_count 3.0" in m


async def test_disconnect_while_waiting_leaves_nothing_reserved(fleet):
    e, router, gw, kv = await fleet()
    async with aiohttp.ClientSession() as http:
        big = asyncio.create_task(_send(http, kv, _gen(100, 1500)))  # 1,600 reserved
        await _until(gw, lambda: gw.gate.ledger.reserved == 1600, "first lease")
        waiter = asyncio.create_task(_send(http, kv, _gen(100, 400, first=5000)))
        await _until(gw, lambda: gw.gate.coord.waiting == 1, "a waiter")
        waiter.cancel()
        await asyncio.gather(waiter, return_exceptions=True)
        await _until(gw, lambda: gw.gate.coord.waiting == 0, "the waiter removed")
        assert gw.gate.coord.counters["cancelled"] == 1
        assert gw.gate.ledger.reserved == 1600  # only the running request's lease
        status, decision, _, _ = await big
    assert (status, decision) == (200, "admit")
    assert gw.gate.ledger.reserved == 0 and gw.gate.ledger.lease_count == 0
    assert e.stats()["totals"]["num_requests"] == 1  # the cancelled waiter never reached the engine


async def test_aging_releases_the_head_after_max_wait(fleet):
    e, router, gw, kv = await fleet(agentic_admission_max_wait_s=0.5)
    async with aiohttp.ClientSession() as http:
        big = asyncio.create_task(_send(http, kv, _gen(100, 1500)))
        await _until(gw, lambda: gw.gate.ledger.reserved == 1600, "first lease")
        t0 = time.monotonic()
        status, decision, queue_ms, _ = await _send(http, kv, _gen(100, 400, first=7000))
        took = time.monotonic() - t0
        await big
    assert (status, decision) == (200, "bypass-aged")
    assert queue_ms >= 500 and took >= 0.5  # not before max_wait (how late on a busy machine is not asserted)
    assert gw.gate.coord.counters["bypass_aged"] == 1


async def test_oversized_request_does_not_wait_for_aging(fleet):
    e, router, gw, kv = await fleet(agentic_admission_max_wait_s=60.0)
    async with aiohttp.ClientSession() as http:
        # 1,000 + 850 = 1,850 > ceiling 1,800 (and still fits the engine's 2,000-token pool)
        status, decision, queue_ms, body = await _send(http, kv, _gen(1000, 850))
    assert (status, decision, queue_ms) == (200, "admit", 0)
    assert gw.gate.ledger.stats(0)["oversized_granted"] == 1


async def test_protected_and_eval_scope(fleet):
    e, router, gw, kv = await fleet(admission_eval_rules=[{"field": "rid", "equals": "eval-1"}])
    async with aiohttp.ClientSession() as http:
        big = asyncio.create_task(_send(http, kv, _gen(100, 1500)))
        await _until(gw, lambda: gw.gate.ledger.reserved == 1600, "first lease")
        p = await _send(http, kv, _gen(100, 400, first=9000), {"X-Kvgate-Protected": "1"})
        ev = await _send(http, kv, {**_gen(10, 5, first=9500), "rid": "eval-1"})
        evh = await _send(http, kv, _gen(10, 5, first=9600), {"X-Kvgate-Scope": "eval"})
        await big
    assert (p[0], p[1], p[2]) == (200, "bypass-protected", 0)
    assert (ev[1], evh[1]) == ("off", "off")
    c = gw.gate.coord.counters
    assert (c["bypass_protected"], c["wait"]) == (1, 0)


async def test_router_down_degrades_to_bypass_within_staleness_bound(sim_factory, kvgate_factory, log_dir):
    from kvgate.tools import procs
    e = await sim_factory(max_total_num_tokens=2000)
    port, mport = free_port(), free_port()
    p = procs.start("smg-adm", procs.smg_command(port, [e.url], mport), log_dir, url=f"http://127.0.0.1:{port}")
    try:
        await asyncio.to_thread(procs.wait_http, p.url + "/readiness", 60, p, procs.router_ready(1))
        gw, kv = await kvgate_factory(upstream=p.url, agentic_program_admission=True, admission_poll_interval_s=POLL,
                                      discovery_interval_s=0.1)
        await _ready(gw)
        assert not gw.gate.ledger.is_degraded(gw.gate.clock())
    finally:
        p.stop()
    while not gw.gate.ledger.is_degraded(gw.gate.clock()):  # staleness is a matter of time: check each round
        await asyncio.wait_for(gw.poller.round_done.wait(), 10)
    now = gw.gate.clock()
    # degraded when the last good snapshot turned stale: max(3 x poll, 5 s) = 5 s after it; no snapshot came
    # once discovery saw the router gone (no wall-clock upper bound: how late a poll round runs on a busy machine
    # is not kvgate's rule; the bound itself is exact)
    taken = gw.gate.ledger.snapshot.taken_at
    assert gw.gate.ledger.degraded_at() - taken == 5.0
    assert now >= taken + 5.0
    while gw.directory.last_error is None:  # discovery sees the router gone on its next round
        await asyncio.wait_for(gw.directory.refreshed.wait(), 10)
    async with aiohttp.ClientSession() as http:
        status, _, _, _ = await _send(http, kv, _gen(10, 5))
    assert status == 502  # nothing to answer it, but it was not held
    assert gw.gate.coord.counters["bypass_degraded"] == 1 and gw.gate.coord.waiting == 0
    async with aiohttp.ClientSession() as http:
        async with http.get(kv + "/kvgate/stats") as r:
            stats = await r.json()
    assert stats["ledger"]["degraded"] is True and stats["degraded_rate"] == 1.0


async def test_metrics_down_is_degraded_bypass(sim_factory, router_factory, kvgate_factory):
    e = await sim_factory(max_total_num_tokens=2000, disable_metrics=True)
    router = await router_factory([e.url])
    # The engine serves requests but its KV figures cannot be read (/metrics is 404 without --enable-metrics).
    gw, kv = await kvgate_factory(upstream=router, agentic_program_admission=True, admission_poll_interval_s=POLL,
                                  admission_capacity_source="metrics")
    while gw.poller.last_sources.get(e.url) is None:  # a round that has seen the engine
        await gw.poller.round_done.wait()
    assert gw.poller.last_sources[e.url] == "failed"
    assert gw.gate.ledger.is_degraded(gw.gate.clock())
    async with aiohttp.ClientSession() as http:
        status, decision, queue_ms, _ = await _send(http, kv, _gen(10, 5))
    assert (status, decision, queue_ms) == (200, "bypass-degraded", 0)  # the router answered; admission stood aside


@pytest.mark.parametrize("engine_opts, source, ceiling", [
    ({"tp_copies": 4}, "metrics", 1800),        # identical TP copies counted once, not x4
    ({"dp_size": 2}, "metrics", 3600),          # DP ranks summed
    ({"dp_size": 2}, "loads", 3600),
])
async def test_capacity_aggregation_tp_dp(fleet, engine_opts, source, ceiling):
    e, router, gw, kv = await fleet(engine_opts=engine_opts, admission_capacity_source=source)
    assert gw.gate.ledger.ceiling == ceiling
    assert gw.poller.last_sources[e.url] == ("/metrics" if source == "metrics" else "/v1/loads")


async def test_inferred_session_freed_when_its_client_leaves_the_queue(fleet):
    e, router, gw, kv = await fleet(agentic_session_lifecycle=True)
    async with aiohttp.ClientSession() as http:
        big = asyncio.create_task(_send(http, kv, _gen(100, 1500)))
        await _until(gw, lambda: gw.gate.ledger.reserved == 1600, "first lease")
        prompt = _gen(200, 400, first=20_000)  # no session id anywhere: kvgate infers one
        waiter = asyncio.create_task(_send(http, kv, prompt))
        await _until(gw, lambda: gw.gate.coord.waiting == 1, "a waiter")
        waiter.cancel()
        await asyncio.gather(waiter, return_exceptions=True)
        await _until(gw, lambda: gw.gate.coord.waiting == 0, "the waiter removed")
        await big
    # the inferred session is not left "in flight", and the attempt that never went out moved nothing:
    # kvgate keeps no prompt of a turn that did not complete (its retry is matched as the turn it was)
    assert all(t.in_flight == 0 for t in gw.inference._tracks.values())
    assert gw.inference.stats()["abandoned"] == 1
    longer = {**prompt, "input_ids": prompt["input_ids"] + [7] * 100}
    assert gw.inference.infer(longer["input_ids"], gw.lifecycle.clock()).reason == "new"
