"""kvgate's own endpoints, the one table they are routed by, and the admin key that guards them (I/O edge).

The endpoints: GET /metrics and GET /kvgate/health (open: probes and Prometheus), GET /kvgate/engines,
GET /kvgate/stats, GET /kvgate/sessions, GET /kvgate/sessions/{id}, POST /kvgate/sessions/{id}/close,
GET|POST /close_session and vLLM router's POST /finish_session (these answer 403 without X-Kvgate-Admin-Key when
an admin key is set; the last two whether session lifecycle is on or off: the router answers neither, and kvgate
knows the engines to send the close to); GET /kvgate/worker/metrics and /kvgate/worker/health when the process
is one of several on a port (its siblings read them); kvgate's own 404 or 405 for any other path or method under /kvgate/. :meth:`Admin.routes`
is the one route table: kvgate's HTTP server looks requests up in it (:meth:`Admin.lookup`) and the aiohttp app
is built from it (kvgate.proxy.app). Every answer reads the gateway's parts (kvgate.proxy.app.Gateway); none
changes the request path.
"""

from __future__ import annotations

import hmac
import logging
import os
import re
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Callable
from urllib.parse import unquote

import orjson
from aiohttp import web
from multidict import CIMultiDict

from kvgate import __version__
from kvgate.config import PLACEMENT_ROUTES
from kvgate.config_credentials import redis_url_shown
from kvgate.fleet import health
from kvgate.proxy.relay import header_safe
from kvgate.proxy.server import SMALL_BODY_BYTES, Headers

if TYPE_CHECKING:
    from kvgate.proxy.app import Gateway

log = logging.getLogger("kvgate")

# With an admin key set (admin_key_file, or KVGATE_ADMIN_KEY), the request header that must carry it for
# kvgate's endpoints that list or change state, the close API, and the admission headers below. It never
# goes upstream (kvgate.proxy.relay drops it).
ADMIN_HEADER = "X-Kvgate-Admin-Key"
# The headers that let a request skip admission's queue: honoured only from a client with the admin key.
_PRIVILEGED_HEADERS = ("X-Kvgate-Protected", "X-Kvgate-Scope")
# /kvgate/sessions/{sid} and /kvgate/sessions/{sid}/close on kvgate's own server (aiohttp's {sid} pattern).
_SESSION_ROUTE = re.compile(r"/kvgate/sessions/([^{}/]+)(/close)?")
SESSION_PATHS = ("/kvgate/sessions/{sid}", "/kvgate/sessions/{sid}/close")
# GET /kvgate/sessions lists at most this many sessions per page (?limit, ?offset page through the rest):
# building the page runs on the event loop every client shares.
SESSIONS_PAGE_MAX = 1000

Handler = Callable[[Any], Any]


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(obj), content_type="application/json")


def error(status: int, kind: str, message: str, headers: dict[str, str] | None = None) -> web.Response:
    """kvgate's answer to a request to one of its own endpoints it cannot act on (400, 403, 404, 405): one JSON
    shape, ``{"error": {"message", "type": kind, "code": status}}`` (SGLang's error object, nested as
    OpenAI's), whichever endpoint refuses and why."""
    return web.Response(status=status, content_type="application/json", headers=headers,
                        body=orjson.dumps({"error": {"message": message, "type": kind, "code": status}}))


def bad_request(message: str) -> web.Response:
    """kvgate's 400 for a request to one of its own endpoints it cannot act on (``type: invalid_request``)."""
    return error(400, "invalid_request", message)


def _unquote(s: str) -> str:
    """A percent-decoded path segment, as aiohttp decodes match_info."""
    return unquote(s, errors="surrogateescape") if "%" in s else s


