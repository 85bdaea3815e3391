"""The session stage of the request path: which session a generate call belongs to (I/O edge).

kvgate.sessions.identity resolves a named session (body, headers, the configured field, rid lineage) and
kvgate.sessions.inference infers one from the prompt's prefix; this stage asks them in order, for the
gateway (kvgate.proxy.app), and says what goes out: the body with its top-level ``session_id`` and the
routing-key header.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvgate.common.classify import with_session_id
from kvgate.proxy.relay import BodyParts, header_safe
from kvgate.sessions.inference import request_units

if TYPE_CHECKING:
    from kvgate.proxy.app import Gateway


@dataclass(slots=True)
class SessionPlan:
    """How one generate call is tied to a session: the id and where it came from (body, header, field,
    inferred), the body and extra headers to forward, and whether prefix inference tracks it."""

    session_id: str | None = None
    source: str | None = None
    body: "bytes | BodyParts" = b""
    extra: dict[str, str] = field(default_factory=dict)
    inferred: bool = False
    prompt_is_text: bool = False
    units: Any = None  # the prompt's units, kept for replicas sharing inference (state_backend: redis)
    placed: bool = False  # the placement stage chose its engine: it goes there, not to the router
    prompt_tokens: int = 0  # the prompt's size as the placement stage estimated it (a placed call's)
    inference_result: str | None = None  # what prefix inference found, counted when the call ends


def as_text(session_id: str | None) -> str | None:
    """A session id as valid Unicode text. Header bytes that were not UTF-8 reach kvgate as lone
    surrogates (aiohttp decodes with surrogateescape); they become ``\\xNN`` escapes so the id can go
    into a JSON body and the registry. Others are returned unchanged."""
    if session_id is None:
        return None
    try:
        session_id.encode("utf-8")
        return session_id
    except UnicodeEncodeError:
        return session_id.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


async def resolve_session(gw: "Gateway", path: str, body_obj: dict, raw: bytes, request) -> SessionPlan:
    """The session stage with session lifecycle on: which session gateway ``gw``'s generate call on ``path``
    (its parsed ``body_obj``, its bytes ``raw``) belongs to (the body, headers, the configured field, rid
    lineage, else prefix inference, else another replica's shared index), and the body and routing-key header
    that name it. A call kvgate leaves alone (a session_id SGLang rejects, one too long to track, a body with
    session_params it cannot add an id to, nothing that names a session) gets a plan with no session and the
    body unchanged. Raises only on a kvgate fault (the caller forwards unchanged)."""
    if not isinstance(body_obj.get("session_id"), (str, type(None))):
        return SessionPlan(body=raw)  # a session_id SGLang rejects (a number, a list): its answer, unchanged
    res = gw.resolver.resolve(body_obj, request.headers)
    if res.session_id is not None and gw.sid_too_long(res.session_id):
        # Tracked, it would go whole into the registry, every close call and every listing: forwarded
        # untouched instead (the engine answers it as it would directly).
        gw.metrics.body_features_skipped.labels("session_id_size").inc()
        return SessionPlan(body=raw)
    sid, source, units, inferred = as_text(res.session_id), res.source, None, None
    if sid is None and gw.inference is not None:
        units = request_units(path, body_obj)
        if units is not None:
            inferred = gw.inference.infer(units, gw.lifecycle.clock())
            reason = inferred.reason
            sid, source = inferred.session_id, "inferred"
            if reason == "new" and gw.shared is not None:
                # Its previous turn may have gone through another replica.
                other = await gw.shared.continued_session(units, gw.block_of(units))
                if other is not None:
                    sid, reason = other, "shared"
            if sid is None:  # unsupported: counted now; a call with a session when it ends (refused or not)
                gw.metrics.child(gw.metrics.session_inference, reason).inc()
    if sid is None:
        return SessionPlan(body=raw)
    # /v1/responses: smg 1.13 refuses a top-level session_id there (400, an unknown field), so kvgate adds
    # none; the session is still tracked, routed by its key and closed.
    new_body = None if path == "/v1/responses" else with_session_id(raw, body_obj, sid)
    if new_body is None and "session_params" in body_obj:
        gw.metrics.session_params_skipped.inc()
        if inferred is not None:
            gw.metrics.child(gw.metrics.session_inference, reason).inc()
        return SessionPlan(body=raw)
    if inferred is not None:
        # Synchronously, before the admission wait: a concurrent turn must see this session busy.
        gw.inference.on_request_start(sid, units, gw.lifecycle.clock(), inferred.prepared)
    if new_body is not None or body_obj.get("session_id") == sid:
        gw.metrics.session_id_injected.labels(source).inc()
    extra = {}
    rk = gw.routing_key
    if rk is not None and rk not in request.headers:
        extra[rk] = header_safe(sid)
    return SessionPlan(sid, source, new_body if new_body is not None else raw, extra,
                       inferred=inferred is not None, prompt_is_text=isinstance(units, str),
                       units=units if inferred is not None and gw.shared is not None else None,
                       inference_result=reason if inferred is not None else None)
