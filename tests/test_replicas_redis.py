"""Several kvgate replicas sharing state on a real redis-server (``state_backend: redis``).

Each test starts its own redis-server on 127.0.0.1 with a random port, in its own process group
(kvgate.tools.procs), and two kvgate replicas in-process in front of simulated engines. Time is the
replicas' injected clock (one fake clock for both), so idle decisions do not depend on how busy the
machine is; background writes to Redis are awaited with ``SharedState.drain``.
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
import orjson
import pytest

from kvgate.tools import procs

REDIS = procs.find_executable("redis-server") or ("/usr/bin/redis-server" if __import__("os").path.exists(
    "/usr/bin/redis-server") else None)
pytestmark = pytest.mark.skipif(REDIS is None, reason="redis-server not installed (Debian package redis-server)")


class RedisServer:
    """A redis-server of the test's own on 127.0.0.1:<random port>; stop() and start() keep the port."""

    def __init__(self, log_dir):
        self.port = procs.free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.log_dir = log_dir
        self.proc = None

    async def start(self) -> None:
        self.proc = procs.start(f"redis-{self.port}", [REDIS, "--port", str(self.port), "--bind", "127.0.0.1",
                                                       "--save", "", "--appendonly", "no"], self.log_dir)
        import redis.asyncio as redis
        c = redis.Redis(port=self.port)
        deadline = time.monotonic() + 20
        try:
            while True:  # readiness of a process we started: the one place a short pause is the event
                if not self.proc.alive():
                    raise RuntimeError(f"redis-server exited:\n{self.proc.log_tail()}")
                try:
                    if await c.ping():
                        return
                except Exception:
                    if time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(0.05)
        finally:
            await c.aclose()

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop(5.0)
            self.proc = None

    async def keys(self, pattern: str = "*") -> dict:
        import redis.asyncio as redis
        c = redis.Redis(port=self.port, decode_responses=True)
        try:
            return {k: await c.ttl(k) for k in await c.keys(pattern)}
        finally:
            await c.aclose()


@pytest.fixture
async def redis_server(log_dir):
    r = RedisServer(log_dir)
    await r.start()
    yield r
    r.stop()


