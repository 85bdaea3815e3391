"""After a Redis outage, whichever path noticed it first and whichever found Redis back first, the first call of
every path succeeds, as a property on a real redis-server.

The paths a replica reaches Redis by, each with the connection it uses: the heartbeat (a pooled connection), a
turn write (the write batch: one connection of its own), an idle claim and the shared queue's grant (asked
through the batch), placement (pooled calls), session inference (a batch write, then a pooled pipeline), an
admission lease (a registered script on a pooled connection) and the ``room`` listener (a pub/sub connection
of its own). A random order of them runs before the outage, while Redis is stopped (any of them may notice the
outage first, or none), and after redis-server is started again on the same port (empty: no persistence).
Once the replica takes Redis for up (never found down, or a heartbeat found it back), each path's first call
must succeed, its write be readable in Redis, and the replica must still take Redis for up; a lease released
during the outage is sent once Redis answers.

The background heartbeat is held back (HEARTBEAT_S) so that the test says which path notices what; the
listener's pause before it subscribes again (real seconds) is the one wait on the clock, bounded by events.
One redis-server of its own, restarted once per example (its own process group, random 127.0.0.1 port).
"""

from __future__ import annotations

import asyncio
import itertools

import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st
from redis.exceptions import RedisError

from conftest import ManualClock, until_state as _until
from kvgate.common.metrics import Metrics
from kvgate.shared import redis_state
from kvgate.shared.redis_state import SharedState
from kvgate.tools import procs

try:
    procs.redis_command(0)
except FileNotFoundError:
    pytest.skip("redis-server not installed (Debian package redis-server)", allow_module_level=True)

PATHS = ("heartbeat", "batch", "ask", "call", "inference", "lease", "queue", "listener")
BLOCK = 4
EXAMPLES = itertools.count()  # each example's key prefix
EVENT_S = 10.0  # bound on waiting for an event (the listener subscribes again after 1 s)


class Server:
    """A redis-server on 127.0.0.1:<random port>; stop() and start() keep the port."""

    def __init__(self, log_dir):
        self.port = procs.free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.log_dir = log_dir
        self.proc = None
        self.starts = 0

    def start(self) -> None:
        if self.proc is not None:
            return
        self.starts += 1
        self.proc = procs.start(f"redis-{self.port}-{self.starts}", procs.redis_command(self.port), self.log_dir)
        procs.wait_redis(self.port, 20, self.proc)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop(5.0)  # its whole process group
            self.proc = None


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("redis-outage"))
    s.start()
    yield s
    s.stop()


class Paths:
    """One call of each path; each returns whether it succeeded, its write read back from Redis."""

    def __init__(self, st: SharedState, raw, prefix: str):
        self.st, self.raw, self.p = st, raw, prefix
        self.n = itertools.count()
        self.granted: list[tuple[list[str], str]] = []  # leases granted, released during the outage

    async def heartbeat(self) -> bool:
        await self.st._heartbeat_once()
        return self.st.up and await self._read(self.raw.get(self.p + "replica:r")) == "1"

    async def batch(self) -> bool:
        sid = f"b{next(self.n)}"
        self.st.turn_started(sid)
        await self.st.drain()
        return await self._read(self.raw.hget(self.p + "sess:" + sid, "if:r")) == "1"

    async def ask(self) -> bool:
        sid = f"i{next(self.n)}"
        self.st.turn_started(sid)   # queued with the claim: the claim answers 'busy', the turn in flight
        verdict, _, _ = await self.st.idle_claim(sid, 3600.0)
        return verdict == "busy"

    async def call(self) -> bool:
        sid = f"c{next(self.n)}"
        got = await self.st.claim_engine(sid, "http://e0", 1)
        return got == ("http://e0", 1) and await self.st.engine_of(sid) == ("http://e0", 1) \
            and await self._read(self.raw.get(self.p + "place:" + sid)) == "1|http://e0"

    async def inference(self) -> bool:
        sid, k = f"f{next(self.n)}", next(self.n)
        prompt, output = [k, 1, 2, 3, 4, 5], [6, 7]
        self.st.link_turn(sid, prompt, output, BLOCK)
        await self.st.drain()
        return await self.st.continued_session(prompt + output + [9], BLOCK) == sid

    async def lease(self) -> bool:
        if not self.st.up and self.granted:  # during the outage: a release Redis cannot confirm is kept
            self.st.lease_release(*self.granted.pop())
            return False
        keys, member = [self.p + "lease:x"], f"r:l{next(self.n)}|5"
        if not await self.st.lease_grant(keys, member, 5, [10**9], 600.0):
            return False
        self.granted.append((keys, member))
        return await self._read(self.raw.zscore(keys[0], member)) is not None

    async def queue(self) -> bool:
        keys, member = self.st.lease_keys("http://e0"), f"r:q{next(self.n)}|5"
        if await self.st.queue_grant(keys, member, 5, [10**9, 10**9], 600.0) != (True, 0):
            return False
        self.granted.append((keys, member))
        return all([await self._read(self.raw.zscore(k, member)) is not None for k in keys])

    async def listener(self) -> bool:
        if await self._down():  # Redis stopped: let the listener find its subscription gone
            await _until(lambda: not self.st.listening.is_set(), "the listener finds the outage")
            return False
        async with asyncio.timeout(EVENT_S):
            await self.st.listening.wait()        # subscribed (the server confirmed it)
        room = self.st.room_event()
        await self.raw.publish(self.p + "room", "1")
        async with asyncio.timeout(EVENT_S):
            await room.wait()
        return True

    async def _down(self) -> bool:
        return await self._read(self.raw.ping()) is None

    @staticmethod
    async def _read(call):
        """The test's own read of Redis; None while Redis is stopped."""
        try:
            return await call
        except (ConnectionError, OSError, RedisError):
            return None