class Admin:
    """kvgate's own endpoints for gateway ``gw``; ``admin_key``: the key that guards them, or None (open)."""

    def __init__(self, gw: "Gateway", admin_key: str | None):
        self.gw = gw
        self._admin_key_bytes = admin_key.encode("utf-8") if admin_key is not None else None
        # X-Kvgate-Session-Id value -> session id, for the ids that header cannot carry as they are
        # (kvgate.proxy.relay.header_safe hashes them): /kvgate/sessions/<value> finds the session.
        self._told_ids: OrderedDict[str, str] = OrderedDict()
        table = self.routes()
        self._exact = {p: m for p, m in table.items() if p not in SESSION_PATHS}
        self._session_handlers = (table[SESSION_PATHS[0]]["GET"], table[SESSION_PATHS[1]]["POST"])

    def routes(self) -> dict[str, dict[str, Handler]]:
        """The route table: path (aiohttp's ``{sid}`` pattern for the two session routes) -> method -> handler,
        each guarded by the admin key where it must be. GET routes answer HEAD too (as aiohttp's add_get)."""
        def get(handler):
            return {"GET": handler, "HEAD": handler}
        guard = self.guard
        table = {"/metrics": get(self.handle_metrics), "/kvgate/health": get(self.handle_health),
                 "/kvgate/engines": get(guard(self.handle_engines)), "/kvgate/stats": get(guard(self.handle_stats)),
                 "/kvgate/sessions": get(guard(self.handle_sessions)),
                 SESSION_PATHS[0]: get(guard(self.handle_session)),
                 SESSION_PATHS[1]: {"POST": guard(self.handle_session_close)}}
        if self.gw.process_role is not None:  # this process's own figures, which its siblings merge
            table["/kvgate/worker/metrics"] = get(self.handle_worker_metrics)
            table["/kvgate/worker/health"] = get(self.handle_worker_health)
        # Whatever session lifecycle is: the router answers neither (smg 1.13: 404), and a session the client
        # named holds references on the engines' radix KV until its close reaches them.
        close = guard(self.handle_close_session)
        table["/close_session"] = {"GET": close, "POST": close}
        table["/finish_session"] = {"POST": guard(self.handle_finish_session)}  # vLLM router's
        return table

    def body_limit(self, request) -> int:
        """A request's body limit on kvgate's own server, bytes: SMALL_BODY_BYTES for the routes kvgate answers
        itself from a few bytes (/close_session, /kvgate/...), max_body_bytes for the rest."""
        path = request.path
        if path in self._exact or path.startswith("/kvgate/"):
            return SMALL_BODY_BYTES
        return self.gw._max_body

    def lookup(self, request) -> Handler | None:
        """The handler for ``request`` on kvgate's own server: an exact path, then the /kvgate/sessions/{sid}
        routes (match_info set), then kvgate's own 404/405 for the rest of /kvgate/; None: not kvgate's (the
        request goes to the router)."""
        path = request.path
        methods = self._exact.get(path)
        if methods is not None:
            handler = methods.get(request.method)
            if handler is not None:
                return handler
        elif path.startswith("/kvgate/sessions/"):
            m = _SESSION_ROUTE.fullmatch(request.raw_path.partition("?")[0])
            if m is not None:
                close = m.group(2) is not None
                if (request.method == "POST") if close else (request.method in ("GET", "HEAD")):
                    request.match_info = {"sid": _unquote(m.group(1))}
                    return self._session_handlers[1 if close else 0]
        if path.startswith("/kvgate/"):
            return self.handle_not_found
        return None

    # --- the admin key ----------------------------------------------------------------------------

    def is_admin(self, headers) -> bool:
        """Whether a request may use what the admin key guards: always when no key is set, else when its
        X-Kvgate-Admin-Key header is the key (compared in constant time)."""
        if self._admin_key_bytes is None:
            return True
        sent = headers.get(ADMIN_HEADER)
        return sent is not None and hmac.compare_digest(sent.encode("utf-8", "surrogateescape"),
                                                        self._admin_key_bytes)

    def guard(self, handler):
        """``handler`` as it is without an admin key; with one, answering 403 to a request without it."""
        if self._admin_key_bytes is None:
            return handler

        async def guarded(request):
            if not self.is_admin(request.headers):
                return error(403, "forbidden", f"kvgate: this endpoint needs the admin key (header {ADMIN_HEADER})")
            return await handler(request)
        guarded.__name__ = handler.__name__
        return guarded

    def admission_headers(self, headers):
        """The headers admission reads: without X-Kvgate-Protected and X-Kvgate-Scope when an admin key is
        set and the request does not carry it (they are then ignored, and the request waits as others do)."""
        if self._admin_key_bytes is None or not any(h in headers for h in _PRIVILEGED_HEADERS) \
                or self.is_admin(headers):
            return headers
        if isinstance(headers, Headers):
            return headers.without(_PRIVILEGED_HEADERS)
        drop = {h.lower() for h in _PRIVILEGED_HEADERS}  # aiohttp's server: a multidict
        return CIMultiDict((k, v) for k, v in headers.items() if k.lower() not in drop)

    def _sid_refused(self, sid: str) -> web.Response | None:
        if self.gw.sid_too_long(sid):
            return bad_request(f"session_id is over max_session_id_bytes ({self.gw._max_sid} bytes)")
        return None

    # --- the endpoints ---------------------------------------------------------------------------

    async def handle_metrics(self, request: web.Request) -> web.Response:
        body, ctype = self.gw.metrics.render()
        if self.gw.process_role is not None:  # the whole process set, whichever process the kernel picked
            try:
                body = await self.gw.process_role.merged_metrics(body)
            except Exception:  # a sibling's unparsable answer: this process's own figures, said in the log
                log.exception("merging the processes' metrics failed; answering this process's own")
        return web.Response(body=body, headers={"Content-Type": ctype})

    async def handle_worker_metrics(self, request: web.Request) -> web.Response:
        body, ctype = self.gw.metrics.render()
        return web.Response(body=body, headers={"Content-Type": ctype})

    async def handle_worker_health(self, request: web.Request) -> web.Response:
        return _json({"status": "ok", "worker": self.gw.process_role.index, "pid": os.getpid()})

    def health_checks(self) -> list[health.Check]:
        """The checks /kvgate/health adds up (kvgate.fleet.health): the router, the engines, and with
        ``state_backend: redis`` the Redis the replicas share (not fatal: unreachable, each replica decides on
        its own state). Append a check here for anything else kvgate cannot serve without."""
        checks = self.gw.directory.checks()
        shared = self.gw.shared
        if shared is not None:
            up = bool(shared.up)
            checks.append(health.Check(
                "state_backend", up, "Redis answers" if up else
                f"Redis at {redis_url_shown(self.gw.cfg.redis_url)} is unreachable: each replica decides on its own "
                f"state until it is back (sessions may be closed or placed twice)", fatal=False))
        return checks

    async def handle_health(self, request: web.Request) -> web.Response:
        """kvgate and what it depends on: ``status`` ok | degraded (HTTP 200) or starting | down (HTTP 503),
        ``reasons`` (every check not ok), ``checks`` (each with its reason), and the features in force."""
        workers = await self.gw.process_role.health() if self.gw.process_role is not None else None
        checks = self.health_checks()
        status, code, reasons = health.summarize(checks)
        placers = {r: self._placer(r) for r in PLACEMENT_ROUTES}
        return _json({"status": status, "reasons": reasons, "checks": [c.as_json() for c in checks],
                      **({"workers": workers} if workers is not None else {}),
                      "version": __version__, "uptime_s": round(time.time() - self.gw.started, 3),
                      "upstream": self.gw.cfg.upstream, "engines": len(self.gw.directory.engines),
                      "session_lifecycle": self.gw.lifecycle_on,
                      "program_admission": self.gw.cfg.agentic_program_admission,
                      "session_id_passthrough": self.gw.directory.verdict,
                      "session_id_passthrough_by_route": dict(self.gw.directory.verdicts),
                      "session_placement": {r: placers[r][0] for r in PLACEMENT_ROUTES},
                      "session_placement_why": {r: placers[r][1] for r in PLACEMENT_ROUTES},
                      "placement_modes": dict(self.gw.placement_modes),
                      # the router's answer to kvgate's credentials: null (not asked yet), ok, 401 or 403
                      "router_auth": self.gw.directory.router_auth}, code)

    def _placer(self, route: str) -> tuple[str, str]:
        """Who places ``route``'s session calls now (kvgate | router) and why, in a few words. In a
        prefill/decode fleet kvgate places them only while it can name the decode worker to smg."""
        directory, naming = self.gw.directory, self.gw.placed.naming
        why = directory.placement_why(route)
        if not directory.placed(route) or not directory.layout.pd:
            return ("kvgate" if directory.placed(route) else "router"), why
        if naming is None:
            return "router", why + "; prefill/decode fleet: placement_pd_decode is off, smg picks the decode worker"
        if not naming.supported:
            return "router", why + "; prefill/decode fleet: decode workers with DP ranks, smg picks the decode worker"
        if naming.state == "off":
            return "router", why + ("; prefill/decode fleet: smg did not honour kvgate's X-SMG-Target-Worker, it "
                                    "picks the decode worker (tried again later)")
        return "kvgate", why + "; prefill/decode fleet: kvgate names the decode worker to smg (X-SMG-Target-Worker)"

    async def handle_not_found(self, request: web.Request) -> web.Response:
        """A /kvgate/ path or method kvgate does not serve: its own 404 or 405 (with Allow), never the
        router's."""
        path = request.path
        methods = self._exact.get(path)
        m = _SESSION_ROUTE.fullmatch(request.raw_path.partition("?")[0])
        allowed = (sorted(methods) if methods is not None else
                   (["POST"] if m.group(2) else ["GET", "HEAD"]) if m is not None else None)
        if allowed is not None:
            return error(405, "method_not_allowed",
                         f"{request.method} is not allowed on {path}; allowed: {', '.join(allowed)}",
                         headers={"Allow": ", ".join(allowed)})
        own = sorted(p for p in self._exact if p.startswith("/kvgate/"))
        return error(404, "not_found", f"kvgate has no endpoint {path}; its endpoints: "
                                       f"{', '.join([*own, '/kvgate/sessions/{id}', '/kvgate/sessions/{id}/close'])}")

    async def handle_engines(self, request: web.Request) -> web.Response:
        out = self.gw.directory.as_json()
        per_engine = self.gw.placement.as_json()
        for e in out["engines"]:
            p = per_engine.get(e["url"], {})
            e["placed_sessions"] = p.get("sessions", 0)
            e["placed_sessions_by_rank"] = p.get("sessions_by_rank", {})
            e["placements"] = p.get("placements", 0)
            e["placed_in_flight_prompt_tokens"] = p.get("in_flight_prompt_tokens", 0)
            e["placed_held_tokens"] = p.get("held_tokens", 0)
            e["placed_expected_growth_tokens"] = p.get("expected_growth_tokens", 0)
            e["placed_projected_tokens"] = p.get("projected_tokens", 0)
        out["placement"] = {"modes": dict(self.gw.placement_modes), "counts": dict(self.gw.placement.counts),
                            "sessions": len(self.gw.placement),
                            "reopen_hints": self.gw.placement.reopen_hints(self.gw.lifecycle.clock())}
        naming = self.gw.placed.naming
        if naming is not None and self.gw.directory.layout.pd:
            out["placement"]["decode_naming"] = naming.as_json(self.gw.lifecycle.clock())
        return _json(out)

    async def handle_stats(self, request: web.Request) -> web.Response:
        """Admission figures: counters, waiting, defer/degraded rate over the window, the ledger."""
        out = self.gw.gate.stats()
        if self.gw.poller is not None:
            out["capacity_sources"] = dict(self.gw.poller.last_sources)
            if self.gw.shared is not None:
                out["capacity_rounds"] = dict(self.gw.poller.shared_rounds)
        return _json(out)

    async def handle_sessions(self, request: web.Request) -> web.Response:
        try:
            limit = int(request.query.get("limit", str(SESSIONS_PAGE_MAX)))
            offset = int(request.query.get("offset", "0"))
        except ValueError:
            return bad_request("limit and offset must be integers")
        if limit < 0 or offset < 0:
            return bad_request("limit and offset must be >= 0")
        state = request.query.get("state")
        if state not in (None, "active", "closing", "closed"):
            return bad_request("state must be one of active, closing, closed")
        limit = min(limit, SESSIONS_PAGE_MAX)
        reg = self.gw.lifecycle.registry
        out = reg.as_json(self.gw.lifecycle.clock(), limit=limit, state=state, offset=offset)
        out["limit"], out["offset"] = limit, offset
        for entry in out["sessions"]:
            self._augment(entry)
        out["step"] = self.gw.lifecycle.steps.as_json()
        out["idle_policy"] = self.gw.lifecycle.policy.stats()
        out["close_queues"] = self.gw.lifecycle.stats()
        out["inference"] = self.gw.inference.stats() if self.gw.inference is not None else None
        return _json(out)

    def _augment(self, entry: dict) -> dict:
        sid = entry["session_id"]
        entry["kv_step"] = self.gw.lifecycle.steps.kv_step(sid)
        entry["idle_threshold_s"] = round(self.gw.lifecycle.policy.threshold(sid), 3)
        where = self.gw.placement.engine_of(sid)
        entry["engine"] = None if where is None else {"url": where[0], "dp_rank": where[1],
                                                      "placed_by": self.gw.placement.placed_by(sid),
                                                      "moves": self.gw.placement.moves_of(sid)}
        return entry

    def _session_named(self, name: str) -> str:
        """The session id ``name`` stands for: itself, or the id kvgate told the client as ``name`` in
        X-Kvgate-Session-Id (a hashed id)."""
        if self.gw.lifecycle.registry.get(name) is None:
            return self._told_ids.get(name, name)
        return name

    def told(self, sid: str) -> str:
        """The X-Kvgate-Session-Id value for ``sid`` (the request path tells the client it); a hashed one is
        remembered (at most max_tracked_sessions, the oldest dropped first) so /kvgate/sessions/<value> finds
        the session."""
        value = header_safe(sid)
        if value is not sid and value != sid:
            told = self._told_ids
            told[value] = sid
            told.move_to_end(value)
            if len(told) > self.gw.cfg.max_tracked_sessions:
                told.popitem(last=False)
        return value

    async def handle_session(self, request: web.Request) -> web.Response:
        refused = self._sid_refused(request.match_info["sid"])
        if refused is not None:
            return refused
        sid = self._session_named(request.match_info["sid"])
        s = self.gw.lifecycle.registry.get(sid)
        if s is None:
            return error(404, "not_found", f"unknown session {request.match_info['sid']!r}")
        return _json(self._augment(self.gw.lifecycle.registry.session_json(sid, self.gw.lifecycle.clock())))

    async def handle_session_close(self, request: web.Request) -> web.Response:
        """Close a session (again: an unfinished close is retried at once); ``?wait=1`` answers once every
        engine has answered this round of calls, with the per-engine results and pending retries."""
        refused = self._sid_refused(request.match_info["sid"])
        if refused is not None:
            return refused
        sid = self._session_named(request.match_info["sid"])
        self.gw.end_session(sid)
        self.gw.lifecycle.close(sid, "admin_api")
        if request.query.get("wait") in ("1", "true"):
            await self.gw.lifecycle.settled(sid, self.gw.cfg.session_close_drain_s + 4 * self.gw.cfg.close_timeout_s + 1.0)
        s = self.gw.lifecycle.registry.get(sid)  # the same view GET /kvgate/sessions/{id} answers
        return _json(self._augment(self.gw.lifecycle.registry.session_json(sid, self.gw.lifecycle.clock()))
                     if s else {"session_id": sid})

    async def _close_target(self, request: web.Request) -> str | web.Response:
        """The session id a /close_session or /finish_session names (a JSON body's ``session_id``, else the
        query's), or the 400 (:func:`bad_request`) that says what is wrong with the request."""
        raw = await request.read()
        sid = None
        if raw:
            try:
                obj = orjson.loads(raw)
            except orjson.JSONDecodeError:
                return bad_request('the body is not JSON: send {"session_id": "<id>"} or ?session_id=<id>')
            sid = obj.get("session_id") if isinstance(obj, dict) else None
        sid = sid if sid is not None else request.query.get("session_id")
        if sid is None:
            return bad_request('session_id is required: send {"session_id": "<id>"} or ?session_id=<id>')
        if not isinstance(sid, str) or not sid:
            return bad_request("session_id must be a non-empty string")
        refused = self._sid_refused(sid)
        return sid if refused is None else refused

    async def handle_close_session(self, request: web.Request) -> web.Response:
        """SGLang's /close_session, answered by kvgate (the router would 404 it), session lifecycle on or off:
        200 once the close is scheduled on every engine, an id kvgate never saw included (an engine answers
        any id 200, with an empty body: the close is idempotent), with a small JSON body saying what kvgate
        did (:meth:`SessionLifecycle.close_asked`: known, state, engines); a request without a usable
        session_id gets :func:`bad_request` (SGLang answers 400 too)."""
        sid = await self._close_target(request)
        if not isinstance(sid, str):
            return sid
        self.gw.end_session(sid)
        return _json(self.gw.lifecycle.close_asked(sid, "client"))

    async def handle_finish_session(self, request: web.Request) -> web.Response:
        """vLLM router's ``POST /finish_session?session_id=...`` (prime-rl, SkyRL send it on success, failure and
        cancellation): the session is closed as a client's /close_session closes it, session lifecycle on or off.
        The id comes from the query or a JSON body {"session_id"}; answered 200 {"status": "ok", "session_id"}
        and /close_session's known, state and engines (idempotent), and without a usable id the same 400 as
        /close_session (:func:`bad_request`; the clients that send it read only the status)."""
        sid = request.query.get("session_id") or await self._close_target(request)
        if not isinstance(sid, str):
            return sid
        refused = self._sid_refused(sid)
        if refused is not None:
            return refused
        self.gw.end_session(sid)
        return _json({"status": "ok", **self.gw.lifecycle.close_asked(sid, "finish")})
