"""The placed relay: a session's generate call sent straight to the engine kvgate placed it on (I/O edge).

The decisions (which engine, sticky, prefix, free KV, re-opened) are kvgate.fleet.placement's; this module
asks it, relays the call to that engine over the gateway's pooled client, tries the next engine on a
connection refused before any byte went out, and falls back to the router (returns None) when no engine is
usable or placement itself failed (fail-open). docs/placement.md describes the rules and the modes.

In a prefill/decode fleet the engine placement picks is a decode worker, which no call may reach but through
smg's PD router: the call goes to the router with the worker named (``X-SMG-Target-Worker``,
kvgate.fleet.decode_naming), and smg picks the prefill worker and runs the bootstrap handshake.
"""

from __future__ import annotations

import logging
import secrets
from typing import Any, Callable

from kvgate.common.classify import inject_top_level
from kvgate.fleet.decode_naming import TARGET_WORKER_HEADER, DecodeNaming
from kvgate.fleet.discovery import engine_base_url
from kvgate.fleet.placement import Placement, Target
from kvgate.proxy.relay import ROUTED_WORKER, forward_head, no_worker_picked
from kvgate.sessions.inference import prefix_keys, request_units

log = logging.getLogger("kvgate")


def engine_body(raw: bytes, body_obj: dict, target: Target) -> bytes:
    """The body for ``target``: ``raw`` with a top-level ``routed_dp_rank`` pinning the DP rank that holds the
    session's prefix (SGLang's DP controller round-robins without it); unchanged when the engine has no DP
    rank or the client set its own pin (``routed_dp_rank`` or ``data_parallel_rank``)."""
    if target.dp_rank is None or "routed_dp_rank" in body_obj or "data_parallel_rank" in body_obj:
        return raw
    return inject_top_level(raw, "routed_dp_rank", target.dp_rank)


