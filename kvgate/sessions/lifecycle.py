"""Session lifecycle: feeds the registry and delivers /close_session to every engine (I/O edge).

Decisions (who is idle, whether a close is due, which engine still needs it and when to retry) are the
registry's (kvgate.sessions.registry). Here:
  - a close waits for the session's in-flight requests (bounded by ``session_close_drain_s``),
  - then queues one /close_session {"session_id"} call per engine; each engine has its own queue served
    by at most ``close_concurrency`` calls at once, paced to ``close_max_rate`` calls per second, so a
    burst of closes (an idle sweep of 100k sessions) neither floods an engine nor blocks kvgate, and a
    call's ``close_timeout_s`` counts only its own time on the wire, never a wait for a free slot,
  - a call that failed (connect error, timeout, 5xx) stays pending on that engine and is retried with
    backoff until it succeeds or ``close_retries`` are used up; while an engine fails, only one call at
    a time probes it (the other closes wait, their attempts not counted), and once it answers again
    its pending closes are all retried at once,
  - an engine that leaves the fleet (the router no longer lists it) gets no new closes; the ones already
    queued still go out once (a router that lists no engine for a moment loses nothing), a failed one is
    dropped instead of retried, and its pending retries are dropped at once (counted by reason); once
    nothing is queued, on the wire or pending for it, its queue and workers are removed,
  - it never blocks or fails the caller, and logs per engine (when it starts and stops failing), not
    per session.
The router does not proxy /close_session (docs/compatibility.md), so kvgate calls the engines directly.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict, deque
from typing import Any, Awaitable, Callable

import aiohttp

from kvgate.common.aio import cancel_tasks

from kvgate.fleet.directory import EngineDirectory
from kvgate.sessions.identity import session_marks
from kvgate.sessions.idle_policy import ClientAborts, IdlePolicy, StepTracker, ends_session
from kvgate.common.metrics import Metrics
from kvgate.sessions.registry import (ACTIVE, CLOSED, CLOSING, ENGINE_GONE, FAILED, PENDING, SENDING, CloseRetry,
                                      SessionRegistry)

log = logging.getLogger("kvgate.sessions.lifecycle")

# Closes queued per idle sweep step before yielding to the event loop.
_SWEEP_BATCH = 500


async def close_on_engine(session: aiohttp.ClientSession, url: str, session_id: str,
                          timeout_s: float) -> tuple[str, bool]:
    """POST /close_session to one engine, once. Returns (result, final): result "ok" or a short error
    text; final True for an answer not worth retrying (a 4xx: the engine refuses it). Never raises.
    A timeout is an error: the engine may not have the close (SGLang answers a close at once)."""
    try:
        async with session.post(url + "/close_session", json={"session_id": session_id},
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            await resp.read()
            if resp.status < 400:
                return "ok", False
            return f"http {resp.status}", resp.status < 500
    except asyncio.TimeoutError:
        return f"timeout after {timeout_s}s", False
    except (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
        return f"connect error: {type(exc).__name__}", False
    except aiohttp.ClientError as exc:
        return type(exc).__name__, False


class _EngineQueue:
    """One engine's close calls waiting for a slot, its workers and its pacing and health state."""

    def __init__(self, url: str):
        self.url = url
        self.items: deque[tuple[str, int, bool]] = deque()  # (session_id, close_gen, is a retry)
        self.active = 0          # calls out now
        self.wake = asyncio.Event()
        self.workers: list[asyncio.Task] = []
        self.next_slot = 0.0     # perf_counter time of the next paced call
        self.failing = False     # the last call failed (logged once per change)
        self.given_up = 0        # closes given up since the last log line
        self.given_up_logged = 0.0


