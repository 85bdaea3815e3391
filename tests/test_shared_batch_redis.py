"""The write batch on a real redis-server: many requests' calls in few script calls, the shared queue's order
and ceilings kept within one batch, and what falls back when Redis fails a batch or one op in it.

One redis-server of its own; Redis is made slow or silent with CLIENT PAUSE WRITE (scripts wait) from a
second client, so a batch is held in flight, or times out, exactly when the test says.
"""

from __future__ import annotations

import asyncio
import os

import pytest

from conftest import ManualClock, until_state as _until
from kvgate.common.metrics import Metrics
from kvgate.shared.redis_state import SharedState
from kvgate.tools import procs

REDIS = procs.find_executable("redis-server") or ("/usr/bin/redis-server" if os.path.exists("/usr/bin/redis-server")
                                                   else None)
pytestmark = pytest.mark.skipif(REDIS is None, reason="redis-server not installed (Debian package redis-server)")


def _bypass(m: Metrics, op: str) -> float:
    return m.state_backend_bypass.labels(op)._value.get()


async def _state(url: str, prefix: str, timeout_s: float = 5.0, **kw):
    import redis.asyncio as redis
    raw = redis.Redis.from_url(url, decode_responses=True)
    await raw.flushdb()
    m = Metrics()
    st = SharedState(url, prefix, 3600, timeout_s, m, **kw)
    st.register_scripts()
    return st, m, raw


async def test_many_requests_writes_go_in_few_calls_and_add_up(redis_url):
    """200 requests on 20 sessions, all at once: a turn start, a grant, a release and a turn end each. They
    go out in a handful of script calls (one per event-loop turn, one in flight), and Redis ends where the
    writes one by one would leave it: no turn in flight, every session's last activity, nothing reserved."""
    clock = ManualClock()
    st, m, raw = await _state(redis_url, "b:", wall=clock, replica_id="r")
    try:
        ks = st.lease_keys("http://e0")

        async def request(i: int):
            sid = f"s{i % 20}"
            member = st.lease_member(i, 10)
            assert await st.queue_grant(ks, member, 10, [10_000, 10_000], 30.0) == (True, 0)
            st.turn_started(sid)
            await asyncio.sleep(0)
            st.lease_release(ks, member)
            st.turn_finished(sid)

        await asyncio.gather(*(request(i) for i in range(200)))
        await st.drain()
        calls, ops = m.state_backend_calls._value.get(), m.state_backend_ops._value.get()
        assert calls <= 10 and ops >= 200, (calls, ops)   # 800 writes were made
        for i in range(20):
            h = await raw.hgetall(f"b:sess:s{i}")
            assert h["state"] == "active" and float(h["last"]) == clock.t
            assert not [f for f in h if f.startswith("if:")], h
        assert await st.reserved(ks[0]) == 0 and await st.reserved(ks[1]) == 0
        assert sum(_bypass(m, op) for op in ("turn", "admission")) == 0
    finally:
        await st.stop()
        await raw.aclose()


async def test_grants_of_one_batch_keep_arrival_order_and_the_ceiling(redis_url):
    """Ten asks at once on one replica, 300 tokens each, ceiling 1000: one batch, asked in the order they
    were made: the first three are granted, the other seven wait with arrival numbers in that order; a
    release in the next batch lets exactly the oldest waiter in."""
    st, m, raw = await _state(redis_url, "g:", wall=ManualClock(), replica_id="r")
    try:
        ks = st.lease_keys(None)
        members = [st.lease_member(i, 300) for i in range(10)]
        answers = await asyncio.gather(*(st.queue_grant(ks, mb, 300, [1000], 30.0) for mb in members))
        assert m.state_backend_calls._value.get() == 1
        assert answers == [(True, 0)] * 3 + [(False, n) for n in range(1, 8)]
        assert await st.reserved(ks[0]) == 900
        st.lease_release(ks, members[0])
        a3, a4 = await asyncio.gather(st.queue_grant(ks, members[4], 300, [1000], 30.0, 2),
                                      st.queue_grant(ks, members[3], 300, [1000], 30.0, 1))
        assert (a3, a4) == ((False, 2), (True, 1))   # the release went first; then only the oldest fits
        assert await st.reserved(ks[0]) == 900
    finally:
        await st.stop()
        await raw.aclose()


async def test_a_grant_and_its_release_in_one_batch_free_the_room_for_the_next(redis_url):
    """Grant X (600 of 1000), release X, grant Y (600): one batch, and the script's running sum of the
    fleet's reservations follows the release, so Y is granted; then Z (600) is not."""
    st, m, raw = await _state(redis_url, "h:", wall=ManualClock(), replica_id="r")
    try:
        ks = st.lease_keys(None)
        x, y, z = (st.lease_member(i, 600) for i in range(3))

        async def release_then_ask():
            st.lease_release(ks, x)
            return await st.queue_grant(ks, y, 600, [1000], 30.0)

        assert await asyncio.gather(st.queue_grant(ks, x, 600, [1000], 30.0), release_then_ask()) == \
            [(True, 0), (True, 0)]
        assert m.state_backend_calls._value.get() == 1
        assert await st.queue_grant(ks, z, 600, [1000], 30.0) == (False, 1)
        assert await st.reserved(ks[0]) == 600
    finally:
        await st.stop()
        await raw.aclose()