class PlacedRelay:
    """Relays session calls on the routes kvgate places to the engine kvgate.fleet.placement picks.

    Takes the gateway's placement rules, engine directory (which routes are placed, the engine URLs), pooled
    upstream client, metrics, shared state (replicas on Redis, or None), a clock (seconds) and the prompt's
    block sizes (tokens, characters, characters per token). ``placed(c, session_id)`` says whether a call
    goes here; ``relay(...)`` sends it; ``observed(sid, meta_info)`` records the size its call reached;
    ``forget(sid)`` drops a closed session; ``publish()`` updates the per-engine gauge.

    router_key: the router's API key (smg --api-key), or None. A placed call skips the router, so it would skip
    the router's key check too: with a key set, only a call that carries ``Authorization: Bearer <key>`` is
    placed, and any other goes to the router, which answers it (401). engine_key: the engines' API key, sent as
    the placed call's Authorization (the client's authenticated it to the router, not to the engine), or None
    (the client's headers go as they came).
    """

    def __init__(self, placement: Placement, directory, upstream, metrics, shared, clock: Callable[[], float],
                 blocks: tuple[int, int, float], router_key: str | None = None, engine_key: str | None = None):
        self.placement = placement
        self.directory = directory
        self.upstream = upstream
        self.metrics = metrics
        self.shared = shared
        self.clock = clock
        self.blocks = blocks
        self._router_auth = f"Bearer {router_key}".encode("ascii") if router_key else None
        self._engine_auth = {"Authorization": f"Bearer {engine_key}"} if engine_key else None
        # decode workers of a PD fleet, named to the router (None: placement_pd_decode off)
        self.naming: DecodeNaming | None = None

    def placed(self, c, session_id: str | None) -> bool:
        """True when a classified call ``c`` (with its parsed body) of session ``session_id`` goes to an
        engine kvgate picks: it has a session and a body, and kvgate places its route now."""
        return session_id is not None and c.body is not None and self.directory.placed(c.path)

    def _authorized(self, request) -> bool:
        """The call carries the router's key (or the router has none): it may skip the router's check."""
        want = self._router_auth
        if want is None:
            return True
        got = [v for k, v in request.raw_headers if k.lower() == b"authorization"]
        return len(got) == 1 and secrets.compare_digest(got[0].strip(), want)

    def publish(self) -> None:
        """Set ``agentic_kv_placed_sessions{engine}`` for every engine the directory knows."""
        for url in self.directory.urls:
            self.metrics.placed_sessions.labels(url).set(self.placement.sessions_on(url))

    def forget(self, sid: str, hint: bool = True) -> None:
        """A closed session: placement keeps only its re-open hint (``hint`` False: not even that, for a session
        that never had a turn). Never raises (counted as a fault)."""
        try:
            if self.placement.forget(sid, self.clock() if hint else None):
                self.publish()
        except Exception:
            log.exception("placement forget failed")
            self.metrics.faults.labels("placement").inc()

    def dormant(self, sid: str) -> None:
        """Admission found session ``sid`` ended while it stays open: placement stops counting its KV until its
        next call. Never raises (counted as a fault)."""
        try:
            if self.placement.dormant(sid):
                self.publish()
        except Exception:
            log.exception("placement dormant failed")
            self.metrics.faults.labels("placement").inc()

    def observed(self, sid: str, meta_info: dict | None) -> None:
        """Session ``sid``'s placed call ended with the engine's ``meta_info`` (or None): its prompt + output
        tokens are the KV the session holds now, for placement's projected KV. Never raises (counted)."""
        if not meta_info:
            return
        try:
            tokens = int(meta_info.get("prompt_tokens") or 0) + int(meta_info.get("completion_tokens") or 0)
            self.placement.observed(sid, tokens)
        except Exception:
            log.exception("recording a session's size for placement failed")
            self.metrics.faults.labels("placement").inc()

    async def place(self, request, c, session_id: str, exclude: list[str] = ()) -> tuple[Target | None, int]:
        """The placement stage: where session ``session_id``'s call (classified ``c``, on a route kvgate places)
        goes, decided once per call (and again only for a call whose engine refused its connection, with the
        engines tried in ``exclude``), and its prompt's size (tokens, an estimate: what relay() counts in flight
        on the engine). With replicas sharing state the first replica to place a session wins (its engine is
        adopted here). The target is None when the call lacks the router's key (the router answers it), when no
        engine is usable, or when placement itself failed (logged and counted: the router then routes it)."""
        if not exclude and not self._authorized(request):
            self.metrics.placement_calls.labels("router_auth").inc()
            return None, 0
        tokens = 0
        try:
            block_tokens, block_chars, chars_per_token = self.blocks
            units = request_units(c.path, c.body)
            tokens = (len(units) if isinstance(units, list) else
                      int(len(units) / chars_per_token) if isinstance(units, str) else 0)
            keys = prefix_keys(units, block_tokens, block_chars, memo=c.block_digests())
            placement, shared = self.placement, self.shared
            if shared is not None and placement.engine_of(session_id) is None:
                await self._adopt_shared(session_id, await shared.engine_of(session_id))
            target = self._place(session_id, keys, exclude, tokens)
            if target is not None and shared is not None and placement.last_reason != "sticky":
                # Another replica may have placed it meanwhile: the first placement wins.
                won = await shared.claim_engine(session_id, target.engine, target.dp_rank,
                                                replace=placement.last_replaced)
                if won is not None and won != (target.engine, target.dp_rank) and not exclude:
                    await self._adopt_shared(session_id, won)
                    target = self._place(session_id, keys, exclude, tokens)
        except Exception:  # fail-open: nothing went out yet
            log.exception("session placement failed; forwarding to the router")
            self.metrics.faults.labels("placement").inc()
            return None, 0
        if target is None:
            self.metrics.placement_calls.labels("router_fallback").inc()
        elif self.naming is not None and self.naming.names(target.engine) \
                and self.naming.index(target.engine, c.path, self.clock()) is None:
            # a decode worker kvgate cannot name now: smg picks it, and admission counts the call fleet-wide
            self.metrics.placement_calls.labels("decode_unnamed").inc()
            return None, tokens
        return target, tokens

    def moved(self, session_id: str, where: tuple[str, int | None]) -> Target | None:
        """Admission sent ``session_id``'s call to another engine with room (``where``: URL, DP rank): the
        session is on that engine from now on (counted per session). Returns the new target, or None when
        that engine is not usable (the call keeps the engine it was placed on). Never raises."""
        try:
            target = self.placement.move(session_id, Target(where[0], where[1]), self.clock())
        except Exception:
            log.exception("moving a session to the engine admission chose failed")
            self.metrics.faults.labels("placement").inc()
            return None
        if target is not None:
            self.metrics.child(self.metrics.placements, target.engine, "moved").inc()
            self.publish()
        return target

    async def relay(self, request, c, session_id: str, target: Target, tokens: int, body: Any, observe,
                    add, router_extra: dict[str, str] | None = None) -> tuple[Any, Any] | None:
        """Relay session ``session_id``'s call (classified ``c``, ``body`` the bytes to send, ``tokens`` its
        prompt's size as place() gave it) to ``target``, the engine the placement stage chose; on a refused
        connection (nothing sent) to the next engine it chooses. ``observe`` and ``add`` are as for
        Upstream.relay; ``router_extra``: the headers a call to the router carries (a PD decode worker's call
        goes through it). Returns (response, outcome), or None when no engine is usable any more, or smg
        refused or cannot take the decode worker's name (the caller then uses the router: fail-open)."""
        naming = self.naming
        if naming is not None and naming.names(target.engine):
            return await self._relay_named(request, c.path, session_id, target, tokens, body, observe, add,
                                           router_extra or {})
        headers = forward_head(request.raw_headers, self._engine_auth)  # no routing key: it is for the router
        tried: list[str] = []
        placement = self.placement
        while True:
            out = engine_body(body, c.body, target)
            call = placement.call_started(target, tokens, self.clock(), session_id)
            try:
                resp, outcome = await self.upstream.relay(request, request.raw_path, headers, out, observe=observe,
                                                          add_headers=add, base=target.engine)
            finally:
                placement.call_finished(target, call, self.clock())
            if outcome.ended == "unreachable" and not outcome.sent:
                # Refused before any byte went out: safe to try the next engine (never after the body went out).
                log.warning("engine %s refused a connection; session %s goes to the next engine",
                            target.engine, session_id)
                placement.mark_unreachable(target.engine, self.clock())
                # kvgate's own call failed: the engine is unusable (health, /kvgate/engines) until it answers
                self.directory.engine_call_failed(target.engine, "refused a placed call's connection")
                self.metrics.placement_calls.labels("connect_retry").inc()
                tried.append(target.engine)
                target, _ = await self.place(request, c, session_id, tried)
                if target is None:
                    return None
                continue
            self.metrics.placement_calls.labels("engine").inc()
            if outcome.status is not None:
                self.directory.engine_answered(target.engine, placed=True)
            return resp, outcome

    async def _relay_named(self, request, route: str, session_id: str, target: Target, tokens: int, body: Any,
                           observe, add, extra: dict[str, str]) -> tuple[Any, Any] | None:
        """A PD call to the router with its decode worker named (``target``); None when naming is off now or
        smg refused the name before any worker saw the call (the caller sends it to the router unnamed)."""
        naming, placement = self.naming, self.placement
        index = naming.index(target.engine, route, self.clock())
        if index is None:  # naming went off since the placement stage
            self.metrics.placement_calls.labels("decode_unnamed").inc()
            return None
        headers = forward_head(request.raw_headers, {**extra, TARGET_WORKER_HEADER: str(index)})
        call = placement.call_started(target, tokens, self.clock())
        try:
            resp, outcome = await self.upstream.relay(request, request.raw_path, headers, body, observe=observe,
                                                      add_headers=add, worker_header=ROUTED_WORKER,
                                                      hold=no_worker_picked)
        finally:
            placement.call_finished(target, call, self.clock())
        if outcome.ended == "held":  # smg picked no worker: nothing was sent to one, so it goes again unnamed
            if naming.refused(target.engine, route, self.clock()) is not None:
                log.warning("smg refused a %s call named for decode worker %s (index %d: 503 no_available_workers): "
                            "kvgate leaves the decode worker to smg for %.0f s (a prefill policy that reads "
                            "X-SMG-Target-Worker too? use --prefill-policy cache_aware; docs/compatibility.md)",
                            route, target.engine, index, naming.retry_s)
            self.metrics.placement_calls.labels("decode_name_refused").inc()
            return None
        routed = engine_base_url(outcome.routed_worker) if outcome.routed_worker else None
        self._naming(naming.answered(target.engine, route, index, routed, self.clock()))
        if routed is not None and routed != target.engine:
            # smg decoded it elsewhere: the session is where its KV now is
            self.metrics.placement_calls.labels("decode_name_ignored").inc()
            try:
                placement.learn(session_id, Target(routed, None), self.clock())
            except Exception:
                log.exception("learning where smg decoded a session's call failed")
                self.metrics.faults.labels("placement").inc()
        else:
            self.metrics.placement_calls.labels("decode_named").inc()
        return resp, outcome

    def _naming(self, state: str | None) -> None:
        # one log line when naming decode workers starts, stops or is retried
        if state == "naming":
            log.info("smg decodes calls on the decode worker kvgate names (X-SMG-Target-Worker)")
        elif state == "off":
            log.warning("smg decoded calls named alike on different decode workers (%d of the last %d answers): "
                        "its decode policy does not read X-SMG-Target-Worker, so kvgate leaves the decode worker "
                        "to smg for %.0f s (start smg with --decode-policy consistent_hashing and a prefill "
                        "policy such as cache_aware; docs/compatibility.md)",
                        self.naming.max_misses, self.naming.window, self.naming.retry_s)

    async def _adopt_shared(self, sid: str, where: tuple[str, int | None] | None) -> None:
        # The engine another replica placed the session on becomes its sticky engine here.
        if where is None:
            return
        try:
            if self.placement.adopt(sid, Target(where[0], where[1]), self.clock()):
                self.publish()
        except Exception:
            log.exception("adopting a shared placement failed")
            self.metrics.faults.labels("placement").inc()

    def _place(self, sid: str, keys: list[int], tried: list[str], tokens: int) -> Target | None:
        """Where ``sid``'s call (a ``tokens``-token prompt) goes by placement's rules, counted and its prompt
        indexed; None: no engine."""
        placement = self.placement
        target = placement.place(sid, keys, self.clock(), exclude=tried, prompt_tokens=tokens)
        if target is None:
            return None
        if placement.last_reason != "sticky":
            reason = "replaced" if placement.last_replaced else placement.last_reason
            self.metrics.child(self.metrics.placements, target.engine, reason).inc()
            self.publish()
        placement.remember_prefix(keys, target)
        return target