class SessionLifecycle:
    """Owns the registry, runs closes, their retries and the idle sweep.

    policy: when a session counts as idle (fixed or adaptive, kvgate.sessions.idle_policy); steps: which
    sessions still have KV since the last cache flush; close_on_abort: close a session whose turn ended in
    an abort the client asked for (/abort_request naming the turn's rid). close_timeout_s: one call, seconds;
    close_retries, close_backoff_s, close_max_backoff_s: the retry policy (kvgate.sessions.registry.CloseRetry);
    close_concurrency: calls at once per engine; close_max_rate: calls per second per engine (0 = unpaced).
    clock: monotonic seconds (injectable for tests of the shell).
    """

    def __init__(self, registry: SessionRegistry, directory: EngineDirectory, metrics: Metrics, *,
                 drain_s: float, close_timeout_s: float, close_retries: int, close_backoff_s: float = 0.5,
                 close_max_backoff_s: float = 60.0, close_concurrency: int = 8, close_max_rate: float = 1000.0,
                 policy: IdlePolicy | None = None, steps: StepTracker | None = None, close_on_abort: bool = True,
                 close_children: bool = True, clock: Callable[[], float] = time.monotonic):
        self.registry = registry
        registry.retry = CloseRetry(close_retries, close_backoff_s, close_max_backoff_s)
        self.directory = directory
        self.metrics = metrics
        self.policy = policy or IdlePolicy(fixed_s=300.0)
        self.steps = steps or StepTracker(registry.max_sessions)
        self.aborts = ClientAborts(registry.max_sessions)
        self.close_on_abort = close_on_abort
        self.close_children = close_children
        self.drain_s = drain_s
        self.close_timeout_s = close_timeout_s
        self.close_concurrency = max(1, close_concurrency)
        self.close_max_rate = close_max_rate
        self.clock = clock
        self._drained: dict[str, asyncio.Event] = {}
        self._draining: dict[str, asyncio.Task] = {}
        self._started: OrderedDict[str, float] = OrderedDict()  # close start (perf_counter) per session
        self._queues: dict[str, _EngineQueue] = {}
        self._gone: set[str] = set()  # engines with a queue that the fleet no longer lists
        self.queues_removed = 0
        self._on_wire: dict[str, int] = {}  # close calls on the wire, per session
        self._session: aiohttp.ClientSession | None = None
        self._idle_task: asyncio.Task | None = None
        self._retry_task: asyncio.Task | None = None
        self._retry_wake = asyncio.Event()
        self._changed = asyncio.Event()
        # Called with the session id when a close begins (session placement forgets the session).
        self.on_close: list[Callable[[str], None]] = []
        # Replicas sharing state: (session_id, threshold_s) -> (verdict, age_s), see sweep_idle.
        self.idle_check: Callable[[str, float], Awaitable[tuple[str, float]]] | None = None
        # Replicas sharing state: session_id -> False when the session came back through another replica
        # since this one began closing it (its calls not sent yet are then dropped), asked before each call.
        self.close_check: Callable[[str], Awaitable[bool]] | None = None
        directory.on_change.append(self.engines_changed)
        self._publish()

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            # No pool limit: each engine's workers bound its connections (close_concurrency).
            # The engines' API key (engine_api_key_file), when they need one.
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                                  headers=getattr(self.directory, "engine_headers", None))
        return self._session

    async def start(self) -> None:
        if self.policy.mode == "adaptive" or self.policy.fixed_s > 0:
            self._idle_task = asyncio.create_task(self._idle_loop(), name="kvgate-idle-close")
        self._retry_task = asyncio.create_task(self._retry_loop(), name="kvgate-close-retry")

    async def stop(self) -> None:
        workers = [w for q in self._queues.values() for w in q.workers]
        await cancel_tasks(*self._draining.values(), *workers, self._idle_task, self._retry_task)
        if self._session is not None:
            await self._session.close()

    # --- request hooks (called by the proxy; must never raise into it) -----------------------------

    def request_started(self, session_id: str, source: str | None) -> None:
        now = self.clock()
        s = self.registry.get(session_id)
        if s is not None and s.state != ACTIVE:
            # The session came back (an idle close during a long tool call): SGLang 0.5.17+ re-opens the
            # id on this request, so kvgate re-opens it too and drops the closes not delivered yet.
            cancelled = len(s.unfinished())
            if cancelled:
                self.metrics.session_close_cancelled.inc(cancelled)
            self.metrics.session_reopened.inc()
            self._started.pop(session_id, None)
        self.registry.request_started(session_id, source, now)
        self.policy.on_turn_start(session_id, now)
        self.steps.on_kv(session_id)

    async def before_turn(self, session_id: str) -> None:
        """Call before a request of ``session_id`` goes out. When close calls for it are on the wire (it is
        coming back while kvgate closes it), wait for their answers, at most ``close_timeout_s``: a close
        that reached the engine after this request would drop the continued session's references. Calls
        still queued need no wait: the request re-opens the session and they are dropped."""
        if not self._on_wire.get(session_id):
            return
        try:
            await self.wait_until(lambda: not self._on_wire.get(session_id), self.close_timeout_s)
        except asyncio.TimeoutError:
            pass

    def request_finished(self, session_id: str, meta: dict | None, finish_type: str | None,
                         rids: tuple = (), usage_source: str | None = None) -> None:
        """One turn of the session ended. ``rids``: the request ids it went by (the body's rid, the
        response's meta_info.id); an abort closes the session only when the client asked for it by rid."""
        now = self.clock()
        self.registry.request_finished(session_id, now, meta, usage_source)
        retracted = meta.get("num_retractions") if meta else None
        if isinstance(retracted, int) and not isinstance(retracted, bool) and retracted > 0:
            self.metrics.session_retractions.inc(retracted)
        self.policy.on_turn_end(session_id, now)
        self.steps.on_kv(session_id)
        s = self.registry.get(session_id)
        if s is not None and s.in_flight == 0:
            ev = self._drained.get(session_id)
            if ev is not None:
                ev.set()
        if ends_session(finish_type):
            asked = any(self.aborts.asked(r) for r in rids)
            self.metrics.session_aborts.labels("client" if asked else "other").inc()
            # An abort the client did not ask for (a weight update, a flush, a memory release, an engine
            # fault) is a step boundary: the rollout goes on with the same session.
            if asked and self.close_on_abort:
                self.close(session_id, "abort")

    def request_refused(self, session_id: str) -> bool:
        """A request of the session ended refused by the upstream (a 4xx: nothing ran on an engine): no turn of
        it (kvgate.sessions.registry.SessionRegistry.request_refused). Returns True when the session is gone
        (refused requests alone made it): its idle timing and step are forgotten too."""
        now = self.clock()
        dropped = self.registry.request_refused(session_id)
        if dropped:
            self.policy.forget(session_id)
            self.steps.forget(session_id)
        else:
            self.policy.on_turn_end(session_id, now)
            s = self.registry.get(session_id)
            if s is not None and s.in_flight == 0:
                ev = self._drained.get(session_id)
                if ev is not None:
                    ev.set()
        return dropped

    def turn_marks(self, session_id: str, headers) -> str | None:
        """What the turn's request headers said about its session, applied once its answer has gone out (call
        after :meth:`request_finished`): a subagent's parent (x-dynamo-parent-session-id) is linked; a final-turn
        marker (X-Session-Final / x-dynamo-session-final: true) closes the session now, whatever the turn's
        outcome (a client that retries a failed final turn re-opens it). Returns "final" when it closed it."""
        final, parent = session_marks(headers)
        if parent is not None:
            self.registry.link_parent(session_id, parent)
        if final:
            s = self.registry.get(session_id)
            if s is not None and s.state == ACTIVE:
                self.close(session_id, "final")
                return "final"
        return None

    def abort_requested(self, body: dict | None) -> None:
        """A client's /abort_request passed through kvgate: remember the rid(s) it names."""
        if isinstance(body, dict):
            self.aborts.note(body.get("rid"))

    def step_boundary(self, path: str, status: int | None, body: dict | None) -> bool:
        """A relayed request that may have flushed the engines' KV (weights update, flush_cache ...)."""
        return self.steps.on_boundary(path, status, body)

    # --- closing -------------------------------------------------------------------------------

    def close(self, session_id: str, reason: str) -> bool:
        """Start (or re-arm) closing ``session_id`` in the background; idempotent. True when calls were
        queued or a drain started; False when there was nothing to do (closed everywhere already, calls
        still out, or its KV went with a cache flush)."""
        now = self.clock()
        s = self.registry.get(session_id)
        fresh = s is None or s.state == ACTIVE
        if not self.registry.begin_close(session_id, reason, now):
            return False
        s = self.registry.get(session_id)
        if fresh:
            for cb in self.on_close:
                try:
                    cb(session_id)
                except Exception:  # a consumer's fault must not stop the close
                    log.exception("on_close callback failed")
        if fresh and reason in ("idle", "abort") and not self.steps.has_kv(session_id):
            # Its KV went with a cache flush (a step boundary): nothing to free on the engines.
            self.registry.skip_close(session_id, now)
            self.metrics.session_close_skipped.labels("no_kv").inc()
            self._notify()
            return False
        if fresh:
            self._started[session_id] = time.perf_counter()
            if self.close_children and reason != "pause":
                # A subagent's session goes with its parent's (the parent closed first); a child that closes
                # first stays listed under its parent.
                for child in self.registry.children(session_id):
                    c = self.registry.get(child)
                    if c is not None and c.state == ACTIVE:
                        self.close(child, "parent")
        if session_id in self._draining:
            return True
        if s.in_flight > 0 and self.drain_s > 0:
            # The event exists before the task runs: a call that ends in this same turn of the event loop (a
            # program paused as its turn's answer is recorded) must find it, or the close waits out drain_s.
            self._drained.setdefault(session_id, asyncio.Event())
            task = asyncio.create_task(self._drain_then_send(session_id), name=f"kvgate-close-{session_id}")
            self._draining[session_id] = task
            task.add_done_callback(lambda _t, sid=session_id: self._draining.pop(sid, None))
            return True
        self._send(session_id)
        return True

    def close_asked(self, session_id: str, reason: str) -> dict[str, Any]:
        """A client's close (/close_session, /finish_session): :meth:`close`, and what kvgate answers it.
        Returns {session_id; known: kvgate's registry had a call of the session (never with session lifecycle
        off: the registry then tracks no call; an id it never saw is closed on every engine all the same:
        kvgate may not have routed it, or routed it before a restart); state:
        closing or closed (closed on every engine already: a repeated close); engines: how many engines the
        close goes or went to: those it was sent to or, while it waits for the session's calls in flight or
        for an engine to be known, the engines listed now (0: none yet, it goes to the first listed)}."""
        before = self.registry.get(session_id)
        known = before is not None and (before.turns > 0 or before.in_flight > 0)
        self.close(session_id, reason)
        s = self.registry.get(session_id)
        engines = len(s.engine_closes) if s is not None and s.engine_closes else len(self.directory.close_urls)
        return {"session_id": session_id, "known": known, "state": s.state if s is not None else CLOSED,
                "engines": engines}

    async def _drain_then_send(self, session_id: str) -> None:
        s = self.registry.get(session_id)
        ev = self._drained.setdefault(session_id, asyncio.Event())
        try:
            async with asyncio.timeout(self.drain_s):  # not wait_for: see kvgate.common.aio
                if s is not None and s.in_flight > 0:
                    await ev.wait()
        except TimeoutError:
            log.info("session %s: closing with %d requests still in flight after %.1fs",
                     session_id, s.in_flight if s else 0, self.drain_s)
        finally:
            self._drained.pop(session_id, None)
        self._send(session_id)

    def _send(self, session_id: str) -> None:
        s = self.registry.get(session_id)
        if s is None:
            return
        # every engine of every role: in a PD fleet the decode worker holds the session, the prefill worker its prompts
        urls = self.registry.to_send(session_id, self.directory.close_urls, self.clock())
        for u in urls:
            self._enqueue(u, session_id, s.close_gen)
        if s.state == CLOSED:  # its last pending close was dropped (the engine left)
            self._finished(session_id)

    def engines_changed(self, engines: Any = None) -> None:
        """The fleet's engine list changed (directory on_change): an engine with a close queue that is no
        longer listed gets its pending retries dropped (counted, reason ``engine_gone``) and its queue removed
        once nothing is left for it; one listed again is kept. A close that began while no engine was known
        is sent to the engines listed now."""
        listed = set(self.directory.urls)
        now = self.clock()
        for url in list(self._queues):
            if url in listed:
                self._gone.discard(url)
            elif url not in self._gone:
                self._gone.add(url)
                dropped = self.registry.drop_engine(url, now, ENGINE_GONE)
                if dropped:
                    self.metrics.session_close_dropped.labels("engine_gone").inc(len(dropped))
                log.info("engine %s left the fleet: %d pending closes dropped; its queue goes once its %d queued "
                         "closes are sent", url, len(dropped), len(self._queues[url].items))
                for sid in dropped:  # closed now that nothing else is unfinished: counted like any close
                    s = self.registry.get(sid)
                    if s is not None and s.state == CLOSED:
                        self._finished(sid)
        if listed:  # closes that began while no engine was known go to the engines listed now
            for sid in self.registry.awaiting_engines():
                if sid not in self._draining:
                    self._send(sid)
            # the registry may have dropped some of them over its cap meanwhile: their start times go too
            for sid in [sid for sid in self._started if self.registry.get(sid) is None]:
                del self._started[sid]
        self._retire_settled()
        self._notify()

    def _retire_settled(self) -> None:
        """Remove the queue (and stop the workers) of each engine that left the fleet and has nothing queued,
        on the wire or pending."""
        for url in list(self._gone):
            q = self._queues.get(url)
            if q is None:
                self._gone.discard(url)
                continue
            if q.items or q.active or self.registry.unfinished_on(url):
                continue
            del self._queues[url]
            self._gone.discard(url)
            self.queues_removed += 1
            for w in q.workers:
                w.cancel()  # idle: waiting for work that no longer comes
            log.info("engine %s: close queue removed (the engine left the fleet)", url)

    def _enqueue(self, url: str, session_id: str, gen: int, retry: bool = False) -> None:
        q = self._queues.get(url)
        if q is None:
            q = self._queues[url] = _EngineQueue(url)
            q.workers = [asyncio.create_task(self._worker(q), name=f"kvgate-close-worker-{url}")
                         for _ in range(self.close_concurrency)]
        q.items.append((session_id, gen, retry))
        q.wake.set()

    async def _worker(self, q: _EngineQueue) -> None:
        while True:
            while not q.items:
                if q.url in self._gone:
                    self._retire_settled()  # may cancel this worker: it then ends at the wait below
                q.wake.clear()
                await q.wake.wait()
            session_id, gen, retry = q.items.popleft()
            if not self._wanted(session_id, gen, q.url):
                continue  # the session came back while this call waited
            if self.close_check is not None and not await self._still_wanted(session_id, gen, q.url):
                continue
            if q.failing and q.active > 0:
                # The engine is failing and another call probes it: wait for it to answer again
                # (engine_back) rather than spend this close's attempts on it.
                self.registry.defer(session_id, gen, q.url, self.clock() + self.registry.retry.max_backoff_s)
                if q.url in self._gone and self.registry.drop_close(session_id, q.url, self.clock(), ENGINE_GONE):
                    self.metrics.session_close_dropped.labels("engine_gone").inc()
                    s = self.registry.get(session_id)
                    if s is not None and s.state == CLOSED:
                        self._finished(session_id)
                continue
            if retry:
                self.registry.note_retry()
                self.metrics.session_close_retries.inc()
            if self.close_max_rate > 0:
                now = time.perf_counter()
                slot = max(now, q.next_slot)
                q.next_slot = slot + 1.0 / self.close_max_rate
                if slot > now:
                    await asyncio.sleep(slot - now)
            t0 = time.perf_counter()
            q.active += 1
            self._on_wire[session_id] = self._on_wire.get(session_id, 0) + 1
            try:
                result, final = await close_on_engine(self.session, q.url, session_id, self.close_timeout_s)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # never let one call kill the worker
                result, final = f"error: {type(exc).__name__}", False
            finally:
                q.active -= 1
                left = self._on_wire.pop(session_id, 1) - 1
                if left:
                    self._on_wire[session_id] = left
            self.metrics.close_call_latency.observe(time.perf_counter() - t0)
            try:
                self._on_result(q, session_id, gen, result, final)
            except Exception:
                log.exception("close result handling failed")
                self.metrics.faults.labels("registry").inc()

    async def _still_wanted(self, session_id: str, gen: int, url: str) -> bool:
        """Replicas sharing state: False when the session came back through another replica since this one
        began closing it (its calls not sent yet are dropped here: a late close would drop the continued
        session's references on the engine), or when it came back here while asking."""
        try:
            wanted = await self.close_check(session_id)
        except Exception:  # fail-open: the close goes as without sharing
            log.exception("shared close check failed")
            wanted = True
        if not self._wanted(session_id, gen, url):
            return False
        if not wanted:
            n = self.registry.cancel_close(session_id, self.clock())
            self.metrics.session_close_cancelled.inc(n)
            self._started.pop(session_id, None)
            self._notify()
        return wanted

    def _wanted(self, session_id: str, gen: int, url: str) -> bool:
        s = self.registry.get(session_id)
        if s is None or s.close_gen != gen or s.state != CLOSING:
            return False
        e = s.engine_closes.get(url)
        return e is not None and e.state == SENDING

    def _on_result(self, q: _EngineQueue, session_id: str, gen: int, result: str, final: bool) -> None:
        now = self.clock()
        state = self.registry.close_result(session_id, gen, q.url, result, now, final)
        dropped = state == PENDING and q.url in self._gone and \
            self.registry.drop_close(session_id, q.url, now, ENGINE_GONE)
        if dropped:  # the engine left the fleet: no retry
            state = FAILED
            self.metrics.session_close_dropped.labels("engine_gone").inc()
        self._engine_seen(q.url, result)
        if result == "ok":
            self.metrics.close_calls.labels("ok").inc()
            if q.failing:
                q.failing = False
                n = self.registry.engine_back(q.url, now)
                # this call was one of the pending closes: it went through; n counts the others
                log.warning("engine %s answers /close_session again: the close of %s went through%s", q.url,
                            session_id, f"; retrying its {n} other pending closes now" if n else
                            " (no other close was pending)")
                self._retry_wake.set()
        else:
            self.metrics.close_calls.labels("error").inc()
            self.metrics.session_close_failure.inc()
            if not q.failing:
                q.failing = True
                log.warning("engine %s: /close_session failed (%s); its closes stay pending and are retried "
                            "with backoff", q.url, result)
            if state == PENDING:
                self._retry_wake.set()
            elif state == FAILED and not dropped:
                self.metrics.session_close_given_up.inc()
                q.given_up += 1
                if now - q.given_up_logged >= 60.0:
                    log.warning("engine %s: gave up %d closes (last: %s after %s); ask again to retry",
                                q.url, q.given_up, session_id, result)
                    q.given_up, q.given_up_logged = 0, now
        s = self.registry.get(session_id)
        if s is not None and s.state == CLOSED and s.close_gen == gen:
            self._finished(session_id)
        self._notify()

    def _engine_seen(self, url: str, result: str) -> None:
        # kvgate's own calls say whether the engine is there, sooner than the router's health checks.
        try:
            if result.startswith("connect error"):
                self.directory.engine_call_failed(url, f"/close_session: {result}")
            elif result == "ok" or result.startswith("http "):
                self.directory.engine_answered(url)
        except Exception:
            log.exception("engine health update failed")

    def _finished(self, session_id: str) -> None:
        s = self.registry.get(session_id)
        t0 = self._started.pop(session_id, None)
        if t0 is not None:
            self.metrics.close_latency.observe(time.perf_counter() - t0)
        if s is not None:
            self.metrics.session_close.labels(s.close_reason or "client").inc()
        self._notify()

    async def _retry_loop(self) -> None:
        while True:
            try:
                nxt = self.registry.next_due()
                wait = None if nxt is None else max(0.0, nxt - self.clock())
                if wait is None or wait > 0:
                    try:
                        async with asyncio.timeout(wait):  # not wait_for: see kvgate.common.aio
                            await self._retry_wake.wait()
                    except TimeoutError:
                        pass
                self._retry_wake.clear()
                for sid, gen, url in self.registry.due_retries(self.clock()):
                    self._enqueue(url, sid, gen, retry=True)
                await asyncio.sleep(0)
            except asyncio.CancelledError:
                raise
            except Exception:  # never let a registry fault stop retries
                log.exception("close retry loop failed")
                self.metrics.faults.labels("registry").inc()
                await asyncio.sleep(1.0)

    async def _idle_loop(self) -> None:
        while True:
            # A sweep every quarter of the (smallest) idle threshold, at most every 5 s, bounds lateness.
            threshold = self.policy.sweep_threshold()
            await asyncio.sleep(min(max(threshold / 4, 0.05), 5.0) if threshold > 0 else 5.0)
            try:
                await self.sweep_idle()
            except asyncio.CancelledError:
                raise
            except Exception:  # never let a registry fault kill the sweep
                log.exception("idle sweep failed")
                self.metrics.faults.labels("idle_sweep").inc()

    async def sweep_idle(self) -> int:
        """One idle sweep: close the sessions idle past their threshold. With ``idle_check`` set (replicas
        sharing state), a session idle here is closed only when it is idle on every replica and this
        replica wins its close; one another replica closes is marked closed here without calls. Returns
        the number of closes this sweep started."""
        now = self.clock()
        started = 0
        for i, sid in enumerate(self.registry.idle_sessions(now, self.policy.sweep_threshold())):
            s = self.registry.get(sid)
            if s is not None and s.state == ACTIVE and self.policy.should_close(sid, now - s.last_seen):
                if self.idle_check is None:
                    started += bool(self.close(sid, "idle"))
                else:
                    started += await self._shared_idle(sid)
            if i % _SWEEP_BATCH == _SWEEP_BATCH - 1:
                await asyncio.sleep(0)  # a sweep of 100k sessions must not hold up requests
        return started

    async def _shared_idle(self, sid: str) -> int:
        verdict, age, reason = await self.idle_check(sid, self.policy.threshold(sid))
        s = self.registry.get(sid)
        if s is None or s.state != ACTIVE or s.in_flight:
            return 0  # a turn came while Redis answered
        if verdict == "close":
            return int(bool(self.close(sid, "idle")))
        if verdict == "busy":
            # Another replica served it: its idle time restarts from the shared last activity.
            self.registry.touch(sid, self.clock() - age)
        elif verdict == "elsewhere":
            self.closed_elsewhere(sid, reason)
        # "unknown" (Redis unreachable): no close now, asked again on the next sweep.
        return 0

    def closed_elsewhere(self, session_id: str, reason: str = "") -> None:
        """Another replica closes ``session_id`` on every engine, for ``reason`` (the one it recorded: client,
        idle, ...; "" when unknown, taken as idle): mark it closed here, for that reason, without calls (its
        consumers, such as placement, forget it as on a close); its record says the closes were another
        replica's (``closed_by_other_replica``)."""
        now = self.clock()
        if not self.registry.begin_close(session_id, reason or "idle", now):
            return
        self.registry.closed_by_other_replica(session_id)
        for cb in self.on_close:
            try:
                cb(session_id)
            except Exception:
                log.exception("on_close callback failed")
        self.registry.skip_close(session_id, now)
        self.metrics.session_close_skipped.labels("elsewhere").inc()
        self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait_until(self, predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
        """Wait until ``predicate()`` holds, re-checking each time a close call returns or a close is
        skipped. Raises asyncio.TimeoutError after ``timeout_s`` seconds."""
        async def _wait() -> None:
            while not predicate():
                await self._changed.wait()
        await asyncio.wait_for(_wait(), timeout_s)

    async def settled(self, session_id: str, timeout_s: float) -> None:
        """Wait until every engine has answered the session's current close calls (no drain, nothing
        sending); pending retries do not count. Returns after ``timeout_s`` seconds at most."""
        def done() -> bool:
            s = self.registry.get(session_id)
            return (session_id not in self._draining and
                    (s is None or not any(e.state == SENDING for e in s.engine_closes.values())))
        try:
            await self.wait_until(done, timeout_s)
        except asyncio.TimeoutError:
            pass

    def forget(self, session_id: str) -> None:
        """The client ended the session for good: drop its learned state."""
        self.policy.forget(session_id)

    def _publish(self) -> None:
        self.metrics.idle_threshold.set_function(self.policy.global_threshold)
        self.metrics.step.set_function(lambda: self.steps.step)
        # Counted at scrape time: one O(sessions) walk per scrape, not per request nor per state. The
        # series are read in label order, so the ACTIVE one walks and the other two reuse its counts.
        walked: dict[str, int] = {}

        def count(state: str) -> int:
            if state == ACTIVE or not walked:
                walked.update(self.registry.counts())
            return walked[state]

        for state in (ACTIVE, CLOSING, CLOSED):
            self.metrics.sessions.labels(state).set_function(lambda st=state: count(st))
        self.metrics.sessions_dropped.set_function(lambda: self.registry.dropped)
        for state in (SENDING, PENDING):
            self.metrics.session_close_pending.labels(state).set_function(
                lambda st=state: self.registry.close_counts()[st])

    def stats(self) -> dict[str, Any]:
        """Per engine with a close queue: close calls queued, whether its last call failed, whether the fleet
        still lists it (``gone``: the queue goes once nothing is left for it)."""
        return {u: {"queued": len(q.items), "failing": q.failing, "gone": u in self._gone}
                for u, q in self._queues.items()}
