"""The gateway: wires kvgate's parts and runs the request path (I/O edge).

Request path: request in -> classify -> resolve session (kvgate.proxy.session_stage) -> place -> admit (gate)
-> forward -> release and record. Forward: to the router, or, for a session's call on a route where kvgate
places sessions (docs/placement.md), straight to the engine kvgate.fleet.placement picks (the next one on a
refused connection; the router when none is usable; in a prefill/decode fleet, the router with the decode
worker named). kvgate's own endpoints and the admin key: kvgate.proxy.admin; starting and
serving: kvgate.proxy.bootstrap. Everything that is not kvgate's is forwarded to the router unchanged.
"""

from __future__ import annotations

import asyncio
import logging
import time
from functools import partial

from aiohttp import web

from kvgate.common.classify import GENERATE_ROUTES, STEP_BOUNDARY_ROUTES, classify, parse_json_object
from kvgate.config import PLACEMENT_ROUTES, Config, api_key, read_admin_key
from kvgate.fleet.decode_naming import DecodeNaming
from kvgate.fleet.placement import Placement, Target
from kvgate.fleet.directory import EngineDirectory
from kvgate.proxy.admin import Admin
from kvgate.proxy.relay import ROUTED_WORKER, Upstream, forward_head, read_body
from kvgate.common.admission_seam import Gate, OpenGate, RequestInfo, Ticket
from kvgate.proxy.placed import PlacedRelay
from kvgate.proxy.session_stage import SessionPlan, as_text, resolve_session
from kvgate.sessions.idle_policy import IdlePolicy, StepTracker
from kvgate.sessions.inference import SessionInference
from kvgate.sessions.lifecycle import SessionLifecycle
from kvgate.common.metrics import Metrics
from kvgate.sessions.observe import ResponseObserver
from kvgate.sessions.identity import SessionResolver
from kvgate.sessions.registry import SessionRegistry

log = logging.getLogger("kvgate")

GATEWAY_KEY = web.AppKey("gateway", object)
# The session id kvgate gave a generate call (named or inferred), told to the client on the response.
SESSION_HEADER = "X-Kvgate-Session-Id"
# Step-boundary bodies larger than this (tensor payloads) are not parsed: they take SGLang's defaults.
STEP_BODY_PARSE_LIMIT = 1 << 20