async def test_a_turns_end_lingers_and_a_start_takes_it_along_at_once(redis_url):
    """Writes nobody waits for wait for company (here: for ever), but a turn's start goes at once, with them:
    the other replicas' idle sweeps must see the session busy while its turn runs."""
    st, m, raw = await _state(redis_url, "l:", wall=ManualClock(), replica_id="r")
    try:
        st._batch.linger_s = 3600.0
        st.turn_finished("a")
        for _ in range(50):
            await asyncio.sleep(0)
        assert len(st._batch) == 1 and not st._batch.in_flight and m.state_backend_calls._value.get() == 0
        st.turn_started("b")
        await asyncio.wait_for(st.drain(30.0), 20)
        assert m.state_backend_calls._value.get() == 1 and m.state_backend_ops._value.get() == 2
        assert await raw.hget("l:sess:b", "if:r") == "1" and await raw.hget("l:sess:a", "if:r") == "-1"
    finally:
        await st.stop()
        await raw.aclose()


async def test_one_failing_op_falls_back_alone_and_is_counted(redis_url):
    """A session key someone overwrote with a string: its turn write fails in the script (WRONGTYPE); the
    release in the same batch is applied all the same, the failed write is counted, and the replica takes
    Redis for unreachable as after any failed call (the heartbeat finds it back)."""
    st, m, raw = await _state(redis_url, "e:", wall=ManualClock(), replica_id="r")
    try:
        ks = st.lease_keys(None)
        assert await st.queue_grant(ks, st.lease_member(1, 50), 50, [1000], 30.0) == (True, 0)
        await raw.set("e:sess:bad", "not a hash")
        st.turn_started("bad")
        st.lease_release(ks, st.lease_member(1, 50))
        st.turn_started("good")
        await st.drain()
        assert m.state_backend_calls._value.get() == 2
        assert _bypass(m, "turn") == 1 and _bypass(m, "admission") == 0
        assert not st.up
        assert await raw.zcard("e:lease:fleet") == 0             # the release went in the same batch
        assert (await raw.hget("e:sess:good", "if:r")) == "1"    # and so did the op after the failed one
        assert st._unsent == {}
        await st._heartbeat_once()
        assert st.up
    finally:
        await st.stop()
        await raw.aclose()


async def test_a_batch_redis_does_not_answer_falls_back_whole(redis_url):
    """Redis stops answering while a batch is on the wire (CLIENT PAUSE WRITE, longer than the call timeout):
    the grant's asker gets None (fail-open: its request goes), the turn writes are counted as fallen back,
    the release is kept and sent once Redis answers again; what was queued behind the batch is not sent
    while Redis is down."""
    st, m, raw = await _state(redis_url, "t:", timeout_s=0.1, wall=ManualClock(), replica_id="r")
    try:
        ks = st.lease_keys(None)
        assert await st.queue_grant(ks, st.lease_member(1, 50), 50, [1000], 30.0) == (True, 0)
        await raw.execute_command("CLIENT", "PAUSE", 30000, "WRITE")
        st.turn_started("s")
        st.lease_release(ks, st.lease_member(1, 50))
        ask = asyncio.ensure_future(st.queue_grant(ks, st.lease_member(2, 50), 50, [1000], 30.0))
        await _until(lambda: st._batch.in_flight, "the batch goes out")
        st.turn_finished("s")    # queued behind the batch on the wire
        assert await ask is None
        await st.drain()
        await raw.execute_command("CLIENT", "UNPAUSE")
        assert not st.up
        assert _bypass(m, "turn") == 2 and _bypass(m, "admission") == 2
        assert list(st._unsent) == [st.lease_member(1, 50)]
        await st._heartbeat_once()     # Redis answers again: the kept release goes out
        await st.drain()
        assert st.up and st._unsent == {}
        assert await st.reserved(ks[0]) == 0
        assert await raw.hgetall("t:sess:s") == {}    # no turn write was sent while Redis was taken for down
    finally:
        await raw.execute_command("CLIENT", "UNPAUSE")
        await st.stop()
        await raw.aclose()