async def _scenario(server: Server, example: int, before, during, after) -> None:
    import redis.asyncio as redis
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff
    prefix = f"o{example}:"
    raw = redis.Redis.from_url(server.url, decode_responses=True, retry=Retry(NoBackoff(), 0),
                               socket_connect_timeout=2.0)
    st_ = SharedState(server.url, prefix, 3600, 0.5, Metrics(), wall=ManualClock(), replica_id="r")
    await st_.start()
    paths = Paths(st_, raw, prefix)
    try:
        for name in before:
            assert await getattr(paths, name)(), f"{name} before the outage"
        await asyncio.to_thread(server.stop)
        for name in during:
            await getattr(paths, name)()   # falls back (or notices the outage); never raises
        await asyncio.to_thread(server.start)
        first: dict[str, bool] = {}
        for name in list(after) + list(PATHS):  # a random order, then each path once more
            if name in first:
                continue
            up = st_.up
            ok = await getattr(paths, name)()
            if up:  # Redis taken for up (never found down, or a heartbeat found it back): the call goes
                first[name] = ok
                assert ok, f"the first {name} after Redis came back failed (plan {before} / {during} / {after})"
                assert st_.up, f"{name} took Redis for down after it came back"
        assert set(first) == set(PATHS)
        await st_.drain()
        assert st_.up and st_.metrics.state_backend_up._value.get() == 1
        assert st_._unsent == {}, "a release kept during the outage was not sent"
    finally:
        await st_.stop()
        await raw.aclose()
        await asyncio.to_thread(server.start)  # an example that failed during the outage leaves none for the next


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(before=st.lists(st.sampled_from(PATHS), max_size=4), during=st.lists(st.sampled_from(PATHS), max_size=3),
       after=st.permutations(PATHS))
@example(before=["batch"], during=[], after=PATHS[::-1])  # an outage no path saw: the batch's connection died
@example(before=["listener", "queue"], during=["listener"], after=PATHS[::-1])  # only the listener saw it
@example(before=["call"], during=["call"], after=PATHS)  # a pooled call saw it, the heartbeat finds Redis back
def test_after_an_outage_every_paths_first_call_succeeds(server, monkeypatch, before, during, after):
    """Every path's first call after Redis came back (and the replica takes it for up) succeeds and its write
    is readable; Redis stays up for the replica; a release kept during the outage reaches Redis."""
    monkeypatch.setattr(redis_state, "HEARTBEAT_S", 3600.0)  # the test's heartbeat op is the only one
    asyncio.run(_scenario(server, next(EXAMPLES), before, during, after))