class Clock:
    """One clock for every replica: monotonic and epoch seconds move together, only when told."""

    def __init__(self, t: float = 1_000_000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


async def _replicas(kvgate_factory, clock, n=2, **cfg):
    out = []
    for _ in range(n):
        gw, url = await kvgate_factory(**cfg)
        gw.lifecycle.clock = clock
        if gw.shared is not None:
            gw.shared.wall = clock
        out.append((gw, url))
    return out


async def _generate(http, url, body):
    async with http.post(url + "/generate", data=orjson.dumps(body),
                         headers={"Content-Type": "application/json"}) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def _drain(reps):
    for gw, _ in reps:
        if gw.shared is not None:
            await gw.shared.drain()


def _idle_closes(gw) -> float:
    return gw.metrics.session_close.labels("idle")._value.get()


@pytest.mark.parametrize("backend", ["redis", "memory"])
async def test_alternating_named_session_is_not_idle_closed_and_closes_once(backend, redis_server, sim_factory,
                                                                            kvgate_factory):
    """One agent's turns alternate between two replicas, a turn every 1.2 s, idle threshold 2 s: on Redis no
    replica closes it while it is active, and once it is idle exactly one replica closes it (one call per
    engine). In memory (each replica on its own) the same traffic is closed as idle: the contrast."""
    e1 = await sim_factory(max_total_num_tokens=50_000, speed=1000)
    clock = Clock()
    reps = await _replicas(kvgate_factory, clock, upstream=e1.url, engines=[e1.url],
                           agentic_session_lifecycle=True, session_inference=False, session_placement="router",
                           session_idle_close_s=2.0, state_backend=backend, redis_url=redis_server.url)
    prompt = list(range(1, 40))
    async with aiohttp.ClientSession() as http:
        for k in range(8):
            gw, url = reps[k % 2]
            out = await _generate(http, url, {"input_ids": prompt, "session_id": "agent-1",
                                              "sampling_params": {"max_new_tokens": 4}})
            prompt = prompt + out["output_ids"] + [7, 8]
            await _drain(reps)
            clock.t += 1.2
            for g, _ in reps:
                await g.lifecycle.sweep_idle()
        closes_while_active = sum(_idle_closes(g) for g, _ in reps)
        if backend == "memory":
            assert closes_while_active >= 2  # each replica alone closes the active session again and again
            return
        assert closes_while_active == 0
        assert [g.lifecycle.registry.get("agent-1").state for g, _ in reps] == ["active", "active"]
        # Now it goes idle everywhere: exactly one replica closes it, on the engine once.
        clock.t += 2.5
        for g, _ in reps:
            await g.lifecycle.sweep_idle()
        for g, _ in reps:
            await g.lifecycle.wait_until(lambda g=g: g.lifecycle.registry.get("agent-1").state == "closed", 10)
        assert sorted(_idle_closes(g) for g, _ in reps) == [0.0, 1.0]
        assert e1.engine.closes_received == 1
        skipped = [g.metrics.session_close_skipped.labels("elsewhere")._value.get() for g, _ in reps]
        assert sorted(skipped) == [0.0, 1.0]
        keys = await redis_server.keys("kvgate:sess:*")
        assert list(keys) == ["kvgate:sess:agent-1"] and 0 < keys["kvgate:sess:agent-1"] <= 86400


async def test_a_turn_in_flight_on_another_replica_keeps_the_session_open(redis_server, sim_factory, kvgate_factory):
    """A long turn on replica B: replica A, which last saw the session long ago, does not close it; after B's
    heartbeat is gone (B died mid-turn), its turn in flight no longer holds the session open."""
    e1 = await sim_factory(max_total_num_tokens=50_000, speed=1000)
    clock = Clock()
    reps = await _replicas(kvgate_factory, clock, upstream=e1.url, engines=[e1.url],
                           agentic_session_lifecycle=True, session_inference=False, session_placement="router",
                           session_idle_close_s=2.0, state_backend="redis", redis_url=redis_server.url)
    (a, url_a), (b, _) = reps
    async with aiohttp.ClientSession() as http:
        await _generate(http, url_a, {"input_ids": list(range(1, 40)), "session_id": "s",
                                      "sampling_params": {"max_new_tokens": 2}})
    b.shared.turn_started("s")  # B's turn goes out and does not end
    await _drain(reps)
    clock.t += 10
    assert await a.lifecycle.sweep_idle() == 0
    assert a.lifecycle.registry.get("s").state == "active"
    # B dies: its heartbeat stops and its key expires (deleted here instead of waiting 5 s); its turn in
    # flight no longer counts, and the session is idle since B's turn started.
    b.shared._beat.cancel()
    import redis.asyncio as redis
    c = redis.from_url(redis_server.url)
    await c.delete(f"kvgate:replica:{b.shared.replica}")
    await c.aclose()
    clock.t += 2.5
    assert await a.lifecycle.sweep_idle() == 1


async def test_placement_is_the_same_from_every_replica(redis_server, sim_factory, kvgate_factory):
    """Sessions placed by kvgate (two engines): each session's turns land on one engine whichever replica
    relays them, and both replicas report the same engine for it."""
    e1 = await sim_factory(max_total_num_tokens=50_000, speed=1000)
    e2 = await sim_factory(max_total_num_tokens=50_000, speed=1000)
    clock = Clock()
    reps = await _replicas(kvgate_factory, clock, upstream=e1.url, engines=[e1.url, e2.url],
                           agentic_session_lifecycle=True, session_inference=False, session_placement="kvgate",
                           session_idle_close_s=0, state_backend="redis", redis_url=redis_server.url)
    sids = [f"agent-{i}" for i in range(8)]
    async with aiohttp.ClientSession() as http:
        for turn in range(4):
            for i, sid in enumerate(sids):
                gw, url = reps[(i + turn) % 2]  # each session alternates, and the two replicas start them in turn
                await _generate(http, url, {"input_ids": [i + 1] * 70 + [turn], "session_id": sid,
                                            "sampling_params": {"max_new_tokens": 2}})
    seen = [e1.stats()["sessions"], e2.stats()["sessions"]]
    for sid in sids:
        per_engine = [s.get(sid, 0) for s in seen]
        assert sorted(per_engine) == [0, 4], (sid, per_engine)
        assert reps[0][0].placement.engine_of(sid) == reps[1][0].placement.engine_of(sid) is not None
    # Both engines got sessions (the shared record did not pin everything to one engine).
    assert all(sum(1 for sid in sids if s.get(sid)) > 0 for s in seen)
    assert sum(g.placement.counts["adopted"] for g, _ in reps) >= len(sids)
    # A close (through either replica) forgets the shared placement too, as one replica forgets a closed
    # session: one that comes back is placed again by the rules, not pinned to its old engine.
    assert len(await redis_server.keys("kvgate:place:*")) == len(sids)
    async with aiohttp.ClientSession() as http:
        for i, sid in enumerate(sids[:3]):
            async with http.post(reps[i % 2][1] + "/close_session", json={"session_id": sid}) as r:
                assert r.status == 200
    await _drain(reps)
    assert sorted(k.split(":")[-1] for k in await redis_server.keys("kvgate:place:*")) == sids[3:]


async def test_unnamed_agent_alternating_between_replicas_is_one_session(redis_server, sim_factory, kvgate_factory):
    """An agent that names no session, its turns alternating between two replicas: one inferred session id
    (each replica alone would start a second one); two GRPO siblings stay two sessions."""
    e1 = await sim_factory(max_total_num_tokens=50_000, speed=1000)
    clock = Clock()
    reps = await _replicas(kvgate_factory, clock, upstream=e1.url, engines=[e1.url],
                           agentic_session_lifecycle=True, session_inference=True, session_placement="router",
                           session_idle_close_s=0, state_backend="redis", redis_url=redis_server.url)
    task = list(range(100, 200))
    prompts = {"a": list(task), "b": list(task)}
    async with aiohttp.ClientSession() as http:
        for k in range(6):
            for agent in ("a", "b"):
                gw, url = reps[(k + (agent == "b")) % 2]
                out = await _generate(http, url, {"input_ids": prompts[agent],
                                                  "sampling_params": {"max_new_tokens": 8}})
                prompts[agent] = prompts[agent] + out["output_ids"] + [5, 6, 7]
                await _drain(reps)
    # The engine saw exactly two session ids, six turns each (each agent one session).
    assert sorted(e1.stats()["sessions"].values()) == [6, 6], e1.stats()["sessions"]
    shared = sum(g.metrics.session_inference.labels("shared")._value.get() for g, _ in reps)
    assert shared >= 2  # at least each replica's first turn of each agent came from the other replica


async def test_redis_stopped_and_restarted_requests_keep_flowing(redis_server, sim_factory, kvgate_factory, caplog):
    """Redis goes away: every request still goes out (the replicas fall back on their own state, counted,
    said once in the log); it comes back: the replicas share state again."""
    e1 = await sim_factory(max_total_num_tokens=50_000, speed=1000)
    clock = Clock()
    reps = await _replicas(kvgate_factory, clock, upstream=e1.url, engines=[e1.url],
                           agentic_session_lifecycle=True, session_inference=True, session_placement="kvgate",
                           session_idle_close_s=2.0, state_backend="redis", redis_url=redis_server.url)
    (a, url_a), (b, url_b) = reps

    async def turns(n, tag):
        async with aiohttp.ClientSession() as http:
            for k in range(n):
                await _generate(http, reps[k % 2][1], {"input_ids": list(range(1, 80)) + [k],
                                                       "session_id": f"{tag}-{k % 3}",
                                                       "sampling_params": {"max_new_tokens": 2}})
                await _drain(reps)

    await turns(6, "before")
    assert a.metrics.state_backend_up._value.get() == 1
    redis_server.stop()
    await turns(10, "down")  # every turn answered 200 (asserted in _generate)
    for g, _ in reps:
        assert g.metrics.state_backend_up._value.get() == 0
        bypass = sum(g.metrics.state_backend_bypass.labels(op)._value.get()
                     for op in ("turn", "idle", "placement", "inference", "heartbeat"))
        assert bypass >= 5
    clock.t += 10
    for g, _ in reps:  # no idle close decided while Redis is unreachable (asked again next sweep)
        assert await g.lifecycle.sweep_idle() == 0
    down_lines = [r for r in caplog.records if "unreachable" in r.getMessage()]
    assert len(down_lines) == 2  # once per replica

    async def health(url):
        async with aiohttp.ClientSession() as http:
            async with http.get(url + "/kvgate/health") as r:
                return r.status, await r.json()

    code, h = await health(url_a)  # said, not fatal: the replica serves on its own state
    assert (code, h["status"]) == (200, "degraded"), h
    assert [r for r in h["reasons"] if r.startswith("state_backend: Redis at ")], h["reasons"]
    await redis_server.start()
    for g, _ in reps:  # the heartbeat finds Redis back (event: the gauge)
        async def back(g=g):
            while g.metrics.state_backend_up._value.get() != 1:
                await asyncio.sleep(0.05)
        await asyncio.wait_for(back(), 10)
    code, h = await health(url_b)
    assert (code, h["status"], h["reasons"]) == (200, "ok", []), h
    await turns(4, "after")
    keys = await redis_server.keys("kvgate:sess:*")
    assert {"kvgate:sess:after-0", "kvgate:sess:after-1"} <= set(keys)
    assert all(ttl > 0 for ttl in keys.values())


async def test_admission_replicas_share_one_ceiling(redis_server, sim_factory, kvgate_factory):
    """Admission on in two replicas in front of one engine (ceiling 1,800 tokens, 500 per request): each
    replica alone would admit 3 at once (6 in all, 3,000 tokens); sharing the ceiling, the second replica's
    requests wait for room the first one's free, and the live reservations on Redis never exceed 1,800."""
    e = await sim_factory(max_total_num_tokens=2000, speed=4.0)
    reps = []
    for _ in range(2):
        gw, url = await kvgate_factory(upstream=e.url, engines=[e.url], agentic_program_admission=True,
                                       admission_poll_interval_s=0.1, agentic_admission_max_wait_s=60.0,
                                       state_backend="redis", redis_url=redis_server.url)
        while gw.gate.ledger.snapshot is None or gw.gate.ledger.ceiling == 0:
            await gw.poller.round_done.wait()
        reps.append((gw, url))
    (a, url_a), (b, url_b) = reps
    assert a.gate.ledger.ceiling == b.gate.ledger.ceiling == 1800
    fleet_key = a.shared.lease_keys(None)[0]
    peaks = []

    async def send(http, url, i):
        async with http.post(url + "/generate", data=orjson.dumps(
                {"input_ids": list(range(1000 * i + 1, 1000 * i + 101)),
                 "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}})) as r:
            await r.read()
            peaks.append(await a.shared.reserved(fleet_key))
            return r.status

    async with aiohttp.ClientSession() as http:
        first = [asyncio.create_task(send(http, url_a, i)) for i in range(3)]
        await a.gate.wait_until(lambda: len(a.gate._shared_held) == 3, 10)
        assert await a.shared.reserved(fleet_key) == 1500
        second = [asyncio.create_task(send(http, url_b, 10 + i)) for i in range(3)]
        # B's own ledger admits all three (it sees none of A's); the shared ceiling holds them back.
        await b.gate.wait_until(lambda: b.gate.coord.counters["admit"] == 3, 10)
        peaks.append(await a.shared.reserved(fleet_key))
        statuses = await asyncio.gather(*first, *second)
    assert statuses == [200] * 6
    assert max(peaks) <= 1800, peaks
    assert b.gate.shared_counts["waited"] >= 1 and b.gate.shared_counts["granted"] == 3
    for gw, _ in reps:
        await gw.shared.drain()
    assert await a.shared.reserved(fleet_key) == 0


async def test_a_dead_replicas_sessions_continue_through_another(redis_server, sim_factory, kvgate_factory):
    """An agent that names no session talks to replica A only; A dies (no more traffic, heartbeat gone).
    Its next turns through replica B, which never saw it, continue the same inferred session on the same
    engine."""
    e1 = await sim_factory(max_total_num_tokens=50_000, speed=1000)
    e2 = await sim_factory(max_total_num_tokens=50_000, speed=1000)
    clock = Clock()
    reps = await _replicas(kvgate_factory, clock, upstream=e1.url, engines=[e1.url, e2.url],
                           agentic_session_lifecycle=True, session_inference=True, session_placement="kvgate",
                           session_idle_close_s=0, state_backend="redis", redis_url=redis_server.url)
    (a, url_a), (b, url_b) = reps
    prompt = list(range(300, 400))
    async with aiohttp.ClientSession() as http:
        for k in range(5):
            if k == 3:
                a.shared._beat.cancel()
                import redis.asyncio as redis
                c = redis.from_url(redis_server.url)
                await c.delete(f"kvgate:replica:{a.shared.replica}")
                await c.aclose()
            out = await _generate(http, url_a if k < 3 else url_b,
                                  {"input_ids": prompt, "sampling_params": {"max_new_tokens": 8}})
            prompt = prompt + out["output_ids"] + [9, 9]
            await _drain(reps)
    seen = {**e1.stats()["sessions"], **e2.stats()["sessions"]}
    assert list(seen.values()) == [5], seen  # one session id, all five turns, on one engine
    assert b.metrics.session_inference.labels("shared")._value.get() == 1
    assert b.placement.counts["adopted"] == 1


async def test_a_client_close_on_one_replica_is_not_sent_again_by_another(redis_server, sim_factory, kvgate_factory):
    """The client closes its session through replica A; replica B, which served its other turns, later finds
    it idle and marks it closed without sending a second close."""
    e1 = await sim_factory(max_total_num_tokens=50_000, speed=1000)
    clock = Clock()
    reps = await _replicas(kvgate_factory, clock, upstream=e1.url, engines=[e1.url],
                           agentic_session_lifecycle=True, session_inference=False, session_placement="router",
                           session_idle_close_s=2.0, state_backend="redis", redis_url=redis_server.url)
    (a, url_a), (b, url_b) = reps
    async with aiohttp.ClientSession() as http:
        for url in (url_b, url_a):
            await _generate(http, url, {"input_ids": list(range(1, 40)), "session_id": "c",
                                        "sampling_params": {"max_new_tokens": 2}})
        async with http.post(url_a + "/close_session", json={"session_id": "c"}) as r:
            assert r.status == 200
    await a.lifecycle.wait_until(lambda: a.lifecycle.registry.get("c").state == "closed", 10)
    await _drain(reps)
    clock.t += 3
    assert await b.lifecycle.sweep_idle() == 0
    assert b.lifecycle.registry.get("c").state == "closed"
    assert e1.engine.closes_received == 1
    assert b.metrics.session_close_skipped.labels("elsewhere")._value.get() == 1



async def test_admission_waiters_of_all_replicas_go_in_arrival_order(redis_server, sim_factory, kvgate_factory):
    """One FIFO across replicas: a third party holds 1,500 of the shared 1,800 tokens. B's request (500)
    waits for room; A's request (250) comes after it. The third party frees room for A's but not for B's:
    A's still waits (B's is older), asking again and again. Once room for B's frees, both go."""
    e = await sim_factory(max_total_num_tokens=2000, speed=1000)
    reps = []
    for _ in range(2):
        gw, url = await kvgate_factory(upstream=e.url, engines=[e.url], agentic_program_admission=True,
                                       admission_poll_interval_s=0.1, agentic_admission_max_wait_s=120.0,
                                       state_backend="redis", redis_url=redis_server.url)
        while gw.gate.ledger.snapshot is None or gw.gate.ledger.ceiling == 0:
            await gw.poller.round_done.wait()
        reps.append((gw, url))
    (a, url_a), (b, url_b) = reps
    assert a.gate.ledger.ceiling == 1800
    from kvgate.common.metrics import Metrics
    from kvgate.shared.redis_state import SharedState
    other = SharedState(redis_server.url, "kvgate:", 3600, 1.0, Metrics(), replica_id="other")
    other.register_scripts()
    fleet = other.lease_keys(None)
    assert await other.lease_grant(fleet, other.lease_member(1, 1500), 1500, [1800], 600) is True
    asks = {"a": 0, "b": 0}
    changed = asyncio.Event()
    granted: list[tuple[str, int]] = []
    for name, gw in (("a", a), ("b", b)):
        def wrap(real, name=name):
            async def queue_grant(*args, **kw):
                r = await real(*args, **kw)
                if r is not None and not r[0] and r[1] > 0:
                    asks[name] += 1
                if r is not None and r[0]:
                    granted.append((name, r[1]))
                changed.set()
                return r
            return queue_grant
        gw.shared.queue_grant = wrap(gw.shared.queue_grant)

    async def until(pred):
        async def loop():
            while not pred():
                changed.clear()
                await changed.wait()
        await asyncio.wait_for(loop(), 20)

    async def send(http, url, n_prompt, n_out):
        async with http.post(url + "/generate", data=orjson.dumps(
                {"input_ids": list(range(1, n_prompt + 1)),
                 "sampling_params": {"max_new_tokens": n_out, "ignore_eos": True}})) as r:
            await r.read()
            return r.status

    async with aiohttp.ClientSession() as http:
        tb = asyncio.create_task(send(http, url_b, 100, 400))
        await until(lambda: asks["b"] > 0)
        ta = asyncio.create_task(send(http, url_a, 50, 200))
        await until(lambda: asks["a"] > 0)
        waiting = await other.queue_waiting()
        assert [m.split(":")[0] for m, _ in waiting] == [b.shared.replica, a.shared.replica]
        assert [s for _, s in waiting] == [1, 2]
        # room for A's 250 but not for B's 500: A's fits, yet waits behind B's
        ok, _ = await other.queue_grant(fleet, other.lease_member(2, 1400), 1400, [1800], 600, force=True)
        assert ok
        other.lease_release(fleet, other.lease_member(1, 1500))
        await other.drain()
        seen = asks["a"]
        await until(lambda: asks["a"] >= seen + 3)  # A asked again (woken by the release, then backoff)
        assert granted == [] and await other.reserved(fleet[0]) == 1400
        other.lease_release(fleet, other.lease_member(2, 1400))
        await other.drain()
        assert await asyncio.gather(tb, ta) == [200, 200]
    assert sorted(granted) == [("a", 2), ("b", 1)]
    assert a.gate.shared_counts["waited"] == 1 and b.gate.shared_counts["waited"] == 1
    for gw, _ in reps:
        await gw.shared.drain()
    assert await other.reserved(fleet[0]) == 0 and await other.queue_waiting() == []
    await other.stop()


async def test_capacity_is_polled_once_for_all_replicas(redis_server, sim_factory, kvgate_factory):
    """Two replicas with admission on: one polls the engine under the lease and publishes its snapshot, the
    other reads it, so the engine answers one poller's reads (each of its capacity reads is one round that
    led or polled alone; rounds that read the shared snapshot cost it nothing). When the polling replica
    stops, the other takes over the lease."""
    e = await sim_factory(max_total_num_tokens=2000, speed=1000)
    reps = []
    for _ in range(2):
        gw, url = await kvgate_factory(upstream=e.url, engines=[e.url], agentic_program_admission=True,
                                       admission_poll_interval_s=0.2, state_backend="redis",
                                       redis_url=redis_server.url)
        reps.append(gw)

    async def until(pred, timeout=30):
        async def loop():
            while not pred():
                await asyncio.wait([asyncio.ensure_future(g.poller.round_done.wait()) for g in reps],
                                   return_when=asyncio.FIRST_COMPLETED)
        await asyncio.wait_for(loop(), timeout)

    await until(lambda: sum(g.poller.shared_rounds["read"] for g in reps) >= 5)
    for g in reps:
        await g.poller.stop()
    rounds = [dict(g.poller.shared_rounds) for g in reps]
    assert e.engine.capacity_reads == sum(r["led"] + r["own"] for r in rounds), rounds
    assert e.engine.capacity_reads <= sum(sum(r.values()) for r in rounds) - 5
    leader = max(reps, key=lambda g: g.poller.shared_rounds["led"])
    follower = reps[1] if leader is reps[0] else reps[0]
    assert follower.poller.shared_rounds["read"] >= 1 and leader.poller.shared_rounds["led"] >= 1
    assert not follower.gate.ledger.is_degraded(follower.gate.clock())
    assert follower.gate.ledger.ceiling == leader.gate.ledger.ceiling == 1800
    assert set(follower.poller.last_sources.values()) == {"shared"}
    # The polling replica stops: its lease expires and the other one polls for all.
    led = follower.poller.shared_rounds["led"]
    await follower.poller.start()
    reps = [follower]
    await until(lambda: follower.poller.shared_rounds["led"] > led)
    assert not follower.gate.ledger.is_degraded(follower.gate.clock())


async def test_capacity_is_polled_by_each_replica_while_redis_is_down(redis_server, sim_factory, kvgate_factory):
    """Redis unreachable: no shared snapshot, each replica polls the engines itself (fail-open), and
    admission keeps its capacity signal."""
    e = await sim_factory(max_total_num_tokens=2000, speed=1000)
    reps = []
    for _ in range(2):
        gw, _url = await kvgate_factory(upstream=e.url, engines=[e.url], agentic_program_admission=True,
                                        admission_poll_interval_s=0.2, state_backend="redis",
                                        redis_url=redis_server.url)
        reps.append(gw)
    redis_server.stop()
    before = [g.poller.shared_rounds["own"] for g in reps]
    for g in reps:
        async def two_rounds(g=g):
            while g.poller.shared_rounds["own"] < before[reps.index(g)] + 2:
                await g.poller.round_done.wait()
        await asyncio.wait_for(two_rounds(), 30)
        assert not g.gate.ledger.is_degraded(g.gate.clock())
        assert set(g.poller.last_sources.values()) == {"/v1/loads"}
        assert g.metrics.state_backend_up._value.get() == 0


@pytest.mark.parametrize("comes_back", [True, False])
async def test_a_close_still_queued_is_dropped_when_the_session_comes_back_elsewhere(comes_back, redis_server,
                                                                                      sim_factory, kvgate_factory):
    """Replica A closes a session (the client's close); one engine answers, the other is down, so A's call to
    it waits for a retry. The session comes back through replica B (its turn re-opens it on the engine):
    A's retry is dropped, not sent (a late close would drop the continued session's references). Without
    the come-back, the retry goes."""
    e1 = await sim_factory(max_total_num_tokens=50_000, speed=1000)
    dead = f"http://127.0.0.1:{procs.free_port()}"
    clock = Clock()
    reps = await _replicas(kvgate_factory, clock, upstream=e1.url, engines=[e1.url, dead],
                           agentic_session_lifecycle=True, session_inference=False, session_placement="router",
                           session_idle_close_s=0, close_retry_backoff_s=5.0, state_backend="redis",
                           redis_url=redis_server.url)
    (a, url_a), (b, url_b) = reps
    body = {"input_ids": list(range(1, 40)), "session_id": "s", "sampling_params": {"max_new_tokens": 2}}
    async with aiohttp.ClientSession() as http:
        await _generate(http, url_b, body)
        await _drain(reps)
        async with http.post(url_a + "/close_session", json={"session_id": "s"}) as r:
            assert r.status == 200

        def pending() -> bool:
            s = a.lifecycle.registry.get("s")
            return s is not None and s.engine_closes.get(dead) is not None and \
                s.engine_closes[dead].state == "pending" and s.engine_closes[e1.url].state == "ok"
        await a.lifecycle.wait_until(pending, 10)
        await _drain(reps)
        errors = a.metrics.close_calls.labels("error")._value.get()
        assert errors == 1 and e1.engine.closes_received == 1
        if comes_back:
            await _generate(http, url_b, body)
            await _drain(reps)
        clock.t += 6  # the retry is due
        a.lifecycle._retry_wake.set()
        if comes_back:
            await a.lifecycle.wait_until(lambda: a.lifecycle.registry.get("s").state == "closed", 10)
            assert a.metrics.session_close_cancelled._value.get() == 1
            assert a.metrics.close_calls.labels("error")._value.get() == errors  # not sent again
            assert a.lifecycle.registry.get("s").close_results[dead].startswith("cancelled")
            assert b.lifecycle.registry.get("s").state == "active"
        else:
            await a.lifecycle.wait_until(lambda: a.metrics.close_calls.labels("error")._value.get() > errors, 10)
            assert a.metrics.session_close_cancelled._value.get() == 0


async def test_a_client_gone_while_waiting_in_the_shared_queue_leaves_it(redis_server, sim_factory, kvgate_factory):
    """A third party holds the shared room; a request through B waits in the shared queue; its client
    disconnects: B takes it out of the queue, so it holds back no later waiter."""
    e = await sim_factory(max_total_num_tokens=2000, speed=1000)
    b, url_b = await kvgate_factory(upstream=e.url, engines=[e.url], agentic_program_admission=True,
                                    admission_poll_interval_s=0.1, agentic_admission_max_wait_s=120.0,
                                    state_backend="redis", redis_url=redis_server.url)
    while b.gate.ledger.snapshot is None or b.gate.ledger.ceiling == 0:
        await b.poller.round_done.wait()
    from kvgate.common.metrics import Metrics
    from kvgate.shared.redis_state import SharedState
    other = SharedState(redis_server.url, "kvgate:", 3600, 1.0, Metrics(), replica_id="other")
    other.register_scripts()
    fleet = other.lease_keys(None)
    assert await other.lease_grant(fleet, other.lease_member(1, 1500), 1500, [1800], 600) is True
    queued, left = asyncio.Event(), asyncio.Event()
    real_grant, real_leave = b.shared.queue_grant, b.shared.queue_leave

    async def queue_grant(*args, **kw):
        r = await real_grant(*args, **kw)
        if r is not None and not r[0]:
            queued.set()
        return r

    def queue_leave(member):
        real_leave(member)
        left.set()
    b.shared.queue_grant, b.shared.queue_leave = queue_grant, queue_leave
    async with aiohttp.ClientSession() as http:
        t = asyncio.create_task(http.post(url_b + "/generate", data=orjson.dumps(
            {"input_ids": list(range(1, 101)), "sampling_params": {"max_new_tokens": 400}})))
        await asyncio.wait_for(queued.wait(), 20)
        assert len(await other.queue_waiting()) == 1
        t.cancel()
        await asyncio.wait_for(left.wait(), 20)
    await b.shared.drain()
    assert await other.queue_waiting() == []
    assert await other.reserved(fleet[0]) == 1500  # only the third party's lease
    await other.stop()


async def test_a_shared_waiter_that_ages_goes_still_reserving(redis_server, sim_factory, kvgate_factory):
    """No room frees within max_wait: the request goes (aged) and, like the ledger's aged bypass, its lease
    is held in Redis while it runs (the other replicas count it), then released."""
    e = await sim_factory(max_total_num_tokens=2000, speed=1000)
    b, url_b = await kvgate_factory(upstream=e.url, engines=[e.url], agentic_program_admission=True,
                                    admission_poll_interval_s=0.1, agentic_admission_max_wait_s=0.3,
                                    state_backend="redis", redis_url=redis_server.url)
    while b.gate.ledger.snapshot is None or b.gate.ledger.ceiling == 0:
        await b.poller.round_done.wait()
    from kvgate.common.metrics import Metrics
    from kvgate.shared.redis_state import SharedState
    other = SharedState(redis_server.url, "kvgate:", 3600, 1.0, Metrics(), replica_id="other")
    other.register_scripts()
    fleet = other.lease_keys(None)
    assert await other.lease_grant(fleet, other.lease_member(1, 1500), 1500, [1800], 600) is True
    held = []
    real = b.shared.queue_grant

    async def queue_grant(*args, **kw):
        r = await real(*args, **kw)
        if r is not None and r[0]:
            held.append(await other.reserved(fleet[0]))
        return r
    b.shared.queue_grant = queue_grant
    async with aiohttp.ClientSession() as http:
        async with http.post(url_b + "/generate", data=orjson.dumps(
                {"input_ids": list(range(1, 101)), "sampling_params": {"max_new_tokens": 400}})) as r:
            assert r.status == 200
            await r.read()
    assert b.gate.shared_counts["aged"] == 1 and b.gate.shared_counts["granted"] == 0
    assert held == [1500 + 500]  # forced in over the ceiling of 1,800
    await b.shared.drain()
    assert await other.reserved(fleet[0]) == 1500 and await other.queue_waiting() == []
    await other.stop()


async def test_a_live_programs_next_turn_is_not_held_in_the_shared_queue(redis_server, sim_factory, kvgate_factory):
    """Program policy: a live program's next turn is never held (its KV is resident). Across replicas it is
    held on the shared ceilings at once, even when a third party holds all the room and waits before it."""
    e = await sim_factory(max_total_num_tokens=2000, speed=1000)
    b, url_b = await kvgate_factory(upstream=e.url, engines=[e.url], agentic_program_admission=True,
                                    admission_policy="program", admission_pause_start_ratio=0, agentic_session_lifecycle=True,
                                    session_inference=False, admission_poll_interval_s=0.1,
                                    agentic_admission_max_wait_s=120.0, state_backend="redis",
                                    redis_url=redis_server.url)
    b.engine_of = lambda sid: (e.url, None)
    while b.gate.ledger.snapshot is None or b.gate.ledger.ceiling == 0:
        await b.poller.round_done.wait()
    from kvgate.common.metrics import Metrics
    from kvgate.shared.redis_state import SharedState
    other = SharedState(redis_server.url, "kvgate:", 3600, 1.0, Metrics(), replica_id="other")
    other.register_scripts()
    fleet = other.lease_keys(None)
    ids = list(range(1, 201))
    async with aiohttp.ClientSession() as http:
        out = await _generate(http, url_b, {"session_id": "p", "input_ids": ids,
                                            "sampling_params": {"max_new_tokens": 20, "ignore_eos": True}})
        assert b.gate.shared_counts["granted"] == 1
        # a third party takes all the room and has a waiter queued: a new request would wait behind it
        assert (await other.queue_grant(fleet, other.lease_member(1, 1800), 1800, [1800], 600, force=True))[0]
        ok, _ = await other.queue_grant(fleet, other.lease_member(2, 100), 100, [1800], 600)
        assert not ok
        await _generate(http, url_b, {"session_id": "p", "input_ids": ids + out["output_ids"] + [7] * 20,
                                      "sampling_params": {"max_new_tokens": 20, "ignore_eos": True}})
    assert b.gate.shared_counts["bypass"] == 1 and b.gate.shared_counts["granted"] == 1
    await b.shared.drain()
    assert await other.reserved(fleet[0]) == 1800
    await other.stop()


async def test_a_program_paused_by_one_replica_resumes_through_another(redis_server, sim_factory, kvgate_factory):
    """Program policy on two replicas: replica A pauses program B (in a tool call when A's program A
    overflows the engine). B's next turn comes through replica B, which never saw it: it resumes there as
    a paused program (counted a resume, its whole context reserved), and the pause mark is gone."""
    from kvgate.admission.program import ProgramState
    e = await sim_factory(max_total_num_tokens=2000, speed=1000)  # ceiling 2,000 x 0.9 = 1,800
    reps = []
    for _ in range(2):
        gw, url = await kvgate_factory(upstream=e.url, engines=[e.url], agentic_program_admission=True,
                                       admission_policy="program", admission_pause_start_ratio=0, agentic_session_lifecycle=True,
                                       session_inference=False, admission_poll_interval_s=0.1,
                                       agentic_admission_max_wait_s=60.0, state_backend="redis",
                                       redis_url=redis_server.url)
        gw.engine_of = lambda sid: (e.url, None)
        while gw.gate.ledger.snapshot is None or gw.gate.ledger.ceiling == 0:
            await gw.poller.round_done.wait()
        reps.append((gw, url))
    (a, url_a), (b, url_b) = reps

    async def turn(http, url, sid, ids):
        body = {"session_id": sid, "input_ids": ids, "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}}
        async with http.post(url + "/generate", data=orjson.dumps(body)) as r:
            assert r.status == 200
            return r.headers.get("X-Kvgate-Admission"), orjson.loads(await r.read())

    a_ids, b_ids = list(range(10_000, 10_600)), list(range(20_000, 20_600))
    async with aiohttp.ClientSession() as http:
        _, a1 = await turn(http, url_a, "A", a_ids)
        _, b1 = await turn(http, url_a, "B", b_ids)
        # A continues on replica A: 800 resident (B) + 1,300 > 1,800: B, in its tool call, is paused
        a_ids = a_ids + a1["output_ids"] + list(range(11_000, 11_300))
        await turn(http, url_a, "A", a_ids)
        assert a.gate.coord.state_of("B") is ProgramState.PAUSED
        await a.shared.drain()
        assert await redis_server.keys("kvgate:prog:*") == {"kvgate:prog:B": pytest.approx(600, abs=5)}
        # B's next turn through replica B
        b_ids = b_ids + b1["output_ids"] + list(range(21_000, 21_300))
        dec, _ = await turn(http, url_b, "B", b_ids)
    assert dec == "admit"
    co = b.gate.coord
    assert co.resumes == {e.url: 1} and co.counters["resume"] == 1
    assert co.state_of("B") is ProgramState.IN_TOOL
    await b.shared.drain()
    assert await redis_server.keys("kvgate:prog:*") == {}


async def test_after_an_outage_the_heartbeat_found_the_first_batch_goes_on_a_new_connection(redis_server):
    """Redis goes away while no batch is in flight (the heartbeat finds it gone, the batch's own connection is not
    used meanwhile) and comes back: the batch after it goes on a new connection and its writes reach Redis. (The
    connection to the old server was kept: the first batch after the outage failed on it, marked Redis down again
    and lost its writes until the next heartbeat; beside a busy CPU the replicas' test above lost that race.)"""
    from kvgate.common.metrics import Metrics
    from kvgate.shared.redis_state import SharedState
    m = Metrics()
    st = SharedState(redis_server.url, "o:", 3600, 0.5, m, wall=Clock(), replica_id="r")
    await st.start()
    try:
        st.turn_started("a")
        await st.drain()
        assert "o:sess:a" in await redis_server.keys("o:sess:*")
        redis_server.stop()
        await _until(lambda: not st.up)  # the heartbeat (no batch was sent) found it gone
        await redis_server.start()
        await _until(lambda: st.up)  # ... and back
        st.turn_started("b")
        await st.drain()
        assert st.up and "o:sess:b" in await redis_server.keys("o:sess:*")
    finally:
        await st.stop()


async def _until(pred, timeout_s: float = 10.0) -> None:
    """Wait for ``pred`` to hold: the heartbeat's own period (1 s) sets the pace, the loop only checks."""
    async with asyncio.timeout(timeout_s):
        while not pred():
            await asyncio.sleep(0.02)
