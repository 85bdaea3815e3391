"""The engine directory: keeps the list of engine base URLs fresh and checks compatibility (I/O edge).

Engines come from the config's static list, or from the router's GET /workers (fallback
GET /list_workers), refreshed every ``discovery_interval_s``. A failed refresh keeps the last good
list, is counted (agentic_kv_discovery_failures_total) and logged once per failure streak.
The session_id probe runs per generate route at start, and again when the router comes back after a
failed refresh or lists other workers (new URLs, or new worker ids: a restarted router re-registers them).

Health (kvgate.fleet.health, /kvgate/health): the router is reachable or not from each refresh (with a
static engine list, a GET /health of the router each interval) and from every forwarded call's result
(:meth:`router_result`); an engine is usable when the router reports it healthy and kvgate's own calls
to it (closes, placed calls, KV polls) do not fail to connect (:meth:`engine_call_failed`; an engine so
marked is asked GET /health each interval, and any answer clears it). While the router is unreachable and
kvgate places calls itself, every engine is asked GET /health each interval (the router's verdicts are
stale then, and placed calls still go to the engines). Each change is one log line.
Parsing and verdicts are pure (kvgate.fleet.discovery, kvgate.fleet.compat); this module only moves bytes.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from typing import Any, Callable

import dataclasses

import aiohttp
import orjson

from kvgate.common.aio import cancel_tasks
from kvgate.fleet import compat, roles
from kvgate.fleet.placement import placement_active
from kvgate.fleet.discovery import DiscoveryError, Engine, parse_list_workers, parse_workers, static_engines
from kvgate.fleet.health import Check, Reachability, engines_check, router_check
from kvgate.common.metrics import Metrics

log = logging.getLogger("kvgate.fleet.directory")

_AUTH_WORDS = {401: "Unauthorized", 403: "Forbidden"}

CONTROL_TIMEOUT_S = 2.0
#: What a failed connection to the router or an engine raises (the peer is not there), as opposed to an
#: answer kvgate cannot read.
_UNREACHABLE = (aiohttp.ClientConnectionError, asyncio.TimeoutError, OSError)
#: Answers that mean the path does not exist on the upstream (it is no router of a kind kvgate knows).
_NO_SUCH_PATH = frozenset({404, 405})
#: Router answers to a forwarded call that mean it could not reach an engine (logged once per change).
GATEWAY_ERRORS = frozenset({502, 503, 504})


class EngineDirectory:
    """Current engines plus the compatibility verdicts.

    upstream: router base URL; static: configured engine URLs (empty = discover); interval_s: refresh
    period, seconds. ``on_change(engines)`` callbacks run when the engine URLs or their health change.
    """

    def __init__(self, upstream: str, static: list[str], interval_s: float, metrics: Metrics,
                 probe: bool = True, lifecycle_on: bool = False,
                 placement_modes: dict[str, str] | None = None, admission_on: bool = False,
                 router_key: str | None = None, engine_key: str | None = None):
        self.upstream = upstream.rstrip("/")
        self.static = static_engines(static) if static else None
        self.interval_s = interval_s
        self.metrics = metrics
        self.probe_enabled = probe
        self.lifecycle_on = lifecycle_on
        self.admission_on = admission_on
        # The Authorization headers of kvgate's own calls to the router and to the engines (the keys are
        # never logged): the router's on discovery, /v1/models and the probe; the engines' on their checks,
        # KV polls and closes (every aiohttp session that calls engines takes engine_headers).
        self.router_headers = {"Authorization": f"Bearer {router_key}"} if router_key else {}
        self.engine_headers = {"Authorization": f"Bearer {engine_key}"} if engine_key else {}
        self.has_router_key = bool(router_key)
        # The router's answer to kvgate's credentials: None (not asked yet), "ok", or "401"/"403" (refused).
        self.router_auth: str | None = None
        self.engines: list[Engine] = list(self.static or [])
        self.source = "static" if self.static else "router"
        self.last_error: str | None = None
        self.last_success: float | None = None
        self.verdicts: dict[str, str] = {r: compat.UNKNOWN for r in compat.PROBE_ROUTES}
        self.placement_modes = dict(placement_modes or {})
        self.model_id: str | None = None  # a served model name, for the OpenAI-route probes
        self.probes = 0  # probe rounds run
        self._worker_ids: frozenset = frozenset()
        self._reprobe = False
        self.warnings: dict[str, list[tuple[str, str]]] = {}
        self.on_change: list[Callable[[list[Engine]], None]] = []
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task | None = None
        self._compat_task: asyncio.Task | None = None
        self._changed = asyncio.Event()
        self.first_refresh = asyncio.Event()
        self.refreshed = asyncio.Event()  # replaced after each refresh: await it to see the next one
        self.compat_checked = asyncio.Event()
        self.probed = asyncio.Event()  # replaced after each probe round: await it to see the next one
        for r in compat.PROBE_ROUTES:
            metrics.set_passthrough(r, compat.UNKNOWN)
        self.router = Reachability()  # does the router answer (discovery, forwarded calls)
        self.router_gateway_error: int | None = None  # the 502/503/504 the router answers forwarded calls with
        self.own_failures: dict[str, str] = {}  # engine URL -> why kvgate's own calls to it fail to connect
        self.placed_answers = 0  # placed calls an engine answered (straight from kvgate, not via the router)
        self._placed_answers_at_down = 0  # placed_answers when the router last became unreachable
        self._verdict_line: str | None = None  # the last compatibility line logged
        self._layout_line: str | None = None  # the last layout line logged
        # What the upstream is when it lists no engines (answers neither /workers nor /list_workers): "engine"
        # (it answers an SGLang engine's /server_info or /get_model_info), "other", or None (not asked: the
        # router lists its engines, or has not been asked yet). Asked once per discovery failure streak.
        self.upstream_kind: str | None = None

    @property
    def verdict(self) -> str:
        """The /generate verdict (the route RL rollouts use)."""
        return self.verdicts["/generate"]

    def placed(self, route: str) -> bool:
        """Whether kvgate places ``route``'s session traffic now (mode and the route's probe verdict)."""
        return placement_active(self.placement_modes.get(route, "router"), self.lifecycle_on or self.admission_on)

    def placement_why(self, route: str) -> str:
        """Why ``route``'s session traffic goes where placed() says, in a few words (startup log, health)."""
        mode = self.placement_modes.get(route, "router")
        if mode != "auto":
            return f"session_placement {mode}"
        if self.placed(route):
            return "auto: " + " and ".join(n for n, on in (("session lifecycle", self.lifecycle_on),
                                                            ("admission", self.admission_on)) if on) + " on"
        return "auto: session lifecycle and admission off"

    @property
    def urls(self) -> list[str]:
        return [e.url for e in self.engines]

    @property
    def layout(self) -> roles.Layout:
        """The fleet's layout now (kvgate.fleet.roles): regular, PD (prefill + decode workers), mixed, empty."""
        return roles.layout(self.engines)

    @property
    def kv_holder_urls(self) -> list[str]:
        """Engines whose KV pools hold sessions between turns: decode workers in a PD fleet, regular engines
        otherwise (kvgate.fleet.roles.kv_holders)."""
        return [e.url for e in roles.kv_holders(self.engines)]

    @property
    def prefill_urls(self) -> list[str]:
        """The prefill workers of a PD fleet (kvgate.fleet.roles.prefill_only); empty otherwise."""
        return [e.url for e in roles.prefill_only(self.engines)]

    @property
    def close_urls(self) -> list[str]:
        """Where a session's close goes: every engine of every role (kvgate.fleet.roles.close_targets)."""
        return roles.close_targets(self.engines)

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=CONTROL_TIMEOUT_S))
        return self._session

    async def start(self) -> None:
        """Start discovery; returns after the first refresh (at most CONTROL_TIMEOUT_S for each call it
        makes), so /kvgate/health has an answer as soon as kvgate listens."""
        self._task = asyncio.create_task(self._run(), name="kvgate-discovery")
        try:
            async with asyncio.timeout(2 * CONTROL_TIMEOUT_S + 0.5):  # not wait_for: see kvgate.common.aio
                await self.first_refresh.wait()
        except TimeoutError:
            pass

    async def stop(self) -> None:
        # The probe loop too: left running, it would use the closed session (and log an unretrieved error).
        await cancel_tasks(self._task, self._compat_task)
        if self._session is not None:
            await self._session.close()

    async def _get_json(self, url: str, headers: dict[str, str] | None = None) -> tuple[int, Any]:
        async with self.session.get(url, headers=headers) as resp:
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
            await self._ping_router()
            return self.engines
        try:
            status, obj = await self._get_json(self.upstream + "/workers", self.router_headers)
            self._note_auth(status, "GET /workers")
            if status in (401, 403):
                raise DiscoveryError(f"/workers answered {status} ({_AUTH_WORDS[status]}): {self._key_hint()}")
            if status == 200:
                found = parse_workers(obj)
                self._note_workers(obj)
            else:
                status2, obj2 = await self._get_json(self.upstream + "/list_workers", self.router_headers)
                if status2 != 200:
                    if self.upstream_kind is None and status in _NO_SUCH_PATH and status2 in _NO_SUCH_PATH:
                        # neither path exists there (a router that is starting or failing answers 5xx instead)
                        self.upstream_kind = await self._ask_upstream_kind(status, status2)
                    raise DiscoveryError(f"/workers answered {status}, /list_workers answered {status2}")
                found = parse_list_workers(obj2)
        except (aiohttp.ClientError, asyncio.TimeoutError, orjson.JSONDecodeError, DiscoveryError, OSError) as exc:
            self.metrics.discovery_failures.inc()
            text = f"{type(exc).__name__}: {exc}"
            unreachable = isinstance(exc, _UNREACHABLE)
            self.router_result(not unreachable, text if unreachable else None)
            if self.last_error is None and self.router_auth not in ("401", "403"):  # a refusal has its own line
                log.warning("engine discovery from %s failed (%s); keeping the last good list of %d engines",
                            self.upstream, text, len(self.engines))
            self.last_error = text
            return self.engines
        self.router_result(True)
        self.upstream_kind = None
        if self.last_error is not None:
            log.info("engine discovery from %s recovered", self.upstream)
            self._reprobe = True  # the router may have restarted: probe again
            self._changed.set()
        self.last_error = None
        self.last_success = time.time()
        self.metrics.discovery_last_success.set(self.last_success)
        self._set(found)
        return self.engines

    async def _ask_upstream_kind(self, workers: int, list_workers: int) -> str:
        """The upstream lists no engines (/workers and /list_workers answered ``workers``, ``list_workers``):
        "engine" when it answers an SGLang engine's GET /server_info or /get_model_info (then one line says to
        list it under ``engines:``), else "other" (one line says it is not a router). Either way it answered,
        so a connection error here is "other" too."""
        kind = "other"
        for path in ("/server_info", "/get_model_info"):
            try:
                status, _ = await self._get_json(self.upstream + path, self.router_headers)
            except (aiohttp.ClientError, asyncio.TimeoutError, orjson.JSONDecodeError, OSError):
                continue
            if status == 200:
                kind = "engine"
                break
        if kind == "engine":
            log.warning("engine discovery: upstream %s is an SGLang engine, not a router (it answers %s but not "
                        "/workers): list the engines in the config's engines: (--engines %s) and kvgate sends to "
                        "them without a router, or start the router in front of them", self.upstream, path,
                        self.upstream)
        else:
            log.error("engine discovery: upstream %s is not an SGLang router: /workers answered %d, /list_workers "
                      "%d, and it does not answer an engine's /server_info (is it the router's Prometheus port?)",
                      self.upstream, workers, list_workers)
        return kind

    def _note_auth(self, status: int, what: str) -> None:
        """Record the router's answer to kvgate's credentials; a refusal is said in one line (once per change)."""
        verdict = str(status) if status in (401, 403) else "ok"
        if verdict != self.router_auth and verdict != "ok":
            log.error("router %s answered %s %s to %s: %s", self.upstream, status, _AUTH_WORDS[status], what,
                      self._key_hint())
        elif verdict == "ok" and self.router_auth in ("401", "403"):
            log.info("router %s accepts kvgate's credentials again", self.upstream)
        self.router_auth = verdict

    def _key_hint(self) -> str:
        if self.has_router_key:
            return "it refused kvgate's API key; check router_api_key_file / router_api_key_env"
        return "the router needs an API key; give kvgate it with router_api_key_file or router_api_key_env"

    async def _ping_router(self) -> None:
        # A static engine list never asks the router for it: its liveness is asked on its own.
        try:
            async with self.session.get(self.upstream + "/health", headers=self.router_headers) as resp:
                await resp.read()
            self.router_result(True)
        except _UNREACHABLE as exc:
            self.router_result(False, f"{type(exc).__name__}: {exc}")
        except aiohttp.ClientError:  # an answer kvgate cannot read is still an answer
            self.router_result(True)

    # --- health ----------------------------------------------------------------------------------

    @property
    def placed_routes(self) -> list[str]:
        """The routes on which kvgate places a session's calls on the engines itself now (they reach no router)."""
        return [r for r in self.placement_modes if self.placed(r)]

    def router_result(self, ok: bool, reason: str | None = None) -> None:
        """One call to the router answered (``ok``) or could not connect (``reason``); logs a change."""
        change = self.router.note(ok, reason, time.monotonic())
        if change == "down":
            self._placed_answers_at_down = self.placed_answers
            routes = self.placed_routes
            if routes:
                log.warning("router %s unreachable (%s): a session's calls on %s still go straight to the engines "
                            "kvgate places them on, every other call gets kvgate's 502; /kvgate/health says "
                            "degraded until it answers again (down if no engine is usable)", self.upstream, reason,
                            ", ".join(routes))
            else:
                log.warning("router %s unreachable (%s): forwarded calls get kvgate's 502 and /kvgate/health says "
                            "down until it answers again", self.upstream, reason)
        elif change == "up":
            log.info("router %s answers again", self.upstream)

    def router_answered(self, status: int) -> None:
        """The router answered a forwarded call with ``status``: a 502/503/504 (it could not reach an engine)
        is logged when the router starts answering it and when it stops, never per request. Cheap: called
        on every forwarded call."""
        if self.router.ok is not True:
            self.router_result(True)
        if status in GATEWAY_ERRORS:
            if self.router_gateway_error is None:
                self.router_gateway_error = status
                log.warning("router %s answers %d to forwarded calls (it cannot reach an engine); said again "
                            "when it answers otherwise", self.upstream, status)
        elif self.router_gateway_error is not None:
            log.info("router %s answers %d again (after %d)", self.upstream, status, self.router_gateway_error)
            self.router_gateway_error = None

    def engine_call_failed(self, url: str, reason: str) -> None:
        """kvgate's own call to engine ``url`` could not connect: the engine is unusable (placement moves its
        sessions, /kvgate/engines and /kvgate/health say why) until it answers again. Logged once."""
        if url in self.own_failures or url not in self.urls:
            return
        self.own_failures[url] = reason
        log.warning("engine %s: kvgate's own calls to it fail (%s); marked unhealthy until it answers again",
                    url, reason)
        self._notify_change()

    def engine_answered(self, url: str, placed: bool = False) -> None:
        """kvgate's own call to engine ``url`` got an answer (``placed``: a placed call, counted): it is usable
        again if it was marked."""
        if placed:
            self.placed_answers += 1
        if self.own_failures.pop(url, None) is not None:
            log.info("engine %s answers kvgate's calls again", url)
            self._notify_change()

    def usable(self, e: Engine) -> bool:
        """Healthy by the router's checks and by kvgate's own calls."""
        return e.healthy and e.url not in self.own_failures

    def effective(self) -> list[Engine]:
        """The engines with ``healthy`` as :meth:`usable` says (what on_change callbacks get)."""
        if not self.own_failures:
            return self.engines
        return [e if self.usable(e) else dataclasses.replace(e, healthy=False) for e in self.engines]

    def checks(self) -> list[Check]:
        """The router and engines checks of /kvgate/health (kvgate.fleet.health)."""
        def why(e: Engine) -> str | None:
            if e.url in self.own_failures:
                return f"(kvgate's calls fail: {self.own_failures[e.url]})"
            return None if e.healthy else "(the router reports it unhealthy)"
        engines = [(e.url, self.usable(e), why(e)) for e in self.engines]
        if self.first_refresh.is_set():
            engines_ = engines_check(engines, self.static is None,
                                     self.last_error if self.router.ok is not False else None, self.upstream_kind,
                                     roles={e.url: roles.role(e) for e in self.engines},
                                     router_reached=self.router.ok is not False)
        else:
            engines_ = Check("engines", None, "not listed yet")
        # the engines a placed call can go to straight: regular ones (a PD call, its decode worker named or
        # not, goes through the router)
        usable = sum(1 for e in self.engines if e.worker_type == "regular" and self.usable(e))
        return [router_check(self.router, self.upstream, time.monotonic(), self.placed_routes, usable,
                             self.placed_answers - self._placed_answers_at_down), engines_]

    async def _recheck_failed(self) -> None:
        # Engines kvgate's own calls failed on: any answer to GET /health makes them usable again.
        for url in list(self.own_failures):
            if await self._answers(url):
                self.engine_answered(url)

    async def _answers(self, url: str) -> bool:
        """Whether engine ``url`` answers GET /health (any answer counts); False when it cannot be reached."""
        try:
            async with self.session.get(url + "/health", headers=self.engine_headers) as resp:
                await resp.read()
        except _UNREACHABLE:
            return False
        except aiohttp.ClientError:
            pass
        return True

    async def _check_engines(self) -> None:
        """The router is unreachable and kvgate places calls: each engine not marked yet is asked GET /health
        (at once); one that cannot be reached is marked as kvgate's own failing calls mark it."""
        urls = [u for u in self.urls if u not in self.own_failures]
        for url, ok in zip(urls, await asyncio.gather(*(self._answers(u) for u in urls))):
            if not ok:
                self.engine_call_failed(url, "GET /health: connect error while the router is unreachable")

    def _notify_change(self) -> None:
        for cb in self.on_change:
            try:
                cb(self.effective())
            except Exception:  # a consumer's fault must not stop discovery
                log.exception("engine-change callback failed")

    def _set(self, engines: list[Engine]) -> None:
        changed = [e.url for e in engines] != self.urls
        if changed:
            self._reprobe = True
        health_changed = [e.healthy for e in engines] != [e.healthy for e in self.engines]
        if health_changed:  # a router's verdict changing is worth a line: admission's room changes with it
            before = {e.url: e.healthy for e in self.engines}
            for e in engines:
                if e.url in before and before[e.url] != e.healthy:
                    if e.healthy:
                        log.info("engine %s: the router reports it healthy again", e.url)
                    else:
                        log.warning("engine %s: the router reports it unhealthy", e.url)
        self.engines = list(engines)
        by_type: dict[str, int] = {"regular": 0, "prefill": 0, "decode": 0}
        for e in engines:
            by_type[e.worker_type] = by_type.get(e.worker_type, 0) + 1
        for t, n in by_type.items():
            self.metrics.engines.labels(t).set(n)
        line = self.layout.describe()
        if line != self._layout_line and engines:
            log.info("fleet layout: %s", line)
            self._layout_line = line
        if changed:
            log.info("engines (%s): %s", self.source, ", ".join(self.urls) or "none")
            self._changed.set()
            for url in [u for u in self.own_failures if u not in self.urls]:
                del self.own_failures[url]  # it left the fleet
        if changed or health_changed:
            self._notify_change()

    def _refreshed(self) -> None:
        self.refreshed.set()
        self.refreshed = asyncio.Event()

    async def _run(self) -> None:
        await self.refresh()
        self.first_refresh.set()
        self._refreshed()
        if self.probe_enabled:
            self._compat_task = asyncio.create_task(self._compat_loop(), name="kvgate-compat")
        while True:
            await asyncio.sleep(self.interval_s)
            await self.refresh()
            if self.own_failures:
                await self._recheck_failed()
            if self.router.ok is False and self.placed_routes:
                await self._check_engines()
            self._refreshed()

    # --- compatibility ---------------------------------------------------------------------------

    def _note_workers(self, obj: dict) -> None:
        ids = frozenset(w.get("id") for w in obj.get("workers", []) if isinstance(w, dict) and w.get("id"))
        if ids and self._worker_ids and ids != self._worker_ids:
            self._reprobe = True  # same URLs, new registrations: the router restarted
            self._changed.set()
        if ids:
            self._worker_ids = ids
        for w in obj.get("workers", []):
            if isinstance(w, dict) and isinstance(w.get("model_id"), str) and w["model_id"]:
                self.model_id = w["model_id"]
                break

    async def probe_passthrough(self, route: str = "/generate") -> str:
        """Send the session_id probe (kvgate.fleet.compat) for ``route`` through the router; record the verdict
        (an ``unknown`` answer does not replace a known one) and return the route's verdict."""
        probe_id = "kvgate-probe-" + secrets.token_hex(8)
        try:
            async with self.session.post(self.upstream + route, data=compat.probe_body(probe_id, route, self.model_id),
                                         headers={"Content-Type": "application/json", **self.router_headers}) as resp:
                verdict = compat.classify_probe(resp.status, await resp.read())
                self._note_auth(resp.status, f"the session_id probe on {route}")
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            verdict = compat.UNKNOWN
        if verdict != compat.UNKNOWN or self.verdicts[route] == compat.UNKNOWN:
            # A known verdict is kept through a probe nothing answered (a router restarting).
            self.verdicts[route] = verdict
            self.metrics.set_passthrough(route, verdict)
        return self.verdicts[route]

    async def _model_from_router(self) -> None:
        if self.model_id is not None:
            return
        try:
            status, obj = await self._get_json(self.upstream + "/v1/models", self.router_headers)
        except (aiohttp.ClientError, asyncio.TimeoutError, orjson.JSONDecodeError, OSError):
            return
        data = obj.get("data") if status == 200 and isinstance(obj, dict) else None
        if isinstance(data, list) and data and isinstance(data[0], dict) and isinstance(data[0].get("id"), str):
            self.model_id = data[0]["id"]

    async def check_engine(self, url: str) -> list[tuple[str, str]]:
        """Read one engine's /server_info (fallback /get_server_info) and /metrics status; record warnings."""
        info = None
        for path in ("/server_info", "/get_server_info"):
            try:
                status, obj = await self._get_json(url + path, self.engine_headers)
            except (aiohttp.ClientError, asyncio.TimeoutError, orjson.JSONDecodeError, OSError):
                continue
            if status == 200 and isinstance(obj, dict):
                info = obj
                break
        try:
            async with self.session.get(url + "/metrics", headers=self.engine_headers) as resp:
                metrics_status = resp.status
                await resp.read()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            metrics_status = None
        warnings = compat.engine_warnings(info, metrics_status)
        before = self.warnings.get(url, [])
        for kind, _ in before:
            self.metrics.engine_warning.labels(url, kind).set(0)
        for kind, text in warnings:
            self.metrics.engine_warning.labels(url, kind).set(1)
            if (kind, text) not in before:  # said once, not on every probe round
                log.warning("engine %s: %s", url, text)
        self.warnings[url] = warnings
        return warnings

    async def check_compat(self) -> dict[str, str]:
        """Run the probe on every generate route and every engine check once; log the verdict line.
        Returns route -> verdict."""
        self._reprobe = False
        if self.engines or self.static is None:
            await self._model_from_router()
            for route in compat.PROBE_ROUTES:
                await self.probe_passthrough(route)
        await asyncio.gather(*(self.check_engine(u) for u in self.urls))
        placed = {r: self.placed(r) for r in compat.PROBE_ROUTES}
        line = compat.verdict_line(self.verdicts, self.upstream, self.lifecycle_on, placed)
        dropped = [r for r, v in self.verdicts.items() if v == compat.DROPPED and not placed[r]]
        if line != self._verdict_line:  # a probe repeated while the router is down says nothing new
            (log.warning if dropped and self.lifecycle_on else log.info)(line)
            self._verdict_line = line
        self.probes += 1
        self.compat_checked.set()
        self._probed()
        return dict(self.verdicts)

    def _probed(self) -> None:
        self.probed.set()
        self.probed = asyncio.Event()

    async def _compat_loop(self) -> None:
        # Probe at start; again when the worker set changes or the router restarted, and while any verdict
        # is unknown (bounded by the discovery interval): the router may still be registering its workers.
        self._reprobe = True
        while True:
            if self._reprobe or compat.UNKNOWN in self.verdicts.values():
                await self.check_compat()
            self._changed.clear()
            try:
                async with asyncio.timeout(max(self.interval_s, 1.0)):  # not wait_for: see kvgate.common.aio
                    await self._changed.wait()
            except TimeoutError:
                pass

    def as_json(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "upstream": self.upstream,
            # healthy is the router's verdict; a static list has none (null)
            # healthy: usable by the router's verdict (a static list has none) and by kvgate's own calls
            "layout": self.layout.as_json(),
            "engines": [{"url": e.url, "worker_type": e.worker_type, "dp_ranks": e.dp_ranks,
                         "bootstrap_port": e.bootstrap_port, "holds_sessions": roles.role(e) != roles.PREFILL,
                         "healthy": None if self.static is not None and e.url not in self.own_failures
                         else self.usable(e),
                         "router_healthy": e.healthy if self.static is None else None,
                         "kvgate_calls_failing": self.own_failures.get(e.url),
                         "warnings": [k for k, _ in self.warnings.get(e.url, [])]} for e in self.engines],
            "last_error": self.last_error,
            "last_success_unix": self.last_success,
            "session_id_passthrough": self.verdict,
            "session_id_passthrough_by_route": dict(self.verdicts),
            "session_placement": {r: ("kvgate" if self.placed(r) else "router") for r in compat.PROBE_ROUTES},
            "router_auth": self.router_auth,
        }