class Gateway:
    """Everything one running kvgate owns. Build with a validated Config; ``app`` is the aiohttp app."""

    def __init__(self, cfg: Config, gate: Gate | None = None, process_role=None):
        self.cfg = cfg
        # One of several kvgate processes on one port (kvgate.proxy.processes.ProcessRole), or None.
        self.process_role = process_role
        self.metrics = Metrics()
        self.upstream = Upstream(cfg.upstream, cfg.connect_timeout_s, cfg.read_timeout_s, cfg.upstream_pool_size)
        self.placement_modes = {r: cfg.session_placement_routes.get(r, cfg.session_placement) for r in PLACEMENT_ROUTES}
        router_key, engine_key = api_key(cfg, "router"), api_key(cfg, "engine")
        self.directory = EngineDirectory(cfg.upstream, cfg.engines, cfg.discovery_interval_s, self.metrics,
                                         probe=cfg.compat_probe, lifecycle_on=cfg.agentic_session_lifecycle,
                                         placement_modes=self.placement_modes,
                                         admission_on=cfg.agentic_program_admission,
                                         router_key=router_key, engine_key=engine_key)
        self.placement = Placement(pressure_threshold=cfg.placement_pressure_threshold,
                                   max_sessions=cfg.max_tracked_sessions, max_prefixes=cfg.max_tracked_sessions,
                                   reopen_hint_s=cfg.placement_reopen_hint_s,
                                   busier_margin=cfg.placement_busier_margin,
                                   session_growth=cfg.placement_session_growth)
        # The relay of placed session calls straight to their engine; shared state and the clock set below.
        # read per placed or shared-inference request: looked up once (Config reads go through __getattr__)
        self._placement_blocks = (cfg.session_inference_block_tokens, cfg.session_inference_block_chars,
                                  cfg.admission_chars_per_token)
        self.placed = PlacedRelay(self.placement, self.directory, self.upstream, self.metrics, None,
                                  lambda: self.lifecycle.clock(), self._placement_blocks,
                                  router_key=router_key, engine_key=engine_key)
        if cfg.placement_pd_decode and self.upstream.can_hold():
            # a PD fleet's decode workers are placed on and named to smg (an https router: not named)
            self.placed.naming = DecodeNaming()
        self.directory.on_change.append(self._engines_changed)
        self._engines_changed(self.directory.engines)  # a static list is there from the start
        for r in PLACEMENT_ROUTES:
            self.metrics.placement_active.labels(r).set_function(lambda r=r: 1 if self.directory.placed(r) else 0)
        self.lifecycle_on = cfg.agentic_session_lifecycle
        self.metrics.lifecycle_enabled.set(1 if self.lifecycle_on else 0)
        self.resolver = SessionResolver(cfg.session_resolution_order, cfg.session_header, cfg.session_field,
                                        cfg.session_field_regex, cfg.session_header_aliases,
                                        cfg.session_routing_key_headers, cfg.session_rid_lineage)
        policy = IdlePolicy(mode=cfg.session_idle_close_mode, fixed_s=cfg.session_idle_close_s,
                            quantile=cfg.session_idle_quantile, multiple=cfg.session_idle_multiple,
                            floor_s=cfg.session_idle_floor_s, ceiling_s=cfg.session_idle_ceiling_s,
                            min_samples=cfg.session_idle_min_samples, max_sessions=cfg.max_tracked_sessions)
        self.lifecycle = SessionLifecycle(SessionRegistry(cfg.max_tracked_sessions), self.directory, self.metrics,
                                          drain_s=cfg.session_close_drain_s, close_timeout_s=cfg.close_timeout_s,
                                          close_retries=cfg.close_retries,
                                          close_backoff_s=cfg.close_retry_backoff_s,
                                          close_max_backoff_s=cfg.close_retry_max_backoff_s,
                                          close_concurrency=cfg.close_concurrency,
                                          close_max_rate=cfg.close_max_rate, policy=policy,
                                          steps=StepTracker(cfg.max_tracked_sessions),
                                          close_on_abort=cfg.session_close_on_abort,
                                          close_children=cfg.session_close_children)
        self.lifecycle.on_close.append(self.placed.forget)
        self.lifecycle.on_close.append(self._program_ended)
        self.inference: SessionInference | None = None
        if self.lifecycle_on and cfg.session_inference:
            self.inference = SessionInference(
                block_tokens=cfg.session_inference_block_tokens, block_chars=cfg.session_inference_block_chars,
                min_output_fraction=cfg.session_inference_min_output_fraction,
                allow_parallel=cfg.session_inference_allow_parallel, max_sessions=cfg.max_tracked_sessions)
            self.metrics.inference_tracked.set_function(lambda: len(self.inference))
            self.metrics.inference_dropped.set_function(lambda: self.inference.counts["dropped"])
        self.shared = None
        if cfg.state_backend == "redis":
            from kvgate.shared.redis_state import SharedState
            self.shared = SharedState(cfg.redis_url, cfg.redis_key_prefix, cfg.redis_session_ttl_s,
                                      cfg.redis_timeout_s, self.metrics)
            self.lifecycle.idle_check = self.shared.idle_claim
            self.lifecycle.on_close.append(self._shared_closed)
            self.lifecycle.close_check = self.shared.close_wanted
        self.placed.shared = self.shared
        self.poller = None
        # Where a session's call goes when kvgate does not place it: the engine the router's answer named for
        # its earlier turns (x-smg-routed-worker-id), or None (counted fleet-wide). The placement stage reads it.
        self.engine_of = self.placement.engine_of
        if gate is None and cfg.agentic_program_admission:
            from kvgate.admission.gate import AdmissionGate
            from kvgate.admission.poller import CapacityPoller
            gate = AdmissionGate(cfg, self.metrics, pause_session=self._pause_session,
                                 session_ended=self.placed.dormant)
            self.poller = CapacityPoller(gate, self.directory, cfg.admission_poll_interval_s,
                                         cfg.admission_capacity_source)
        elif any(m != "router" for m in self.placement_modes.values()):
            from kvgate.admission.poller import CapacityPoller
            self.poller = CapacityPoller(None, self.directory, cfg.admission_poll_interval_s,
                                         cfg.admission_capacity_source)
        if self.poller is not None:
            self.poller.listeners.append(self._capacity)
            self.poller.shared = self.shared  # replicas sharing state poll the engines once for all
        self.gate: Gate = gate or OpenGate()
        if self.shared is not None:
            self.gate.shared = self.shared  # admission leases held against the ceilings shared by replicas
        # Generate bodies are parsed only when a feature reads them (session ids, prompts, reservations, and
        # kvgate's session placement): features off, a 64K-token body is relayed unparsed.
        self.reads_body = (self.lifecycle_on or gate is not None
                           or any(m == "kvgate" for m in self.placement_modes.values()))
        self.started = time.time()
        self.admin = Admin(self, read_admin_key(cfg.admin_key_file))
        self._max_sid = cfg.max_session_id_bytes
        # Read on every request: looked up once (a Config attribute goes through __getattr__).
        self._max_body = cfg.max_body_bytes
        self._join_max = max(cfg.body_parse_max_bytes, STEP_BODY_PARSE_LIMIT)
        self._parse_max = cfg.body_parse_max_bytes
        self.routing_key = cfg.routing_key_header if cfg.set_routing_key else None
        self.app = self._build_app()

    # --- app -------------------------------------------------------------------------------------

    def _build_app(self) -> web.Application:
        """The aiohttp app (``http_server: aiohttp``): kvgate's own routes (kvgate.proxy.admin), the generate
        routes, kvgate's 404/405 for the rest of /kvgate/, and the router for everything else."""
        app = web.Application(client_max_size=self.cfg.max_body_bytes)
        app[GATEWAY_KEY] = self
        r = app.router
        for path, methods in self.admin.routes().items():
            for method, handler in methods.items():
                r.add_route(method, path, handler)
        for route in PLACEMENT_ROUTES:  # the generate routes by exact path: a dict lookup, not the catch-all's regex
            r.add_route("*", route, self.handle_proxy)
        r.add_route("*", "/kvgate/{tail:.*}", self.admin.handle_not_found)  # kvgate's own paths never reach the router
        r.add_route("*", "/{tail:.*}", self.handle_proxy)
        return app

    def route(self, request):
        """The handler for a request on kvgate's own server: kvgate's own endpoint for it
        (kvgate.proxy.admin), else the router (handle_proxy), as the aiohttp app routes them."""
        return self.admin.lookup(request) or self.handle_proxy

    # --- session ids ----------------------------------------------------------------------------------

    def sid_too_long(self, sid: str) -> bool:
        """Whether ``sid`` is over max_session_id_bytes (UTF-8 bytes; measured only when it could be)."""
        return len(sid) * 4 > self._max_sid and len(sid.encode("utf-8", "surrogatepass")) > self._max_sid

    def _turn_marks(self, sid: str, headers) -> None:
        """After the answer went out: the turn's final-turn marker closes its session, its parent header links
        it (kvgate.sessions.lifecycle.turn_marks). Never raises (counted as a registry fault)."""
        try:
            if self.lifecycle.turn_marks(sid, headers) is not None and self.inference is not None:
                self.inference.forget(sid)  # the client ended it: later prompts that extend it start a new one
        except Exception:
            log.exception("reading the turn's session headers failed")
            self.metrics.faults.labels("registry").inc()

    def end_session(self, sid: str) -> None:
        """The client (or kvgate's close API) ended session ``sid``: inference, placement and admission forget
        it (the lifecycle's close is the caller's): later prompts that extend it start a new session."""
        if self.inference is not None:
            self.inference.forget(sid)
        self.lifecycle.forget(sid)
        self.placed.forget(sid)
        self._admission_forget(sid)

    def _program_ended(self, sid: str) -> None:
        """A close kvgate started itself (idle, an abort, a final turn, a parent's close, another replica's) ends
        the session's program in admission as a client's close does. A pause is a close whose program lives on;
        a client's or the admin API's close forgot the program before closing (end_session)."""
        s = self.lifecycle.registry.get(sid)
        if s is not None and (s.closed_elsewhere or s.close_reason not in ("pause", "client", "admin_api")):
            self._admission_forget(sid)  # another replica's close (any reason) ends the program here

    def _shared_closed(self, sid: str) -> None:
        """A close this replica begins (or marks, for another replica's): Redis records it with its reason, so
        the other replicas mark it closed for the same reason."""
        s = self.lifecycle.registry.get(sid)
        self.shared.session_closed(sid, (s.close_reason or "") if s is not None else "")

    def _admission_forget(self, sid: str) -> None:
        try:
            self.gate.forget(sid)
        except Exception:
            log.exception("admission forget failed")
            self.metrics.faults.labels("admission").inc()

    def _pause_session(self, sid: str) -> None:
        # The program policy paused this session: close its engine session so its KV is evicted first
        # (its next request re-opens it).
        if self.lifecycle_on:
            self.lifecycle.close(sid, "pause")

    # --- session placement (the pure rules are kvgate.fleet.placement) ----------------------------------

    def _learn_routed(self, sid: str, worker: str) -> None:
        """The router named the worker it sent session ``sid``'s call to (x-smg-routed-worker-id: the worker
        URL, ``@RANK`` appended under --dp-aware): that engine becomes the session's, for admission's per-engine
        count of its later turns, /kvgate/sessions and the sticky hint. Never raises (counted as a fault)."""
        try:
            url, _, rank = worker.strip().rstrip("/").partition("@")
            target = Target(url, int(rank) if rank.isdigit() else None)
            if self.placement.learn(sid, target, self.lifecycle.clock()):
                self.placed.publish()
        except Exception:
            log.exception("learning the router's engine for a session failed")
            self.metrics.faults.labels("placement").inc()

    def _engines_changed(self, engines) -> None:
        """The router's engine list changed: placement's engines are the regular ones, and in a PD fleet the
        decode workers kvgate can name to smg (kvgate.fleet.decode_naming)."""
        naming = self.placed.naming
        if naming is not None:
            naming.set_workers(engines)
        self.placement.set_engines([(e.url, e.healthy) for e in engines
                                    if e.worker_type == "regular" or (naming is not None and naming.names(e.url))])
        self.placed.publish()

    def _capacity(self, snapshot) -> None:
        self.placement.set_capacity({url: [(p.capacity, p.used, p.requests) for p in cap.pools]
                                     for url, cap in snapshot.engines.items()}, snapshot.taken_at)

    # --- the request path: classify -> resolve session -> place -> admit -> forward -> release and record ---

    async def handle_proxy(self, request: web.Request) -> web.StreamResponse:
        """Every request kvgate does not answer itself, in one order, each decision made once in its stage."""
        t0 = time.perf_counter()
        raw = await read_body(request, self._max_body, join_max=self._join_max, stream_over=self._stream_over(request))
        c = self._classify(request, raw)
        plan = await self._session_stage(c, raw, request)
        target = await self._place_stage(request, c, plan)
        ticket = await self._admit_stage(request, c, plan, target)
        target = self._moved(plan, target, ticket)
        self.metrics.added_latency.observe(max(0.0, time.perf_counter() - t0 - ticket.queue_s))
        session_id = await self._turn_started(plan, ticket)
        self.metrics.inflight_now += 1
        t1 = time.perf_counter()
        outcome = None
        try:  # from here on every exit path ends the request in the registry and the inference index
            resp, outcome = await self._forward(request, c, plan, target, ticket)
            return resp
        except asyncio.CancelledError:
            self.metrics.client_disconnects.inc()
            raise
        finally:
            self.metrics.inflight_now -= 1
            self._release_and_record(c, raw, plan, session_id, ticket, outcome, time.perf_counter() - t1)
            if session_id is not None:  # the answer went out: a final-turn marker closes the session now
                self._turn_marks(session_id, request.headers)

    def _classify(self, request: web.Request, raw: bytes):
        """Stage 1: the route, and the JSON body when a feature reads it."""
        c = classify(request.method, request.path, raw, parse=False)
        if c.is_generate and self.reads_body:
            c.body = self._parse_body(request, raw)
        return c

    async def _session_stage(self, c, raw: bytes, request: web.Request) -> SessionPlan:
        """Stage 2: which session the call belongs to (and the body that names it). Never raises: a fault
        forwards the request unchanged."""
        plan = SessionPlan(body=raw)
        if self.lifecycle_on and c.body is not None:
            try:
                plan = await resolve_session(self, c.path, c.body, raw, request)
            except Exception:  # fail-open: a kvgate fault never alters or drops the request
                log.exception("session resolution failed; forwarding unchanged")
                self.metrics.faults.labels("session").inc()
                plan = SessionPlan(body=raw)
        elif c.body is not None and self.directory.placed(c.path):
            # Lifecycle off, placement on: the session only picks the engine; the body goes out unchanged.
            try:
                res = self.resolver.resolve(c.body, request.headers)
                if res.session_id is not None and self.sid_too_long(res.session_id):
                    self.metrics.body_features_skipped.labels("session_id_size").inc()
                else:
                    plan = SessionPlan(as_text(res.session_id), res.source, raw)
            except Exception:
                log.exception("session resolution failed; forwarding unchanged")
                self.metrics.faults.labels("session").inc()
        return plan

    async def _place_stage(self, request: web.Request, c, plan: SessionPlan) -> Target | None:
        """Stage 3: the engine the call goes to, decided once: kvgate's placement on a route it places (the
        call then goes straight to that engine), else the engine the router named for the session's earlier
        turns (the router still routes the call; admission counts it there), else None."""
        sid = plan.session_id
        if sid is None:
            return None
        if self.placed.placed(c, sid):
            target, plan.prompt_tokens = await self.placed.place(request, c, sid)
            plan.placed = target is not None
            return target
        try:
            where = self.engine_of(sid) if self.engine_of is not None else None
        except Exception:  # fail-open: an unknown engine means the fleet-wide rule
            log.exception("engine lookup failed")
            self.metrics.faults.labels("placement").inc()
            return None
        return None if where is None else Target(where[0], where[1])

    async def _admit_stage(self, request: web.Request, c, plan: SessionPlan, target: Target | None) -> Ticket:
        """Stage 4: wait (or not) for room on the engines. A client gone while waiting never went out."""
        try:
            info = RequestInfo(c, self.admin.admission_headers(request.headers) if self.gate.reads_headers else {},
                               plan.session_id if self.lifecycle_on else None,
                               None if target is None else (target.engine, target.dp_rank), plan.placed)
            return await self.gate.acquire(info)
        except asyncio.CancelledError:  # client gone while waiting for admission: it never went out
            self.metrics.client_disconnects.inc()
            if plan.inferred:
                self._finish_inference(plan, None, False)
            raise
        except Exception:
            log.exception("admission failed; forwarding at once")
            self.metrics.faults.labels("admission").inc()
            return OpenGate.OFF

    def _moved(self, plan: SessionPlan, target: Target | None, ticket: Ticket) -> Target | None:
        """Admission admitted a call kvgate places on another engine with room: the session moves there."""
        if ticket.place is None or not plan.placed:
            return target
        return self.placed.moved(plan.session_id, ticket.place) or target

    async def _turn_started(self, plan: SessionPlan, ticket: Ticket) -> str | None:
        """The tracked session's turn begins (lifecycle on): returns its id, None when untracked or on a fault."""
        session_id = plan.session_id if self.lifecycle_on else None
        if session_id is None:
            return None
        try:
            await self.lifecycle.before_turn(session_id)
            self.lifecycle.request_started(session_id, plan.source)
            if self.shared is not None:
                self.shared.turn_started(session_id)
        except asyncio.CancelledError:  # client gone while its session's close calls were answered
            self._release(ticket)
            if plan.inferred:
                self._finish_inference(plan, None, False)
            raise
        except Exception:
            self.metrics.faults.labels("registry").inc()
            return None
        return session_id

    async def _forward(self, request: web.Request, c, plan: SessionPlan, target: Target | None, ticket: Ticket):
        """Stage 5: to the placed engine, else (none usable, or not placed) to the router with its headers."""
        sid = plan.session_id
        tracked = sid if self.lifecycle_on else None
        observe = None if tracked is None else partial(self._observer, c.path, plan.prompt_is_text)
        add = ticket.headers if tracked is None else [*ticket.headers, (SESSION_HEADER, self.admin.told(tracked))]
        if plan.placed:  # the placement stage chose ``target``
            placed = await self.placed.relay(request, c, sid, target, plan.prompt_tokens, plan.body, observe, add,
                                             plan.extra)
            if placed is not None:
                return placed
        resp, outcome = await self.upstream.relay(request, request.raw_path, forward_head(request.raw_headers, plan.extra),
                                                  plan.body, observe=observe, add_headers=add,
                                                  worker_header=ROUTED_WORKER if sid is not None else None)
        if outcome.routed_worker is not None:
            self._learn_routed(sid, outcome.routed_worker)
        self._router_outcome(outcome)
        return resp, outcome

    def _observer(self, route: str, prompt_is_text: bool, is_sse: bool) -> ResponseObserver:
        return ResponseObserver(is_sse, route=route, prompt_is_text=prompt_is_text, max_json_bytes=self._parse_max)

    def _release_and_record(self, c, raw: bytes, plan: SessionPlan, session_id: str | None, ticket: Ticket,
                            outcome, elapsed: float) -> None:
        """Stage 6: the lease goes back whatever happened; the turn, its session and the route are recorded."""
        obs = self._observed_safe(outcome)
        self._release(ticket, obs.meta_info if obs else None)
        self._record(c.route, outcome, elapsed)
        if plan.placed and obs is not None:  # the session's size, for placement's projected KV
            self.placed.observed(plan.session_id, obs.meta_info)
        refused = _refused(outcome)
        if session_id is not None:
            if refused:
                self._refused_turn(session_id)
            else:
                self._finish_session(session_id, obs, c.body)
        if plan.inferred:
            self._finish_inference(plan, obs, _completed(outcome), refused)
            if plan.units is not None and obs is not None and obs.output and _completed(outcome):
                self._share_turn(plan.session_id, plan.units, obs.output)
        if self.lifecycle_on and c.method == "POST" and c.path in STEP_BOUNDARY_ROUTES:
            self._step_boundary(c.path, raw, outcome)
        if self.lifecycle_on and c.method == "POST" and c.path == "/abort_request":
            self._abort_requested(raw)

    def _stream_over(self, request) -> int | None:
        """Bodies larger than this (bytes) are sent on as they arrive, never held whole: kvgate reads no body
        but a generate call's, and of the others parses none over STEP_BODY_PARSE_LIMIT (step boundaries,
        /abort_request). None for a generate call."""
        return None if request.method == "POST" and request.path in GENERATE_ROUTES else STEP_BODY_PARSE_LIMIT

    def _router_outcome(self, outcome) -> None:
        # What a forwarded call says about the router: unreachable, or answering (502s logged per change).
        d = self.directory
        if outcome.status is not None:
            if outcome.status >= 502 or d.router_gateway_error is not None or d.router.ok is not True:
                d.router_answered(outcome.status)
        elif outcome.ended == "unreachable":
            self.directory.router_result(False, "a forwarded call could not connect")

    def _parse_body(self, request: web.Request, raw: bytes) -> dict | None:
        """The generate body as a JSON object, or None when kvgate leaves it alone: not an object, sent
        compressed (kvgate forwards bodies exactly as received and never decompresses them), or larger than
        body_parse_max_bytes (parsing holds the event loop for every client). Skips are counted."""
        encoding = request.headers.get("Content-Encoding")
        if encoding is not None and encoding.strip().lower() not in ("", "identity"):
            self.metrics.body_features_skipped.labels("content_encoding").inc()
            return None
        if len(raw) > self._parse_max:
            self.metrics.body_features_skipped.labels("size").inc()
            return None
        return parse_json_object(raw)

    def _release(self, ticket: Ticket, meta: dict | None = None) -> None:
        try:
            self.gate.release(ticket, meta)
        except Exception:
            log.exception("admission release failed")
            self.metrics.faults.labels("admission").inc()

    def _record(self, route: str, outcome, elapsed: float) -> None:
        if outcome is not None and outcome.observer_fault:
            self.metrics.faults.labels("observer").inc()
        if outcome is None:
            status = "client_gone"
        elif outcome.status is None:
            status = "error"
            self.metrics.upstream_errors.labels(outcome.ended).inc()
        else:
            status = str(outcome.status)
            if outcome.ended == "upstream_error":
                self.metrics.upstream_errors.labels("cut").inc()
            elif outcome.ended == "client_gone":
                self.metrics.client_disconnects.inc()
        self.metrics.relayed(route, status, elapsed)

    def _observed_safe(self, outcome):
        # The lease must be released whatever the observer does.
        try:
            return self._observed(outcome)
        except Exception:
            log.exception("reading the response's meta_info failed")
            self.metrics.faults.labels("session").inc()
            return None

    def _observed(self, outcome):
        if outcome is None or outcome.observer is None:
            return None
        try:
            return outcome.observer.result()
        except Exception:  # what an observer makes of a response never touches the response
            log.exception("response observer failed reading the result")
            self.metrics.faults.labels("observer").inc()
            return None

    def block_of(self, units) -> int:
        """The prefix block a prompt is hashed in: characters for a text prompt, tokens for token ids."""
        block_tokens, block_chars, _ = self._placement_blocks
        return block_chars if isinstance(units, str) else block_tokens

    def _share_turn(self, sid: str, units, output) -> None:
        try:
            self.shared.link_turn(sid, units, output, self.block_of(units))
        except Exception:
            log.exception("sharing a turn for session inference failed")
            self.metrics.faults.labels("inference").inc()

    def _finish_session(self, session_id: str, obs, body: dict | None) -> None:
        if self.shared is not None:
            self.shared.turn_finished(session_id)
        try:
            rids = (body.get("rid") if body else None, (obs.meta_info or {}).get("id") if obs else None)
            self.lifecycle.request_finished(session_id, obs.meta_info if obs else None,
                                            obs.finish_type if obs else None, rids,
                                            obs.usage_source if obs else None)
        except Exception:
            log.exception("session registry update failed")
            self.metrics.faults.labels("registry").inc()

    def _refused_turn(self, session_id: str) -> None:
        """The upstream refused the call (a 4xx): no turn of its session. A session refused calls alone made is
        dropped, and placement and admission forget it too (kvgate.sessions.lifecycle.request_refused)."""
        if self.shared is not None:
            self.shared.turn_finished(session_id)
        try:
            dropped = self.lifecycle.request_refused(session_id)
        except Exception:
            log.exception("session registry update failed")
            self.metrics.faults.labels("registry").inc()
            return
        if dropped:
            self.placed.forget(session_id, hint=False)
            self._admission_forget(session_id)

    def _finish_inference(self, plan: SessionPlan, obs, completed: bool, refused: bool = False) -> None:
        # Always end the request in the index, or the session would look busy forever. Only a completed
        # turn moves the session on: a retry of an abandoned attempt must still extend the last one. A refused
        # call is no turn: counted as refused, not as what inference found.
        session_id = plan.session_id
        try:
            if plan.inference_result is not None:
                self.metrics.child(self.metrics.session_inference,
                                   "refused" if refused else plan.inference_result).inc()
            now = self.lifecycle.clock()
            if completed and obs is not None and obs.output:
                self.inference.on_response(session_id, obs.output, now)
            self.inference.on_request_end(session_id, now, completed, refused)
        except Exception:
            log.exception("session inference update failed")
            self.metrics.faults.labels("inference").inc()

    def _abort_requested(self, raw: bytes) -> None:
        try:
            self.lifecycle.abort_requested(parse_json_object(raw) if len(raw) <= STEP_BODY_PARSE_LIMIT else None)
        except Exception:
            log.exception("abort_request handling failed")
            self.metrics.faults.labels("registry").inc()

    def _step_boundary(self, path: str, raw: bytes, outcome) -> None:
        try:
            body = parse_json_object(raw) if len(raw) <= STEP_BODY_PARSE_LIMIT else None
            if self.lifecycle.step_boundary(path, outcome.status if outcome else None, body):
                log.info("step boundary (%s): the engines' cache was flushed; sessions stay known, step %d",
                         path, self.lifecycle.steps.step)
        except Exception:
            log.exception("step boundary handling failed")
            self.metrics.faults.labels("registry").inc()


def _refused(outcome) -> bool:
    """The upstream refused the call: a 4xx answer (a bad body, an unknown route or model, no credentials, too
    many requests). Nothing ran on an engine, so it is no turn of its session (docs/sessions.md)."""
    return outcome is not None and outcome.status is not None and 400 <= outcome.status < 500


def _completed(outcome) -> bool:
    """The upstream answered the turn in full with a success status (not cut, not abandoned)."""
    return (outcome is not None and outcome.ended == "complete" and outcome.status is not None
            and outcome.status < 400)
