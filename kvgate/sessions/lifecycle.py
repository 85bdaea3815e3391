"""Session lifecycle: feeds the registry and fans /close_session out to every engine (I/O edge).

Decisions (who is idle, whether a close is due) are the registry's (kvgate.sessions.registry). Here:
  - a close waits for the session's in-flight requests (bounded by ``session_close_drain_s``),
  - then POSTs /close_session {"session_id"} to every engine base URL at once, each call bounded
    by ``close_timeout_s`` and retried ``close_retries`` times on connect errors and 5xx,
  - it never blocks or fails the caller: closes run as background tasks.
The router does not proxy /close_session (router-compat.md), so kvgate calls the engines directly.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

import aiohttp

from kvgate.common.aio import cancel_tasks

from kvgate.fleet.directory import EngineDirectory
from kvgate.sessions.idle_policy import IdlePolicy, StepTracker, ends_session
from kvgate.proxy.metrics import Metrics
from kvgate.sessions.registry import ACTIVE, CLOSED, CLOSING, SessionRegistry

log = logging.getLogger("kvgate.sessions.lifecycle")


async def close_on_engine(session: aiohttp.ClientSession, url: str, session_id: str, timeout_s: float,
                          retries: int) -> str:
    """POST /close_session to one engine. Returns "ok" or a short error text; never raises.

    Retries (up to ``retries`` more attempts) on connect errors and 5xx only; a timeout is final,
    so a hung engine costs at most ``timeout_s`` per attempt that reached it.
    """
    body = {"session_id": session_id}
    error = "not attempted"
    for attempt in range(retries + 1):
        try:
            async with session.post(url + "/close_session", json=body,
                                    timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                await resp.read()
                if resp.status < 400:
                    return "ok"
                error = f"http {resp.status}"
                if resp.status < 500:
                    return error
        except asyncio.TimeoutError:
            return f"timeout after {timeout_s}s"
        except (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
            error = f"connect error: {type(exc).__name__}"
        except aiohttp.ClientError as exc:
            return f"{type(exc).__name__}"
        if attempt < retries:
            await asyncio.sleep(0.02 * (2 ** attempt))  # brief backoff between retries
    return error


class SessionLifecycle:
    """Owns the registry, runs closes and the idle sweep.

    policy: when a session counts as idle (fixed or adaptive, kvgate.sessions.idle_policy); steps: which sessions
    still have KV since the last cache flush; close_on_abort: close a session whose turn ended in an
    abort. clock: monotonic seconds (injectable for tests of the shell).
    """

    def __init__(self, registry: SessionRegistry, directory: EngineDirectory, metrics: Metrics, *,
                 drain_s: float, close_timeout_s: float, close_retries: int,
                 policy: IdlePolicy | None = None, steps: StepTracker | None = None, close_on_abort: bool = True,
                 clock: Callable[[], float] = time.monotonic):
        self.registry = registry
        self.directory = directory
        self.metrics = metrics
        self.policy = policy or IdlePolicy(fixed_s=300.0)
        self.steps = steps or StepTracker(registry.max_sessions)
        self.close_on_abort = close_on_abort
        self.drain_s = drain_s
        self.close_timeout_s = close_timeout_s
        self.close_retries = close_retries
        self.clock = clock
        self._drained: dict[str, asyncio.Event] = {}
        self._closing: dict[str, asyncio.Task] = {}
        self._session: aiohttp.ClientSession | None = None
        self._idle_task: asyncio.Task | None = None
        self._changed = asyncio.Event()
        # Called with the session id when a close begins (session placement forgets the session).
        self.on_close: list[Callable[[str], None]] = []
        self._publish()

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        return self._session

    async def start(self) -> None:
        if self.policy.mode == "adaptive" or self.policy.fixed_s > 0:
            self._idle_task = asyncio.create_task(self._idle_loop(), name="kvgate-idle-close")

    async def stop(self) -> None:
        await cancel_tasks(*self._closing.values(), self._idle_task)
        if self._session is not None:
            await self._session.close()

    # --- request hooks (called by the proxy; must never raise into it) -----------------------------

    def request_started(self, session_id: str, source: str | None) -> None:
        now = self.clock()
        self.registry.request_started(session_id, source, now)
        self.policy.on_turn_start(session_id, now)
        self.steps.on_kv(session_id)

    def request_finished(self, session_id: str, meta: dict | None, finish_type: str | None) -> None:
        now = self.clock()
        self.registry.request_finished(session_id, now, meta)
        self.policy.on_turn_end(session_id, now)
        self.steps.on_kv(session_id)
        s = self.registry.get(session_id)
        if s is not None and s.in_flight == 0:
            ev = self._drained.get(session_id)
            if ev is not None:
                ev.set()
        if self.close_on_abort and ends_session(finish_type):
            self.close(session_id, "abort")  # the agent cannot continue from an aborted turn

    def step_boundary(self, path: str, status: int | None, body: dict | None) -> bool:
        """A relayed request that may have flushed the engines' KV (weights update, flush_cache ...)."""
        return self.steps.on_boundary(path, status, body)

    # --- closing -------------------------------------------------------------------------------

    def close(self, session_id: str, reason: str) -> asyncio.Task | None:
        """Start closing ``session_id`` in the background; idempotent. Returns the close task (None
        when the session is already closed)."""
        task = self._closing.get(session_id)
        if task is not None:
            return task
        if not self.registry.begin_close(session_id, reason, self.clock()):
            return None
        for cb in self.on_close:
            try:
                cb(session_id)
            except Exception:  # a consumer's fault must not stop the close
                log.exception("on_close callback failed")
        if reason in ("idle", "abort") and not self.steps.has_kv(session_id):
            # Its KV went with a cache flush (a step boundary): nothing to free on the engines.
            self.registry.finish_close(session_id, {}, self.clock())
            self.metrics.session_close_skipped.labels("no_kv").inc()
            self._notify()
            return None
        task = asyncio.create_task(self._close(session_id, reason), name=f"kvgate-close-{session_id}")
        self._closing[session_id] = task
        task.add_done_callback(lambda _t, sid=session_id: self._closing.pop(sid, None))
        return task

    async def _close(self, session_id: str, reason: str) -> dict[str, str]:
        s = self.registry.get(session_id)
        if s is not None and s.in_flight > 0 and self.drain_s > 0:
            ev = self._drained.setdefault(session_id, asyncio.Event())
            try:
                await asyncio.wait_for(ev.wait(), timeout=self.drain_s)
            except asyncio.TimeoutError:
                log.info("session %s: closing with %d requests still in flight after %.1fs",
                         session_id, s.in_flight, self.drain_s)
            finally:
                self._drained.pop(session_id, None)
        t0 = time.perf_counter()
        urls = self.directory.urls
        results = await asyncio.gather(*(close_on_engine(self.session, u, session_id, self.close_timeout_s,
                                                         self.close_retries) for u in urls))
        self.metrics.close_latency.observe(time.perf_counter() - t0)
        by_url = dict(zip(urls, results))
        failures = sum(1 for r in results if r != "ok")
        if failures:
            self.metrics.session_close_failure.inc(failures)
            log.warning("session %s: close failed on %d of %d engines: %s", session_id, failures, len(urls),
                        {u: r for u, r in by_url.items() if r != "ok"})
        self.metrics.session_close.labels(reason).inc()
        self.registry.finish_close(session_id, by_url, self.clock())
        self._notify()
        return by_url

    async def _idle_loop(self) -> None:
        while True:
            # A sweep every quarter of the (smallest) idle threshold, at most every 5 s, bounds lateness.
            threshold = self.policy.sweep_threshold()
            await asyncio.sleep(min(max(threshold / 4, 0.05), 5.0) if threshold > 0 else 5.0)
            try:
                now = self.clock()
                for sid in self.registry.idle_sessions(now, self.policy.sweep_threshold()):
                    s = self.registry.get(sid)
                    if s is not None and self.policy.should_close(sid, now - s.last_seen):
                        self.close(sid, "idle")
            except Exception:  # never let a registry fault kill the sweep
                log.exception("idle sweep failed")
                self.metrics.faults.labels("idle_sweep").inc()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait_until(self, predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
        """Wait until ``predicate()`` holds, re-checking each time a close finishes (fanned out or skipped).
        Raises asyncio.TimeoutError after ``timeout_s`` seconds."""
        async def _wait() -> None:
            while not predicate():
                await self._changed.wait()
        await asyncio.wait_for(_wait(), timeout_s)

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
