"""The admission wait queue replicas share on Redis (one global FIFO, Lua grant), as a property.

Random arrivals on 3 replicas (several at once), waiters asking again in a random order, waiters leaving
(client gone), releases, a replica killed mid-run (its waiters stop asking, its leases are never released)
and time passing. A model of the queue says, for every ask, what the grant script must answer: granted
exactly when no live waiter (one that asked within WAITER_TTL_S) arrived before it and it fits every
ceiling. After every step the live reservations on each place fit its ceiling (or are one lease alone).
Afterwards, once the TTLs have passed, nothing is reserved and nobody waits. The clock is injected (the
replicas' wall clock), so TTLs are decided without waiting. One redis-server of its own.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from conftest import ManualClock
from kvgate.common.metrics import Metrics
from kvgate.shared.redis_state import WAITER_TTL_S, SharedState
from kvgate.tools import procs

REDIS = procs.find_executable("redis-server") or ("/usr/bin/redis-server" if os.path.exists("/usr/bin/redis-server")
                                                   else None)
pytestmark = pytest.mark.skipif(REDIS is None, reason="redis-server not installed (Debian package redis-server)")

ENGINES = ["http://e0", "http://e1"]
FLEET_CEILING, ENGINE_CEILING, TTL = 1000, 600, 30.0


@dataclass
class Waiter:
    replica: int
    keys: list
    member: str
    tokens: int
    ceilings: list
    seq: int = 0
    expiry: float = 0.0   # the model's: last ask + WAITER_TTL_S
    state: str = "waiting"  # waiting | granted | left


arrive = st.tuples(st.just("arrive"), st.integers(0, 2), st.integers(1, 700), st.sampled_from([None, 0, 1]))
steps = st.lists(
    st.lists(arrive, min_size=1, max_size=3)
    | st.tuples(st.just("ask"), st.lists(st.integers(0, 60), min_size=1, max_size=6))
    | st.tuples(st.just("leave"), st.integers(0, 60))
    | st.tuples(st.just("release"), st.integers(0, 60))
    | st.tuples(st.just("tick"), st.floats(0.0, 5.0))
    | st.tuples(st.just("kill"), st.integers(0, 2)),
    min_size=1, max_size=40)


def _fits(held: list[Waiter], lease_exp: dict, w: Waiter, now: float) -> bool:
    """The model's ceiling rule: each of the waiter's places holds it, or holds nothing yet."""
    for key, ceiling in zip(w.keys, w.ceilings):
        live = sum(h.tokens for h in held if key in h.keys and lease_exp[h.member] > now)
        if live > 0 and live + w.tokens > ceiling:
            return False
    return True


async def _scenario(url: str, plan) -> None:
    import redis.asyncio as redis
    raw = redis.Redis.from_url(url, decode_responses=True)
    await raw.flushdb()
    clock = ManualClock()
    reps = [SharedState(url, "q:", 3600, 1.0, Metrics(), wall=clock, replica_id=f"r{i}") for i in range(3)]
    for r in reps:
        r.register_scripts()
    waiters: list[Waiter] = []
    held: list[Waiter] = []          # granted, not released (a dead replica's stay until their TTL)
    lease_exp: dict[str, float] = {}
    dead: set[int] = set()
    ids = iter(range(10**9))
    keys = reps[0].lease_keys(None) + [reps[0].lease_keys(e)[1] for e in ENGINES]

    def earlier_live(w: Waiter, now: float) -> list[Waiter]:
        return [o for o in waiters if o is not w and o.state == "waiting" and o.seq and o.expiry > now
                and (w.seq == 0 or o.seq < w.seq)]

    async def ask(w: Waiter) -> tuple[bool, int]:
        r = await reps[w.replica].queue_grant(w.keys, w.member, w.tokens, w.ceilings, TTL, w.seq)
        assert r is not None
        return r

    def granted(w: Waiter) -> None:
        w.state = "granted"
        held.append(w)
        lease_exp[w.member] = clock.t + TTL

    try:
        for step in plan:
            now = clock.t
            if isinstance(step, list):  # arrivals at once, on their replicas
                batch = []
                for _, r, tokens, engine in step:
                    if r in dead:
                        continue
                    place = None if engine is None else ENGINES[engine]
                    batch.append(Waiter(r, reps[r].lease_keys(place), reps[r].lease_member(next(ids), tokens),
                                        tokens, [FLEET_CEILING] + ([ENGINE_CEILING] if place else [])))
                ahead = [o for o in waiters if o.state == "waiting" and o.seq and o.expiry > now]
                answers = await asyncio.gather(*(ask(w) for w in batch))
                for w, (ok, seq) in zip(batch, answers):
                    waiters.append(w)
                    w.expiry = now + WAITER_TTL_S
                    if ok:
                        # nobody was waiting before it (arrivals of the same batch are not "before")
                        assert not ahead and seq == 0, (w, ahead)
                        granted(w)
                    else:
                        assert seq > 0
                        w.seq = seq
                if len(batch) == 1 and not ahead:  # one arrival alone: granted exactly when it fits
                    assert (batch[0].state == "granted") == _fits(held[:-1] if batch[0].state == "granted"
                                                                  else held, lease_exp, batch[0], now)
            elif step[0] == "ask":  # waiters ask again, one after the other, in a random order
                live = [w for w in waiters if w.state == "waiting" and w.replica not in dead]
                for k in step[1]:
                    if not live:
                        break
                    w = live[k % len(live)]
                    if w.state != "waiting":
                        continue
                    before = earlier_live(w, now)
                    fits = _fits(held, lease_exp, w, now)
                    ok, seq = await ask(w)
                    w.expiry = now + WAITER_TTL_S
                    # one global FIFO: granted exactly when no live waiter arrived before it and it fits
                    assert ok == (not before and fits), (w, before, fits)
                    assert seq == w.seq
                    if ok:
                        granted(w)
            elif step[0] == "leave":  # a client gone while waiting
                live = [w for w in waiters if w.state == "waiting" and w.replica not in dead]
                if live:
                    w = live[step[1] % len(live)]
                    reps[w.replica].queue_leave(w.member)
                    await reps[w.replica].drain()
                    w.state = "left"
            elif step[0] == "release":
                mine = [h for h in held if h.replica not in dead]
                if mine:
                    h = mine[step[1] % len(mine)]
                    reps[h.replica].lease_release(h.keys, h.member)
                    await reps[h.replica].drain()
                    held.remove(h)
            elif step[0] == "tick":
                clock.t += step[1]
            else:
                dead.add(step[1])
            for key in keys:
                live = [int(m.rsplit("|", 1)[1]) for m in await raw.zrangebyscore(key, f"({clock.t!r}", "+inf")]
                ceiling = FLEET_CEILING if key.endswith("fleet") else ENGINE_CEILING
                assert sum(live) <= ceiling or len(live) == 1, (key, live)
        # Every live replica's waiters leave and its requests end; the dead one's leases stay until their TTL.
        for w in waiters:
            if w.replica not in dead and w.state == "waiting":
                reps[w.replica].queue_leave(w.member)
        for h in list(held):
            if h.replica not in dead:
                reps[h.replica].lease_release(h.keys, h.member)
                held.remove(h)
        for r in reps:
            await r.drain()
        stranded = sum(h.tokens for h in held if lease_exp[h.member] > clock.t)
        assert await reps[0].reserved(keys[0]) == stranded
        # The dead replica's waiters leave the queue once they stop asking (the next grant drops them).
        clock.t += TTL + 1
        probe = reps[0].lease_member("probe", 1)
        assert await reps[0].queue_grant(keys[:1], probe, 1, [FLEET_CEILING], TTL) == (True, 0)
        reps[0].lease_release(keys[:1], probe)
        await reps[0].drain()
        assert await reps[0].queue_waiting() == []
        for key in keys:
            assert await reps[0].reserved(key) == 0
    finally:
        for r in reps:
            await r.client.aclose()
        await raw.aclose()


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(plan=steps)
def test_one_global_fifo_across_replicas(redis_url, plan):
    asyncio.run(_scenario(redis_url, plan))


def test_the_oldest_waiter_goes_first_whichever_replica_asks(redis_url):
    """The rule on fixed numbers: B's waiter arrived before A's second one, so when room frees only B's
    goes, although A asks first; A's goes after it. A waiter whose replica stops asking leaves the queue
    after WAITER_TTL_S and holds nobody back."""
    async def run():
        clock = ManualClock()
        a, b, c = (SharedState(redis_url, "v:", 3600, 1.0, Metrics(), wall=clock, replica_id=n) for n in "abc")
        for r in (a, b, c):
            r.register_scripts()
        await a.client.flushdb()
        try:
            ks = a.lease_keys(None)
            assert await a.queue_grant(ks, a.lease_member(1, 800), 800, [1000], TTL) == (True, 0)
            ok, sb = await b.queue_grant(ks, b.lease_member(1, 500), 500, [1000], TTL)
            assert not ok and sb == 1
            ok, sa = await a.queue_grant(ks, a.lease_member(2, 100), 100, [1000], TTL)
            assert not ok and sa == 2   # 100 fits, but B's waiter is older
            a.lease_release(ks, a.lease_member(1, 800))
            await a.drain()
            assert await a.queue_grant(ks, a.lease_member(2, 100), 100, [1000], TTL, sa) == (False, 2)
            assert await b.queue_grant(ks, b.lease_member(1, 500), 500, [1000], TTL, sb) == (True, 1)
            assert await a.queue_grant(ks, a.lease_member(2, 100), 100, [1000], TTL, sa) == (True, 2)
            assert await a.reserved(ks[0]) == 600
            # C waits (600 + 500 > 1000), then stops asking (its replica died): D's later waiter is held
            # back until C's expiry passes, then granted as soon as it fits.
            ok, sc_ = await c.queue_grant(ks, c.lease_member(1, 500), 500, [1000], TTL)
            assert not ok
            b.lease_release(ks, b.lease_member(1, 500))
            await b.drain()
            assert await b.queue_grant(ks, b.lease_member(2, 50), 50, [1000], TTL) == (False, sc_ + 1)
            clock.t += WAITER_TTL_S + 0.01
            assert await b.queue_grant(ks, b.lease_member(2, 50), 50, [1000], TTL, sc_ + 1) == (True, sc_ + 1)
            assert [m for m, _ in await a.queue_waiting()] == []
        finally:
            for r in (a, b, c):
                await r.stop()
    asyncio.run(run())


def test_backfill_passes_earlier_waiters_only_with_room_for_them(redis_url):
    """With backfill, a later waiter for another engine passes a head held back by its engine's ceiling when
    the fleet still holds the head too; without backfill, or when it would take the head's fleet room, it
    waits its turn."""
    async def run():
        clock = ManualClock()
        a, b = (SharedState(redis_url, "w:", 3600, 1.0, Metrics(), wall=clock, replica_id=n) for n in "ab")
        for r in (a, b):
            r.register_scripts()
        await a.client.flushdb()
        try:
            e0, e1 = a.lease_keys(ENGINES[0]), b.lease_keys(ENGINES[1])
            assert await a.queue_grant(e0, a.lease_member(1, 500), 500, [1000, 600], TTL) == (True, 0)
            ok, head = await a.queue_grant(e0, a.lease_member(2, 200), 200, [1000, 600], TTL)
            assert not ok  # e0 holds 500 of 600
            m = b.lease_member(1, 100)
            assert await b.queue_grant(e1, m, 100, [1000, 600], TTL) == (False, head + 1)
            # 500 held + 100 + the head's 200 fit the fleet's 1000: it may pass
            assert await b.queue_grant(e1, m, 100, [1000, 600], TTL, head + 1, backfill=True) == (True, head + 1)
            # 600 held + 300 + the head's 200 do not
            m2 = b.lease_member(2, 300)
            assert (await b.queue_grant(e1, m2, 300, [1000, 600], TTL, backfill=True))[0] is False
            assert [x for x, _ in await a.queue_waiting()] == [a.lease_member(2, 200), m2]
        finally:
            for r in (a, b):
                await r.stop()
    asyncio.run(run())


def test_a_forced_grant_reserves_past_the_queue_and_the_ceiling(redis_url):
    """A bypass (protected, or aged out of the queue) still reserves: granted at once over the ceiling and
    ahead of the waiters, and it leaves the queue if it waited there; the later waiters count its tokens."""
    async def run():
        clock = ManualClock()
        a, b = (SharedState(redis_url, "f:", 3600, 1.0, Metrics(), wall=clock, replica_id=n) for n in "ab")
        for r in (a, b):
            r.register_scripts()
        await a.client.flushdb()
        try:
            ks = a.lease_keys(None)
            assert await a.queue_grant(ks, a.lease_member(1, 900), 900, [1000], TTL) == (True, 0)
            ok, s1 = await b.queue_grant(ks, b.lease_member(1, 300), 300, [1000], TTL)
            assert not ok
            ok, s2 = await a.queue_grant(ks, a.lease_member(2, 50), 50, [1000], TTL)
            assert not ok and s2 == s1 + 1
            # B's waiter ages: forced in, out of the queue
            assert await b.queue_grant(ks, b.lease_member(1, 300), 300, [1000], TTL, s1, force=True) == (True, s1)
            # a protected request on B: forced in without queueing
            assert await b.queue_grant(ks, b.lease_member(2, 100), 100, [1000], TTL, force=True) == (True, 0)
            assert await a.reserved(ks[0]) == 1300
            assert [m for m, _ in await a.queue_waiting()] == [a.lease_member(2, 50)]
            a.lease_release(ks, a.lease_member(1, 900))
            await a.drain()
            # 300 + 100 + 50 fit: A's waiter, now the oldest, goes
            assert await a.queue_grant(ks, a.lease_member(2, 50), 50, [1000], TTL, s2) == (True, s2)
        finally:
            for r in (a, b):
                await r.stop()
    asyncio.run(run())


def test_a_release_wakes_the_waiters_of_every_replica(redis_url):
    """A lease released (or a waiter gone) on one replica is published while waiters are left: the other
    replicas' waiters ask again at once instead of at their next backoff. With nobody waiting nothing is
    published (every replica would read it for nothing)."""
    async def run():
        a, b = (SharedState(redis_url, "p:", 3600, 1.0, Metrics(), replica_id=n) for n in "ab")
        for r in (a, b):
            await r.start()
        raw = b.client.pubsub()
        try:
            await raw.subscribe("p:room")
            assert (await raw.get_message(timeout=20))["type"] == "subscribe"  # subscribed before any publish
            await asyncio.wait_for(b.listening.wait(), 20)
            ks = a.lease_keys(None)
            assert await a.queue_grant(ks, a.lease_member(1, 10), 10, [1000], TTL) == (True, 0)
            a.lease_release(ks, a.lease_member(1, 10))  # nobody waits: no message
            await a.drain()
            assert await a.queue_grant(ks, a.lease_member(3, 900), 900, [1000], TTL) == (True, 0)
            assert await b.queue_grant(ks, b.lease_member(1, 500), 500, [1000], TTL) == (False, 1)  # B waits
            room = b.room_event()
            assert not room.is_set()
            a.lease_release(ks, a.lease_member(3, 900))
            await a.drain()
            await asyncio.wait_for(room.wait(), 20)
            room = b.room_event()
            assert await a.queue_grant(ks, a.lease_member(2, 10), 10, [1000], TTL) == (False, 2)  # A waits too
            a.queue_leave(a.lease_member(2, 10))   # B still waits
            await asyncio.wait_for(room.wait(), 20)
            msgs = []
            while (m := await raw.get_message(ignore_subscribe_messages=True, timeout=0.5)) is not None:
                msgs.append(m["data"])
            assert len(msgs) == 2, msgs  # the release with B waiting and the leave; not the first release
        finally:
            await raw.aclose()
            for r in (a, b):
                await r.stop()
    asyncio.run(run())


def test_a_release_redis_did_not_confirm_is_sent_when_redis_answers_again(redis_url):
    """A grant whose answer was lost (the call timed out after Redis ran it) may be held; its release, and any
    release issued while Redis was unreachable, is kept and sent once Redis answers again, so the lease is
    not held until its TTL (an hour by default)."""
    async def run():
        clock = ManualClock()
        a = SharedState(redis_url, "u:", 3600, 1.0, Metrics(), wall=clock, replica_id="a")
        a.register_scripts()
        await a.client.flushdb()
        try:
            ks = a.lease_keys(None)
            assert await a.queue_grant(ks, a.lease_member(1, 700), 700, [1000], TTL) == (True, 0)
            a._down("admission", TimeoutError("the answer never came"))   # as a timed-out call marks it
            a.lease_release(ks, a.lease_member(1, 700))                      # not sent: Redis is down
            await a.drain()
            a.up = True   # peek without the gate: the lease is still held
            assert await a.reserved(ks[0]) == 700
            a.up = False
            await a._heartbeat_once()   # Redis answers again: the kept release goes out
            await a.drain()
            assert a.up and await a.reserved(ks[0]) == 0
            assert a._unsent == {}
        finally:
            await a.stop()
    asyncio.run(run())
