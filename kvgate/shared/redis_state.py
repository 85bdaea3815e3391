"""The Redis edge of ``state_backend: redis``: what replicas must agree on, moved in and out of Redis.

Kept in Redis (every key starts with ``redis_key_prefix`` and expires):
  ``sess:<id>``   a hash: ``state`` (active | closing), ``last`` (last activity, epoch seconds),
                  ``if:<replica>`` (that replica's turns in flight), ``epoch`` (+1 each time a turn re-opens
                  it while closing: the closing replica then drops its calls not sent yet); TTL
                  ``redis_session_ttl_s`` from its last touch. Idle close is decided on it by one Lua
                  script, atomically, so exactly one replica closes a session and none closes one another
                  replica just served.
  ``place:<id>``  the session's engine and DP rank (first writer wins, SET NX), TTL as above; deleted when
                  the session closes (a session that comes back is placed again, as on one replica).
  ``link:<key>``  session inference: a hash per chain key of a completed turn's prompt + output (at its
                  last full block): "<length>|<fingerprint of the units after that block>" -> session id;
                  TTL as above.
  ``lease:fleet``, ``lease:<engine>[|<rank>]``  admission leases (sorted sets, score = expiry): granted
                  by one Lua script against the shared ceilings, released on the request's end, dropped by
                  TTL (``admission_lease_ttl_s``) when the replica holding them died.
  ``queue``, ``queue:exp``, ``queue:seq``  the admission wait queue of every replica together: waiters
                  (member "<replica>:<lease>|<tokens>") by global arrival number (``queue:seq``, INCR), and
                  their expiry (each ask refreshes it; a dead replica's waiters leave after WAITER_TTL_S).
                  The grant script gives room only to the oldest live waiter (one global FIFO).
  ``capacity:lease``, ``capacity``  the capacity poll done once for all: the replica holding the lease
                  (SET NX PX, renewed each round) polls the engines and publishes its snapshot; the others
                  read it. Both expire (a dead poller's lease after a few intervals; a snapshot once stale).
  ``prog:<id>``   a program the program policy paused (its context, tokens): its next turn through any
                  replica resumes as a paused program; deleted when it resumes or ends, TTL
                  ``admission_program_ttl_s``.
  ``room``        a pub/sub channel: a released lease or a waiter that left publishes on it while waiters
                  are left in ``queue``, and every replica's waiters ask again at once instead of at their
                  next backoff.
  ``replica:<id>`` a replica's heartbeat (TTL 5 s): the turns in flight of a replica whose heartbeat
                  expired (it died) do not keep a session busy.

Fail-open: a failed or slow call (``redis_timeout_s``) marks Redis unreachable; until a heartbeat
succeeds again, no call is made and every decision falls back to this replica's own state (counted in
``agentic_kv_state_backend_bypass_total{op}``, said once in the log, and once when Redis is back). A call
that went out before that heartbeat and fails after it falls back without marking Redis unreachable again,
and a connection the server closed meanwhile (the batch's, the pool's) is made anew before its next call.
Writes never delay a request: they run in the background (:meth:`drain` waits for them).

Calls made while a request is served (turn starts and ends, idle claims, closes, the shared queue's grants,
lease releases, inference links, pause marks) are queued and sent together as one script call per event-loop
turn, one batch in flight at a time, in the order they were made (kvgate.shared.batch decides the merging
and what falls back): redis-py's CPU per call is paid once per batch instead of once per write. Reads a
request waits for (placement, inference lookups, paused programs) and the capacity poll go out on their own.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections import OrderedDict
from typing import Any, Awaitable, Callable, Sequence

import orjson
from redis.exceptions import NoScriptError, RedisError

from kvgate.common.aio import cancel_tasks
from kvgate.config_credentials import redis_url_shown
from kvgate.shared import fingerprint
from kvgate.shared.batch import Op, WriteBatch, encode, fallbacks
from kvgate.shared.scripts import BATCH, CAPACITY_LEAD, LEASE_GRANT, LEASE_SUM

log = logging.getLogger("kvgate.shared.redis_state")

HEARTBEAT_S = 1.0
#: Redis connections per replica at most; idle ones are reused (redis-server's maxclients, 10,000 by
#: default, bounds all replicas together).
POOL_CONNECTIONS = 4096
REPLICA_TTL_S = 5
# A waiter in the shared queue that has not asked again for this long is gone (its replica died or lost
# Redis): it leaves the queue and stops holding back the waiters after it. Waiters ask at least every 0.2 s.
WAITER_TTL_S = 3.0
# Sessions whose close start (epoch) this replica remembers for close_wanted, most recent kept.
MARKS_MAX = 65536
# Lease releases Redis has not confirmed, kept to send again once it answers (the oldest dropped beyond this;
# those then wait for their lease's TTL).
UNSENT_RELEASES_MAX = 65536

class _OwnConnectionScript:
    """A registered script (redis-py's Script) called on one connection of its own, made from the client's pool
    settings: for the batch, of which one is in flight at a time, taking a pooled connection and giving it back
    around each call is not needed. Measured with hiredis, one call in flight: 94 -> 64 us of CPU per call.
    Called as a Script is: ``await script(keys=[...], args=[...])``. A call that fails or is cancelled drops the
    connection (its reply may still be on the way); the next call makes a new one. So does a call that finds
    the connection closed by the server (Redis restarted while the batch had nothing to send, whether or not
    another path saw the outage) or holding bytes nobody asked for, as redis-py's pool checks a pooled
    connection before lending it."""

    def __init__(self, script) -> None:
        self.script = script
        self._conn = None

    async def __call__(self, keys: list, args: list):
        conn = self._conn
        if conn is not None and not await _reusable(conn):
            self._conn = None
            await conn.disconnect(nowait=True)
            conn = None
        if conn is None:
            conn = self._conn = self.script.registered_client.connection_pool.make_connection()
        try:
            await conn.send_command("EVALSHA", self.script.sha, len(keys), *keys, *args)
            try:
                return await conn.read_response()
            except NoScriptError:  # Redis restarted or flushed its script cache: EVAL loads it again
                await conn.send_command("EVAL", self.script.script, len(keys), *keys, *args)
                return await conn.read_response()
        except BaseException:
            self._conn = None
            await conn.disconnect(nowait=True)
            raise

    async def close(self) -> None:
        """Close the connection, if one is open."""
        conn, self._conn = self._conn, None
        if conn is not None:
            await conn.disconnect(nowait=True)


async def _reusable(conn) -> bool:
    """Whether a kept connection can carry the next call: not yet connected (the call connects it), or connected
    with nothing to read and not closed by the server. redis-py >= 8 names the check can_read (earlier:
    can_read_destructive); it raises ConnectionError for a closed connection."""
    if not conn.is_connected:
        return True
    check = getattr(conn, "can_read", None) or conn.can_read_destructive
    try:
        return not await check()
    except (OSError, RedisError):
        return False


class SharedState:
    """A replica's handle on the shared state. ``url``: the Redis URL; ``prefix``: key prefix;
    ``ttl_s``: seconds a session's keys live after their last touch; ``timeout_s``: one call, seconds;
    ``metrics``: kvgate's Metrics (state_backend_up, state_backend_bypass); ``wall``: epoch seconds,
    shared by the replicas (their clocks must agree to well under the idle threshold; injectable for
    tests); ``client``: a redis.asyncio client to use instead of one built from ``url``."""

    def __init__(self, url: str, prefix: str, ttl_s: float, timeout_s: float, metrics,
                 wall: Callable[[], float] = time.time, client: Any = None, replica_id: str | None = None):
        self.url = url
        self.shown = redis_url_shown(url)  # for the log: without a password
        self.prefix = prefix
        self.ttl = max(1, int(ttl_s))
        self.timeout_s = timeout_s
        self.metrics = metrics
        self.wall = wall
        self.replica = replica_id or secrets.token_hex(6)
        self.up = True
        # Times a heartbeat found Redis back. A call that went out before the latest one and failed after it
        # failed on the outage that heartbeat saw end: it does not take Redis for down again.
        self._recoveries = 0
        self._client = client
        self._scripts: dict[str, Any] = {}
        self._batch_script: _OwnConnectionScript | None = None  # owns the batch's connection (closed by stop)
        self._batch = WriteBatch()
        self._flusher: asyncio.Task | None = None   # sends the queued ops, one batch in flight at a time
        self._wake = asyncio.Event()                 # an op someone waits for was queued: stop lingering
        self._beat: asyncio.Task | None = None
        self._marks: OrderedDict[str, asyncio.Task] = OrderedDict()  # session -> its close mark's task
        self._unsent: OrderedDict[str, list[str]] = OrderedDict()  # lease member -> its keys, release unconfirmed
        self._room = asyncio.Event()       # set (then replaced) when a "room" message arrives
        self._listener: asyncio.Task | None = None
        self.listening = asyncio.Event()   # set once Redis confirmed the "room" subscription, cleared on an error
        metrics.state_backend_up.set(1)

    # --- lifecycle --------------------------------------------------------------------------------

    @property
    def client(self):
        if self._client is None:
            import redis.asyncio as redis
            from redis.backoff import NoBackoff
            from redis.asyncio.retry import Retry  # the asyncio one: the sync Retry is converted, with a warning
            # No client-side retries: a failed call falls back at once (fail-open) and the heartbeat probes.
            # One pooled connection per call in flight, up to POOL_CONNECTIONS: redis-py's default pool refuses
            # the 101st call in flight (MaxConnectionsError), which marked Redis unreachable under load. (Its
            # BlockingConnectionPool queues unfairly: measured, calls waited over 0.5 s with 150 in flight.)
            # The request path's calls go out as one batch at a time; the reads a request waits for do not.
            self._client = redis.Redis.from_url(self.url, socket_timeout=self.timeout_s,
                                                socket_connect_timeout=self.timeout_s, max_connections=POOL_CONNECTIONS,
                                                retry=Retry(NoBackoff(), 0), decode_responses=True)
        return self._client

    async def start(self) -> None:
        """Register the scripts and start the heartbeat (which also finds Redis back after an outage)."""
        self.register_scripts()
        await self._heartbeat_once()
        if not self.up:
            log.warning("Redis at %s unreachable at startup; each replica uses its own state until it answers",
                        self.shown)
        self._beat = asyncio.create_task(self._heartbeat(), name="kvgate-redis-heartbeat")
        self._listener = asyncio.create_task(self._listen(), name="kvgate-redis-room")

    def register_scripts(self) -> None:
        """Load the Lua scripts (sent to Redis on first use; start() does this)."""
        c = self.client
        if self._batch_script is None:  # called again: keep the batch's connection
            self._batch_script = _OwnConnectionScript(c.register_script(BATCH))
        self._scripts = {"batch": self._batch_script, "grant": c.register_script(LEASE_GRANT),
                         "sum": c.register_script(LEASE_SUM), "lead": c.register_script(CAPACITY_LEAD)}
        self._fixed_keys = self.queue_keys()
        self._batch_args = [self.ttl, self.replica, self.prefix + "replica:", self.prefix + "room"]

    async def stop(self) -> int:
        """Send what is queued (up to 1 s), stop the background tasks and close the client. Returns how many
        cancels had to be sent again (kvgate.common.aio.cancel_tasks; 0 when every task stopped at once)."""
        await self.drain(1.0)
        again = await cancel_tasks(self._beat, self._listener, self._flusher)
        if self._batch_script is not None:
            try:
                await self._batch_script.close()
            except Exception:
                pass
        if self._client is not None:
            try:
                await self._client.aclose()
            except Exception:
                pass
        return again

    async def drain(self, timeout_s: float = 5.0) -> None:
        """Wait until the writes queued so far are sent and answered (tests; shutdown)."""
        if self._flusher is not None:
            await asyncio.wait([self._flusher], timeout=timeout_s)

    async def _heartbeat_once(self) -> None:
        sent_at = self._recoveries
        try:
            async with asyncio.timeout(self.timeout_s * 2):
                await self.client.set(self.prefix + "replica:" + self.replica, "1", ex=REPLICA_TTL_S)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._down("heartbeat", exc, sent_at=sent_at)
            return
        if not self.up:
            if self._batch_script is not None:
                # the batch's own connection may still be the one to the server that went away (unused while
                # Redis was down): the next batch makes a new one rather than failing on it
                await self._batch_script.close()
            self.up = True
            self._recoveries += 1
            self.metrics.state_backend_up.set(1)
            log.warning("Redis at %s answers again; replicas share their state again", self.shown)
            unsent, self._unsent = self._unsent, OrderedDict()
            for member, keys in unsent.items():
                self.lease_release(keys, member)

    def room_event(self) -> asyncio.Event:
        """An event set when any replica frees shared room (a lease released, a waiter gone). Take it
        before asking for a grant, then wait on it: a release during the ask is not missed."""
        return self._room

    def _room_freed(self) -> None:
        self._room.set()
        self._room = asyncio.Event()

    async def _listen(self) -> None:
        """Subscribe to the ``room`` channel on a connection of its own (a subscriber blocks on reads)
        and wake the waiters on each message. ``listening`` is set once Redis confirmed the subscription
        (a release published after that is not missed) and cleared on an error; the waiters are woken at
        each subscription too (what was published while unsubscribed is lost). Errors: resubscribe after
        a second; the waiters' backoff covers the gap."""
        import redis.asyncio as redis
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff
        channel = self.prefix + "room"
        while True:
            sub = None
            try:
                # No retries inside redis-py: it would reconnect and resubscribe unseen, leaving ``listening``
                # set while nobody is subscribed; this loop reconnects instead.
                sub = redis.Redis.from_url(self.url, socket_connect_timeout=self.timeout_s, decode_responses=True,
                                           retry=Retry(NoBackoff(), 0))
                ps = sub.pubsub()
                await ps.subscribe(channel)
                me = asyncio.current_task()
                while True:
                    msg = await ps.get_message(timeout=1.0)
                    if me.cancelling():  # a cancel lost inside redis-py (its wait_for on 3.11): honour it here
                        raise asyncio.CancelledError
                    if msg is None:
                        continue
                    if msg["type"] == "subscribe":
                        self.listening.set()
                    self._room_freed()
            except asyncio.CancelledError:
                raise
            except Exception:
                self.listening.clear()
                await asyncio.sleep(1.0)
            finally:
                if sub is not None:
                    try:
                        await sub.aclose()
                    except Exception:
                        pass

    async def _heartbeat(self) -> None:
        me = asyncio.current_task()
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            await self._heartbeat_once()
            if me.cancelling():  # a cancel lost inside redis-py (see _listen)
                raise asyncio.CancelledError

    def _down(self, op: str, exc: BaseException, count: int = 1, sent_at: int | None = None) -> None:
        """A call failed: ``count`` fallbacks of ``op``; Redis taken for down unless the call went out before
        the latest recovery (``sent_at``: ``_recoveries`` when it went out; None: a failure of now)."""
        if count:
            self.metrics.state_backend_bypass.labels(op).inc(count)
        if sent_at is not None and sent_at != self._recoveries:
            return
        if self.up:
            self.up = False
            self.metrics.state_backend_up.set(0)
            log.warning("Redis at %s unreachable (%s: %s); each replica goes on with its own state "
                        "(sessions, placement, inference) until it answers again", self.shown, op,
                        type(exc).__name__)

    async def _call(self, op: str, make: Callable[[], Awaitable[Any]]) -> tuple[bool, Any]:
        """Run one Redis call. Returns (True, result), or (False, None) when Redis is unreachable
        (counted; nothing is attempted while it is known down)."""
        if not self.up:
            self.metrics.state_backend_bypass.labels(op).inc()
            return False, None
        sent_at = self._recoveries
        try:
            async with asyncio.timeout(self.timeout_s * 2):  # no task per call, unlike wait_for
                return True, await make()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._down(op, exc, sent_at=sent_at)
            return False, None

    # --- the write batch: every request's calls in one script call per event-loop turn ---------------

    def _queue(self, op: Op) -> None:
        """Queue ``op`` for the next batch (kvgate.shared.batch); while Redis is known down it falls back at
        once (counted; a release is kept to send again)."""
        if not self.up:
            self._fell_back([op])
            return
        loop = asyncio.get_running_loop()
        now = loop.time()
        self._batch.add(op, now)
        if self._flusher is None:
            self._flusher = loop.create_task(self._flush(), name="kvgate-redis-batch")
        elif self._batch.due_in(now) == 0.0:  # an asker or a turn's start: a lingering flusher sends now
            self._wake.set()

    async def _ask(self, op: Op) -> tuple[bool, Any]:
        """Queue ``op`` and wait for its answer: (True, answer) or (False, None) when Redis did not answer
        (counted). Cancelled: the op still goes (a grant Redis gives a gone asker is released)."""
        if not self.up:
            self._fell_back([op])
            return False, None
        op.waiter = asyncio.get_running_loop().create_future()
        self._queue(op)
        return await op.waiter

    async def _flush(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                wait = self._batch.due_in(loop.time())
                if wait is None:
                    return
                if wait > 0:  # writes nobody waits for: let others join them, unless an asker comes
                    self._wake.clear()
                    try:
                        async with asyncio.timeout(wait):
                            await self._wake.wait()
                    except TimeoutError:
                        pass
                    continue
                ops = self._batch.take(loop.time())
                try:
                    await self._send(ops)
                except Exception:  # a fault of kvgate's own: log it, leave no asker waiting, go on
                    log.exception("shared state: a batch's answers were not delivered; its ops fall back")
                    self._fell_back(ops)
                finally:
                    self._batch.done()
        except asyncio.CancelledError:  # stopping: what is still queued falls back
            self._fell_back(self._batch.drop_queued())
            raise
        finally:
            self._flusher = None

    async def _send(self, ops: list[Op]) -> None:
        """Send one batch and deliver each op's answer; a batch Redis did not answer (or one sent after
        Redis was found down) falls back whole, and what is still queued with it (no call while down)."""
        if not self.up:
            self._fell_back(ops)
            self._fell_back(self._batch.drop_queued())
            return
        keys, rows = encode(ops, self._fixed_keys)
        sent_at = self._recoveries
        self.metrics.state_backend_calls.inc()
        self.metrics.state_backend_ops.inc(len(ops))
        try:
            async with asyncio.timeout(self.timeout_s * 2):
                answers = await self._scripts["batch"](keys=keys, args=[orjson.dumps(rows), *self._batch_args])
        except asyncio.CancelledError:
            self._fell_back(ops)
            raise
        except Exception as exc:
            self._fell_back(ops)
            self._down(ops[0].label, exc, count=0, sent_at=sent_at)
            if not self.up:  # else it failed on an outage a heartbeat since saw end: what is queued goes
                self._fell_back(self._batch.drop_queued())
            return
        failed: list[Op] = []
        if not isinstance(answers, list):
            answers = []
        for op, r in zip(ops, answers):
            try:
                if isinstance(r, str) and r.startswith("!"):
                    failed.append(op)
                elif op.waiter is not None and not op.waiter.done():
                    op.waiter.set_result((True, r))
                elif op.lease is not None and int(r[0]):  # granted to an asker that is gone: give it back
                    self.lease_release(*op.lease)
            except (TypeError, ValueError, IndexError):  # an answer of a shape no op gives: not confirmed
                failed.append(op)
        # a reply shorter than the batch (the script stops a reply at its first nil) leaves no asker waiting
        failed.extend(ops[len(answers):])
        if failed:
            self._fell_back(failed)
            i = ops.index(failed[0])
            self._down(failed[0].label, RuntimeError(str(answers[i]) if i < len(answers) else "no answer"), count=0)
            self._fell_back(self._batch.drop_queued())

    def _fell_back(self, ops: list[Op]) -> None:
        """Ops Redis did not confirm: counted by op, releases kept to send again, askers answered (False,
        None); a grant whose asker is gone is kept as a release too (Redis may have held it)."""
        if not ops:
            return
        by_label, releases = fallbacks(ops)
        for label, n in by_label.items():
            self.metrics.state_backend_bypass.labels(label).inc(n)
        for keys, member in releases:
            self._keep_unsent(keys, member)
        for op in ops:
            if op.waiter is not None and not op.waiter.done():
                op.waiter.set_result((False, None))
            elif op.lease is not None and op.waiter is not None and op.waiter.cancelled():
                self._keep_unsent(*op.lease)

    def _sess(self, sid: str) -> str:
        return self.prefix + "sess:" + sid

    # --- session activity and idle close ------------------------------------------------------------

    def turn_started(self, sid: str) -> None:
        """A turn of ``sid`` starts on this replica (in the background)."""
        self._turn(sid, 1)

    def turn_finished(self, sid: str) -> None:
        """A turn of ``sid`` ended on this replica (in the background)."""
        self._turn(sid, -1)

    def _turn(self, sid: str, delta: int) -> None:
        # merged with the session's turn write still queued, if any (kvgate.shared.batch)
        self._queue(Op("turn", "turn", (self._sess(sid), self.prefix + "place:" + sid), session=sid, delta=delta,
                       started=delta > 0, at=self.wall()))

    def session_closed(self, sid: str, reason: str = "") -> None:
        """This replica closes ``sid`` for ``reason`` (client, idle, admin, ...): the other replicas' idle sweeps
        then mark it closed, for that reason, without calls of their own (in the background; a session Redis
        does not know is left alone). The session's epoch as the close began is kept for :meth:`close_wanted`."""
        op = Op("closed", "turn", (self._sess(sid), self.prefix + "place:" + sid), [reason or ""], session=sid)
        self._marks.pop(sid, None)
        if not self.up:
            self._fell_back([op])
            return
        op.waiter = asyncio.get_running_loop().create_future()
        self._queue(op)
        self._marks[sid] = op.waiter  # close_wanted waits for its answer
        while len(self._marks) > MARKS_MAX:
            self._marks.popitem(last=False)

    async def close_wanted(self, sid: str) -> bool:
        """Before this replica sends one of ``sid``'s close calls: False when the session came back
        through another replica since this one began closing it (its epoch moved on: that replica's turn
        re-opened it on the engine, and a late close would drop its references). True otherwise, also when
        Redis is unreachable or the start of the close was not recorded (fail-open: the close goes)."""
        mark = self._marks.get(sid)
        if mark is None:
            return True
        try:
            ok, epoch = await asyncio.wait_for(asyncio.shield(mark), self.timeout_s * 2)
        except (asyncio.TimeoutError, Exception):
            return True
        if not ok:
            return True
        ok, now = await self._call("turn", lambda: self.client.hget(self._sess(sid), "epoch"))
        return not (ok and int(now or 0) > epoch)

    async def idle_claim(self, sid: str, threshold_s: float) -> tuple[str, float, str]:
        """This replica finds ``sid`` idle for more than ``threshold_s`` seconds on its own. Returns
        ("close", 0, "") when it is idle on every replica and this one won the close, ("busy", age_s, "") when
        a turn is in flight on a live replica or the last activity anywhere is ``age_s`` seconds ago,
        ("elsewhere", 0, reason) when another replica closes it (the reason it recorded: client, idle, ...; ""
        when it recorded none), ("unknown", 0, "") when Redis is unreachable."""
        # through the batch: it reaches Redis after this replica's turn writes made before it
        ok, r = await self._ask(Op("idle", "idle", (self._sess(sid),), [repr(self.wall()), repr(threshold_s)],
                                   session=sid))
        if not ok:
            return "unknown", 0.0, ""
        return str(r[0]), float(r[1]), str(r[2]) if len(r) > 2 else ""

    # --- placement ------------------------------------------------------------------------------------

    async def engine_of(self, sid: str) -> tuple[str, int | None] | None:
        """The engine (base URL) and DP rank another replica placed ``sid`` on, or None."""
        ok, v = await self._call("placement", lambda: self.client.get(self.prefix + "place:" + sid))
        return _target(v) if ok and v else None

    async def claim_engine(self, sid: str, engine: str, dp_rank: int | None,
                           replace: bool = False) -> tuple[str, int | None] | None:
        """Record where this replica placed ``sid``. The first replica's choice wins: returns the stored
        (engine, rank), which differs from the arguments when another replica placed it first. ``replace``:
        the session moved off an engine it cannot use (overwrite). None when Redis is unreachable."""
        key, val = self.prefix + "place:" + sid, f"{'' if dp_rank is None else dp_rank}|{engine}"

        async def run():
            if replace:
                await self.client.set(key, val, ex=self.ttl)
                return val
            if await self.client.set(key, val, ex=self.ttl, nx=True):
                return val
            got = await self.client.get(key)
            await self.client.expire(key, self.ttl)
            return got or val
        ok, v = await self._call("placement", run)
        return _target(v) if ok and v else None

    # --- session inference -----------------------------------------------------------------------------

    def link_turn(self, sid: str, prompt: Sequence[int] | str, output: Sequence[int] | str, block: int) -> None:
        """A turn of ``sid`` completed with ``output``: let any replica link the next turn to it."""
        try:
            link = fingerprint.turn_link(prompt, output, block)
        except (TypeError, OverflowError, ValueError):
            return
        if link is None:
            return
        key, length, tail_fp = link
        k = self.prefix + "link:" + key

        # One hash per block key: GRPO siblings share their first blocks and differ after them.
        self._queue(Op("link", "inference", (k,), [f"{length}|{tail_fp}", sid]))

    async def continued_session(self, units: Sequence[int] | str, block: int) -> str | None:
        """The session whose completed turn (prompt + output) ``units`` extends, as recorded by any
        replica; the longest such turn wins. None when there is none or Redis is unreachable."""
        try:
            keys = fingerprint.chain(units, block)
        except (TypeError, OverflowError, ValueError):
            return None
        if not keys:
            return None
        async def run():
            async with self.client.pipeline(transaction=False) as p:
                for k in keys:
                    p.hgetall(self.prefix + "link:" + k)
                return await p.execute()
        ok, found = await self._call("inference", run)
        if not ok:
            return None
        best, best_len = None, -1
        for links in found:
            for f, sid in (links or {}).items():
                length, tail_fp = f.split("|", 1)
                if int(length) > best_len and fingerprint.continues(units, block, int(length), tail_fp):
                    best, best_len = sid, int(length)
        return best


    # --- the capacity snapshot, polled once for all -----------------------------------------------------

    async def capacity_lead(self, ttl_s: float) -> bool | None:
        """Whether this replica polls the engines for every replica this round: it takes the poll lease
        when nobody holds it, or renews its own, for ``ttl_s`` seconds (another replica takes over once a
        dead poller's lease expires). None when Redis is unreachable (poll on your own)."""
        ok, r = await self._call("capacity", lambda: self._scripts["lead"](
            keys=[self.prefix + "capacity:lease"], args=[self.replica, max(1, int(ttl_s * 1000))]))
        return bool(r) if ok else None

    async def publish_capacity(self, snapshot: dict, ttl_s: float) -> None:
        """Publish the polling replica's snapshot (ClusterSnapshot.to_wire()); it stamps the wall time and
        vanishes after ``ttl_s`` seconds (when it would be stale)."""
        body = orjson.dumps({"at": self.wall(), "by": self.replica, "snapshot": snapshot})
        await self._call("capacity", lambda: self.client.set(self.prefix + "capacity", body,
                                                             px=max(1, int(ttl_s * 1000))))

    async def read_capacity(self) -> tuple[dict, float, str] | None:
        """The published snapshot: (ClusterSnapshot.to_wire() mapping, its age in seconds, the replica that
        polled it); None when there is none (expired, never published, unreadable) or Redis is unreachable."""
        ok, raw = await self._call("capacity", lambda: self.client.get(self.prefix + "capacity"))
        if not ok or not raw:
            return None
        try:
            obj = orjson.loads(raw)
            return obj["snapshot"], max(0.0, self.wall() - float(obj["at"])), str(obj["by"])
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
            return None

    # --- admission leases ------------------------------------------------------------------------------

    def lease_keys(self, place: Any) -> list[str]:
        """The sorted sets a lease on ``place`` counts in: the fleet's, plus its engine's ("<url>") or DP
        rank's ("<url>|<rank>") when ``place`` is an engine URL or an (engine URL, rank) pair."""
        keys = [self.prefix + "lease:fleet"]
        if isinstance(place, str):
            keys.append(self.prefix + "lease:" + place)
        elif isinstance(place, tuple) and len(place) == 2:
            keys.append(self.prefix + f"lease:{place[0]}|{place[1]}")
        return keys

    def lease_member(self, lease_id: Any, tokens: int) -> str:
        return f"{self.replica}:{lease_id}|{max(0, int(tokens))}"

    async def lease_grant(self, keys: Sequence[str], member: str, tokens: int, ceilings: Sequence[int],
                          ttl_s: float) -> bool | None:
        """Hold ``tokens`` under ``member`` in every set of ``keys`` (see :meth:`lease_keys`) if each stays
        within its ceiling (tokens; same order as ``keys``); the hold expires after ``ttl_s`` seconds
        unless released. True: granted; False: refused (wait and ask again); None: Redis unreachable."""
        now = self.wall()
        ok, r = await self._call("admission", lambda: self._scripts["grant"](
            keys=list(keys), args=[repr(now), repr(now + ttl_s), member, max(0, int(tokens)),
                                   max(1, int(ttl_s) + 1), *[int(c) for c in ceilings]]))
        return bool(r) if ok else None

    def queue_keys(self) -> list[str]:
        """The shared wait queue's keys (queue, expiries, arrival counter), for :meth:`queue_grant`."""
        return [self.prefix + "queue", self.prefix + "queue:exp", self.prefix + "queue:seq"]

    async def queue_grant(self, keys: Sequence[str], member: str, tokens: int, ceilings: Sequence[int],
                          ttl_s: float, seq: int = 0, backfill: bool = False,
                          force: bool = False) -> tuple[bool, int] | None:
        """:meth:`lease_grant` in one FIFO shared by every replica: ``member`` is granted ``tokens`` in every
        set of ``keys`` only when no live waiter (of any replica) arrived before it and it fits each ceiling;
        otherwise it waits in the shared queue. Ask again (every 0.2 s at most: a waiter that does not ask
        for WAITER_TTL_S seconds leaves the queue) with the arrival number returned, which keeps its place.
        ``backfill``: it may also pass the earlier waiters when the fleet's reservations, plus it, plus
        every earlier waiter's tokens fit the fleet ceiling (so it takes no room they could use).
        ``force``: granted at once whatever the room and the queue (a bypass, protected or aged, still
        reserves, so the other replicas see its tokens); it leaves the queue if it waited there.
        Returns (granted, arrival number; 0 when granted without waiting), or None when Redis is
        unreachable. Call :meth:`queue_leave` when the waiter goes without a grant (aged, cancelled)."""
        now = self.wall()
        keys = list(keys)
        op = Op("grant", "admission", keys,
                [repr(now), repr(now + ttl_s), member, max(0, int(tokens)), max(1, int(ttl_s) + 1),
                 repr(now + WAITER_TTL_S), int(seq), "force" if force else ("1" if backfill else "0"),
                 [int(c) for c in ceilings]], lease=(keys, member))
        ok, r = await self._ask(op)
        if not ok:
            return None
        return bool(int(r[0])), int(r[1])

    def queue_leave(self, member: str) -> None:
        """``member`` stops waiting in the shared queue without a grant (in the background)."""
        self._queue(Op("leave", "admission", (), [member]))

    async def queue_waiting(self) -> list[tuple[str, int]]:
        """The shared queue now, oldest first: (member, arrival number); [] when Redis is unreachable
        (figures, tests)."""
        ok, r = await self._call("admission", lambda: self.client.zrange(self.queue_keys()[0], 0, -1,
                                                                         withscores=True))
        return [(m, int(sc)) for m, sc in r] if ok else []

    # --- the program policy's paused programs ----------------------------------------------------------

    def program_paused(self, sid: str, tokens: int, ttl_s: float) -> None:
        """This replica paused ``sid``'s program with ``tokens`` of context (in the background); the mark
        lives ``ttl_s`` seconds unless it resumes or ends first."""
        self._queue(Op("paused", "admission", (self.prefix + "prog:" + sid,),
                       [str(max(0, int(tokens))), max(1, int(ttl_s))]))

    def program_unpaused(self, sid: str) -> None:
        """``sid``'s program resumed or ended (in the background)."""
        self._queue(Op("unpaused", "admission", (self.prefix + "prog:" + sid,)))

    async def paused_program(self, sid: str) -> int | None:
        """The context (tokens) of ``sid``'s program if a replica paused it and it has not resumed; None
        when it is not paused or Redis is unreachable (it then starts as a new program)."""
        ok, v = await self._call("admission", lambda: self.client.get(self.prefix + "prog:" + sid))
        try:
            return int(v) if ok and v is not None else None
        except ValueError:
            return None

    def lease_release(self, keys: Sequence[str], member: str) -> None:
        """Release a lease granted by :meth:`lease_grant` or :meth:`queue_grant` (in the background). Also
        for a grant whose answer never came (a timeout: Redis may have held it). A release Redis does not
        confirm (unreachable, or the call failed) is kept and sent again when Redis answers, so a lease is
        never held longer than the request unless more than UNSENT_RELEASES_MAX releases wait."""
        keys = list(keys)
        self._unsent.pop(member, None)
        # the script publishes on the room channel when waiters are left to wake (of every replica)
        self._queue(Op("release", "admission", keys, [member], release=(keys, member)))

    def _keep_unsent(self, keys: list[str], member: str) -> None:
        self._unsent[member] = keys
        while len(self._unsent) > UNSENT_RELEASES_MAX:
            self._unsent.popitem(last=False)

    async def reserved(self, key: str) -> int | None:
        """Live reserved tokens in one lease set (a key from :meth:`lease_keys`); None when unreachable."""
        ok, r = await self._call("admission", lambda: self._scripts["sum"](keys=[key], args=[repr(self.wall())]))
        return int(r) if ok else None


def _target(v: str) -> tuple[str, int | None]:
    rank, engine = v.split("|", 1)
    return engine, (int(rank) if rank else None)
