"""The admission leases replicas share on Redis (Lua grant against shared ceilings), as a property.

Random arrivals (grants, several at once from different replicas), releases, one replica killed mid-run
(its leases are never released) and time passing: after every step, the live reservations on each place
(the fleet, each engine) fit its ceiling, or are one lease alone (a request larger than the ceiling runs
alone, as in the ledger). Afterwards, once the lease TTL has passed, nothing is reserved. The clock is
injected (the replicas' wall clock), so TTLs are decided without waiting. One redis-server of its own.
"""

from __future__ import annotations

import asyncio
import os

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from conftest import ManualClock
from kvgate.common.metrics import Metrics
from kvgate.shared.redis_state import SharedState
from kvgate.tools import procs

REDIS = procs.find_executable("redis-server") or ("/usr/bin/redis-server" if os.path.exists("/usr/bin/redis-server")
                                                   else None)
pytestmark = pytest.mark.skipif(REDIS is None, reason="redis-server not installed (Debian package redis-server)")

ENGINES = ["http://e0", "http://e1"]
FLEET_CEILING, ENGINE_CEILING, TTL = 1000, 600, 30.0


grant = st.tuples(st.just("grant"), st.integers(0, 2), st.integers(1, 700), st.sampled_from([None, 0, 1]))
release = st.tuples(st.just("release"), st.integers(0, 2), st.integers(0, 50))
tick = st.tuples(st.just("tick"), st.floats(0.0, 10.0))
kill = st.tuples(st.just("kill"), st.integers(0, 2))
steps = st.lists(st.lists(grant, min_size=1, max_size=4) | st.tuples(release) | st.tuples(tick) | st.tuples(kill),
                 min_size=1, max_size=40)


async def _live(client, key: str, now: float) -> list[int]:
    return [int(m.rsplit("|", 1)[1]) for m in await client.zrangebyscore(key, f"({now!r}", "+inf")]


async def _scenario(url: str, plan) -> None:
    import redis.asyncio as redis
    raw = redis.Redis.from_url(url, decode_responses=True)
    await raw.flushdb()
    clock = ManualClock()
    reps = [SharedState(url, "t:", 3600, 1.0, Metrics(), wall=clock, replica_id=f"r{i}") for i in range(3)]
    for r in reps:
        r.register_scripts()
    held: list[list[tuple[list[str], str, float]]] = [[], [], []]  # (keys, member, expiry) per replica
    dead: set[int] = set()
    ids = iter(range(10**9))
    keys = reps[0].lease_keys(None) + [reps[0].lease_keys(e)[1] for e in ENGINES]
    try:
        for step in plan:
            if isinstance(step, list):  # arrivals at once, on their replicas
                async def one(r, tokens, engine):
                    place = None if engine is None else ENGINES[engine]
                    ks = reps[r].lease_keys(place)
                    member = reps[r].lease_member(next(ids), tokens)
                    ceilings = [FLEET_CEILING] + ([ENGINE_CEILING] if place else [])
                    if await reps[r].lease_grant(ks, member, tokens, ceilings, TTL):
                        held[r].append((ks, member, clock.t + TTL))
                await asyncio.gather(*(one(r, tok, eng) for _, r, tok, eng in step if r not in dead))
            elif step[0][0] == "release":
                _, r, k = step[0]
                if r not in dead and held[r]:
                    ks, member, _ = held[r].pop(k % len(held[r]))
                    reps[r].lease_release(ks, member)
                    await reps[r].drain()
            elif step[0][0] == "tick":
                clock.t += step[0][1]
            else:
                dead.add(step[0][1])
            for key in keys:
                live = await _live(raw, key, clock.t)
                ceiling = FLEET_CEILING if key.endswith("fleet") else ENGINE_CEILING
                assert sum(live) <= ceiling or len(live) == 1, (key, live)
        # Every live replica's requests end; the dead one's leases stay until their TTL.
        for r in range(3):
            if r not in dead:
                for ks, member, _ in held[r]:
                    reps[r].lease_release(ks, member)
                await reps[r].drain()
        # Only the dead replica's leases whose TTL has not passed yet are still reserved.
        stranded = sum(int(m.rsplit("|", 1)[1]) for r in dead for _, m, exp in held[r] if exp > clock.t)
        assert await reps[0].reserved(keys[0]) == stranded
        clock.t += TTL + 1
        for key in keys:
            assert await reps[0].reserved(key) == 0
    finally:
        for r in reps:
            await r.client.aclose()
        await raw.aclose()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(plan=steps)
def test_shared_leases_never_exceed_the_ceiling_and_expire(redis_url, plan):
    asyncio.run(_scenario(redis_url, plan))


def test_a_lease_over_the_ceiling_waits_for_room(redis_url):
    """The rule itself, on fixed numbers: a second replica is refused what the first holds, and granted once
    it is released."""
    async def run():
        clock = ManualClock()
        a, b = (SharedState(redis_url, "u:", 3600, 1.0, Metrics(), wall=clock, replica_id=n) for n in "ab")
        for r in (a, b):
            await r.start()
        try:
            await r.client.flushdb()
            ks = a.lease_keys("http://e0")
            assert await a.lease_grant(ks, a.lease_member(1, 500), 500, [1000, 600], TTL) is True
            assert await b.lease_grant(ks, b.lease_member(1, 200), 200, [1000, 600], TTL) is False
            assert await b.lease_grant(b.lease_keys("http://e1"), b.lease_member(2, 200), 200, [1000, 600], TTL)
            assert await a.reserved(ks[0]) == 700 and await a.reserved(ks[1]) == 500
            a.lease_release(ks, a.lease_member(1, 500))
            await a.drain()
            assert await b.lease_grant(ks, b.lease_member(1, 200), 200, [1000, 600], TTL) is True
            assert await a.reserved(ks[1]) == 200
        finally:
            for r in (a, b):
                await r.stop()
    asyncio.run(run())