async def test_a_grant_whose_asker_left_while_it_was_on_the_wire_is_released(redis_url):
    """The client left while its grant's batch was on the wire: Redis grants it all the same, and the
    replica gives the lease back at once instead of leaving it held until its TTL."""
    st, m, raw = await _state(redis_url, "c:", wall=ManualClock(), replica_id="r")
    try:
        ks = st.lease_keys(None)
        await raw.execute_command("CLIENT", "PAUSE", 30000, "WRITE")
        ask = asyncio.ensure_future(st.queue_grant(ks, st.lease_member(1, 70), 70, [1000], 30.0))
        await _until(lambda: st._batch.in_flight, "the batch goes out")
        ask.cancel()
        with pytest.raises(asyncio.CancelledError):
            await ask
        await raw.execute_command("CLIENT", "UNPAUSE")
        await st.drain()
        assert m.state_backend_calls._value.get() == 2        # the grant, then its release
        assert await st.reserved(ks[0]) == 0 and st.up
    finally:
        await raw.execute_command("CLIENT", "UNPAUSE")
        await st.stop()
        await raw.aclose()


async def test_a_reply_shorter_than_its_batch_leaves_no_asker_waiting(redis_url):
    """Every asker gets an answer whatever the script replies: a reply that stops early (Redis ends a script's
    array at its first nil) or carries an answer of the wrong shape makes those ops fall back, counted, and the
    askers whose answers did come get them."""
    st, m, raw = await _state(redis_url, "h:", wall=ManualClock(), replica_id="r")
    real = st._scripts["batch"]
    cut = {"n": 1}

    async def short_reply(keys, args):
        out = await real(keys=keys, args=args)
        return out[:-cut["n"]]

    try:
        for i in range(3):
            st.turn_started(f"s{i}")
        await st.drain()
        st._scripts["batch"] = short_reply
        async with asyncio.timeout(30):  # a lost answer fails here instead of hanging
            claims = await asyncio.gather(*(st.idle_claim(f"s{i}", 3600.0) for i in range(3)))
        assert claims[:2] == [("busy", 0.0, "")] * 2 and claims[2] == ("unknown", 0.0, "")
        assert _bypass(m, "idle") == 1 and not st.up
        await st._heartbeat_once()
        assert st.up

        async def wrong_shape(keys, args):  # a grant answered with a bare number: not confirmed, no exception
            return [7 for _ in await real(keys=keys, args=args)]

        st._scripts["batch"] = wrong_shape
        ks = st.lease_keys(None)
        ask = asyncio.ensure_future(st.queue_grant(ks, st.lease_member(1, 50), 50, [1000], 30.0))
        await _until(lambda: st._batch.in_flight, "the batch goes out")
        ask.cancel()  # gone before the answer: the replica reads the answer to decide on a release
        with pytest.raises(asyncio.CancelledError):
            await ask
        async with asyncio.timeout(30):
            await st.drain()
        assert _bypass(m, "admission") == 1 and st._flusher is None
    finally:
        await st.stop()
        await raw.aclose()


async def test_stop_ends_the_room_listener_at_its_first_cancel(redis_url):
    """A replica's stop ends its background tasks with one cancel each. A cancel landing while the room
    listener connects and subscribes is lost inside redis-py (it sends under asyncio.wait_for, which drops a
    cancel on Python 3.11 when the send completes in the same loop turn); the listener then read on in its
    ``get_message`` loop and stop() waited for ever. Stopped at many points of its start-up and of its reads,
    no task needs a second cancel (the old listener needed one when stopped 6 loop turns after start)."""
    for i in range(40):
        m = Metrics()
        st = SharedState(redis_url, f"stop{i}:", 3600, 5.0, m)
        await st.start()
        for _ in range(i):  # stop at a different point of the listener's connect, subscribe and read
            await asyncio.sleep(0)
        async with asyncio.timeout(30):
            again = await st.stop()
        assert again == 0, f"stopped {i} loop turns after start: {again} task(s) ignored their first cancel"
        assert st._listener.done() and st._beat.done()


async def test_batches_go_on_one_connection_and_survive_a_flushed_script_cache(redis_url):
    """The batch script is called on one connection of its own, kept from batch to batch; when Redis forgets
    the script (a restart, SCRIPT FLUSH), the next batch loads it again and nothing falls back."""
    st, m, raw = await _state(redis_url, "f:", wall=ManualClock(), replica_id="r")
    try:
        ks = st.lease_keys(None)
        assert await st.queue_grant(ks, st.lease_member(1, 50), 50, [1000], 30.0) == (True, 0)
        conn = st._scripts["batch"]._conn
        assert conn is not None and conn.is_connected
        await raw.script_flush()
        st.register_scripts()  # registering again keeps the batch's connection
        assert await st.queue_grant(ks, st.lease_member(2, 50), 50, [1000], 30.0) == (True, 0)
        st.lease_release(ks, st.lease_member(1, 50))
        st.lease_release(ks, st.lease_member(2, 50))
        await st.drain()
        assert st._scripts["batch"]._conn is conn and st.up
        assert _bypass(m, "admission") == 0 and await st.reserved(ks[0]) == 0
        assert m.state_backend_calls._value.get() == 3
    finally:
        await st.stop()
        await raw.aclose()
