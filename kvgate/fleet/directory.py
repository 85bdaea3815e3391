"""The engine directory: keeps the list of engine base URLs fresh and checks compatibility (I/O edge).

Engines come from the config's static list, or from the router's GET /workers (fallback
GET /list_workers), refreshed every ``discovery_interval_s``. A failed refresh keeps the last good
list, is counted (agentic_kv_discovery_failures_total) and logged once per failure streak.
Parsing and verdicts are pure (kvgate.fleet.discovery, kvgate.fleet.compat); this module only moves bytes.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from typing import Any, Callable

import aiohttp
import orjson

from kvgate.common.aio import cancel_tasks
from kvgate.fleet import compat
from kvgate.fleet.discovery import DiscoveryError, Engine, parse_list_workers, parse_workers, static_engines
from kvgate.proxy.metrics import Metrics

log = logging.getLogger("kvgate.fleet.directory")

CONTROL_TIMEOUT_S = 2.0


class EngineDirectory:
    """Current engines plus the compatibility verdicts.

    upstream: router base URL; static: configured engine URLs (empty = discover); interval_s: refresh
    period, seconds. ``on_change(engines)`` callbacks run when the set of engine URLs changes.
    """

    def __init__(self, upstream: str, static: list[str], interval_s: float, metrics: Metrics,
                 probe: bool = True, lifecycle_on: bool = False):
        self.upstream = upstream.rstrip("/")
        self.static = static_engines(static) if static else None
        self.interval_s = interval_s
        self.metrics = metrics
        self.probe_enabled = probe
        self.lifecycle_on = lifecycle_on
        self.engines: list[Engine] = list(self.static or [])
        self.source = "static" if self.static else "router"
        self.last_error: str | None = None
        self.last_success: float | None = None
        self.verdict = compat.UNKNOWN
        self.warnings: dict[str, list[tuple[str, str]]] = {}
        self.on_change: list[Callable[[list[Engine]], None]] = []
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task | None = None
        self._changed = asyncio.Event()
        self.first_refresh = asyncio.Event()
        self.refreshed = asyncio.Event()  # replaced after each refresh: await it to see the next one
        self.compat_checked = asyncio.Event()
        metrics.set_passthrough(self.verdict)

    @property
    def urls(self) -> list[str]:
        return [e.url for e in self.engines]

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=CONTROL_TIMEOUT_S))
        return self._session

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="kvgate-discovery")

    async def stop(self) -> None:
        await cancel_tasks(self._task)
        if self._session is not None:
            await self._session.close()

    async def _get_json(self, url: str) -> tuple[int, Any]:
        async with self.session.get(url) as resp:
            body = await resp.read()
            if resp.status != 200:
                return resp.status, None
            return resp.status, orjson.loads(body)

    async def refresh(self) -> list[Engine]:
        """Refresh the list once; on failure keep the last good list. Returns the current list."""
        if self.static is not None:
            self._set(self.static)
            self.last_success = time.time()
            self.metrics.discovery_last_success.set(self.last_success)
            return self.engines
        try:
            status, obj = await self._get_json(self.upstream + "/workers")
            if status == 200:
                found = parse_workers(obj)
            else:
                status2, obj2 = await self._get_json(self.upstream + "/list_workers")
                if status2 != 200:
                    raise DiscoveryError(f"/workers answered {status}, /list_workers answered {status2}")
                found = parse_list_workers(obj2)
        except (aiohttp.ClientError, asyncio.TimeoutError, orjson.JSONDecodeError, DiscoveryError, OSError) as exc:
            self.metrics.discovery_failures.inc()
            text = f"{type(exc).__name__}: {exc}"
            if self.last_error is None:
                log.warning("engine discovery from %s failed (%s); keeping the last good list of %d engines",
                            self.upstream, text, len(self.engines))
            self.last_error = text
            return self.engines
        if self.last_error is not None:
            log.info("engine discovery from %s recovered", self.upstream)
        self.last_error = None
        self.last_success = time.time()
        self.metrics.discovery_last_success.set(self.last_success)
        self._set(found)
        return self.engines

    def _set(self, engines: list[Engine]) -> None:
        changed = [e.url for e in engines] != self.urls
        self.engines = list(engines)
        by_type: dict[str, int] = {"regular": 0, "prefill": 0, "decode": 0}
        for e in engines:
            by_type[e.worker_type] = by_type.get(e.worker_type, 0) + 1
        for t, n in by_type.items():
            self.metrics.engines.labels(t).set(n)
        if changed:
            log.info("engines (%s): %s", self.source, ", ".join(self.urls) or "none")
            self._changed.set()
            for cb in self.on_change:
                try:
                    cb(self.engines)
                except Exception:  # a consumer's fault must not stop discovery
                    log.exception("engine-change callback failed")

    def _refreshed(self) -> None:
        self.refreshed.set()
        self.refreshed = asyncio.Event()

    async def _run(self) -> None:
        await self.refresh()
        self.first_refresh.set()
        self._refreshed()
        if self.probe_enabled:
            asyncio.create_task(self._compat_loop(), name="kvgate-compat")
        while True:
            await asyncio.sleep(self.interval_s)
            await self.refresh()
            self._refreshed()

    # --- compatibility ---------------------------------------------------------------------------

    async def probe_passthrough(self) -> str:
        """Send the session_id probe (kvgate.fleet.compat) through the router; return and record the verdict."""
        probe_id = "kvgate-probe-" + secrets.token_hex(8)
        try:
            async with self.session.post(self.upstream + "/generate", data=compat.probe_body(probe_id),
                                         headers={"Content-Type": "application/json"}) as resp:
                verdict = compat.classify_probe(resp.status, await resp.read())
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            verdict = compat.UNKNOWN
        self.verdict = verdict
        self.metrics.set_passthrough(verdict)
        return verdict

    async def check_engine(self, url: str) -> list[tuple[str, str]]:
        """Read one engine's /server_info (fallback /get_server_info) and /metrics status; record warnings."""
        info = None
        for path in ("/server_info", "/get_server_info"):
            try:
                status, obj = await self._get_json(url + path)
            except (aiohttp.ClientError, asyncio.TimeoutError, orjson.JSONDecodeError, OSError):
                continue
            if status == 200 and isinstance(obj, dict):
                info = obj
                break
        try:
            async with self.session.get(url + "/metrics") as resp:
                metrics_status = resp.status
                await resp.read()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            metrics_status = None
        warnings = compat.engine_warnings(info, metrics_status)
        for kind, _ in self.warnings.get(url, []):
            self.metrics.engine_warning.labels(url, kind).set(0)
        for kind, text in warnings:
            self.metrics.engine_warning.labels(url, kind).set(1)
            log.warning("engine %s: %s", url, text)
        self.warnings[url] = warnings
        return warnings

    async def check_compat(self) -> str:
        """Run the probe and every engine check once; log the verdict line. Returns the verdict."""
        verdict = await self.probe_passthrough() if self.engines or self.static is None else compat.UNKNOWN
        await asyncio.gather(*(self.check_engine(u) for u in self.urls))
        line = compat.verdict_line(verdict, self.upstream, self.lifecycle_on)
        (log.warning if verdict == compat.DROPPED else log.info)(line)
        self.compat_checked.set()
        return verdict

    async def _compat_loop(self) -> None:
        # Probe at start; while the verdict is unknown, probe again whenever engines change (bounded
        # by the discovery interval) - the router may still be registering its workers.
        checked: list[str] | None = None
        while True:
            if checked != self.urls or self.verdict == compat.UNKNOWN:
                checked = self.urls
                await self.check_compat()
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), timeout=max(self.interval_s, 1.0))
            except asyncio.TimeoutError:
                pass

    def as_json(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "upstream": self.upstream,
            # healthy is the router's verdict; a static list has none (null)
            "engines": [{"url": e.url, "worker_type": e.worker_type,
                         "healthy": e.healthy if self.static is None else None,
                         "warnings": [k for k, _ in self.warnings.get(e.url, [])]} for e in self.engines],
            "last_error": self.last_error,
            "last_success_unix": self.last_success,
            "session_id_passthrough": self.verdict,
        }
