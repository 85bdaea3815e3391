"""Compatibility verdicts: does session_id reach the engines, are the engines set up for it (pure).

The session_id probe, once per generate route
---------------------------------------------
kvgate sends one request through the router on each of /generate, /v1/chat/completions and /v1/completions
carrying both ``"session_id": "kvgate-probe-<random>"`` and ``"session_params": {"id": ...}`` (and a
1-token budget). An SGLang engine (>= 0.5.15) that receives both fields rejects the request at validation
with 400 "session_id and session_params cannot both be set." (srt/managers/io_struct.py, GenerateReqInput;
the OpenAI routes build the same GenerateReqInput), before any KV is touched. So, per route:
  - that 400 comes back               -> the router forwarded session_id there: "forwarded";
  - an engine's generation answer (200) -> session_id was dropped on the way (sglang-router 0.3.2
    re-serialises /generate and chat through typed structs) or the engine predates 0.5.15: "dropped"; the
    engine then sees at most session_params for a session that was never opened, or a plain request that
    generates one token;
  - anything else (no answer, no healthy worker, 401/403 for a missing or wrong key, a limiter's 429, a
    router's own 4xx) -> "unknown" (probed again later).
Measured: smg 1.13.0 forwards session_id on all three routes; sglang-router 0.3.2 drops it on /generate and
chat and forwards it on /v1/completions (docs/compatibility.md).
"""

from __future__ import annotations

import re
from typing import Any

import orjson

FORWARDED, DROPPED, UNKNOWN = "forwarded", "dropped", "unknown"
BOTH_SET_MESSAGE = "session_id and session_params cannot both be set"
# SGLang's answer to session_params naming a session that was never opened (tokenizer_manager; the simulator's too)
SESSION_MISSING_MESSAGE = "does not exist"


# The generate routes probed (and served by session placement when the router drops session_id there).
PROBE_ROUTES = ("/generate", "/v1/chat/completions", "/v1/completions")


def probe_body(probe_id: str, route: str = "/generate", model: str | None = None) -> bytes:
    """The probe request body for ``route`` (see module doc). ``model``: a served model name (smg's
    /v1/completions needs one). Raises ValueError on a route that is not in PROBE_ROUTES."""
    both = {"session_id": probe_id, "session_params": {"id": probe_id}}
    if route == "/generate":
        return orjson.dumps({"input_ids": [0], "sampling_params": {"max_new_tokens": 1}, **both})
    if route == "/v1/chat/completions":
        return orjson.dumps({"model": model or "default", "messages": [{"role": "user", "content": "kvgate probe"}],
                             "max_tokens": 1, **both})
    if route == "/v1/completions":
        return orjson.dumps({"model": model or "default", "prompt": "kvgate probe", "max_tokens": 1, **both})
    raise ValueError(f"no probe for {route}")


def classify_probe(status: int | None, body: bytes) -> str:
    """Verdict from the probe's HTTP status (None = transport failure) and response body: ``forwarded`` for the
    engine's 400 naming both fields; ``dropped`` for what an engine answers when only ``session_params`` reached
    it (SGLang's "Invalid request: session id ... does not exist", as a 400 or an abort) or when neither did
    (a generation answer: 200 with the JSON of a /generate or OpenAI completion); ``unknown`` for anything else
    (a refused key, no worker, a limiter, a router's own validation error), so kvgate probes again instead of
    reading an answer it does not know as a verdict."""
    if status is None:
        return UNKNOWN
    if BOTH_SET_MESSAGE.encode() in body:
        return FORWARDED
    if status == 400 and SESSION_MISSING_MESSAGE.encode() in body:
        return DROPPED
    if status == 200 and _generation_answer(body):
        return DROPPED
    return UNKNOWN


def _generation_answer(body: bytes) -> bool:
    """An engine's answer to a generate call: a JSON object (or a list of them, n > 1) with SGLang's
    ``meta_info`` (an abort has no text) or OpenAI's ``choices``."""
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return False
    items = obj if isinstance(obj, list) and obj else [obj]
    return all(isinstance(o, dict) and (isinstance(o.get("meta_info"), dict) or isinstance(o.get("choices"), list))
               for o in items)


def verdict_line(verdicts: dict[str, str], upstream: str, lifecycle_on: bool, placed: dict[str, bool]) -> str:
    """The one line that tells the operator what the probe found per route and who places session traffic.

    verdicts: route -> forwarded | dropped | unknown; placed: route -> kvgate places that route's sessions."""
    parts = []
    for route in PROBE_ROUTES:
        v = verdicts.get(route, UNKNOWN)
        who = "kvgate places sessions" if placed.get(route) else "via the router"
        parts.append(f"{route} {v} ({who})")
    tail = "" if lifecycle_on else "; agentic_session_lifecycle is off, so no session_id is added"
    return f"compat: router {upstream} top-level session_id: " + ", ".join(parts) + tail


# smg 1.13's policies that keep one routing key (X-SMG-Routing-Key) on one worker without --sticky-sessions
# (router-compat.md; tests/test_e2e_router.py measures manual and consistent_hashing).
ROUTING_KEY_POLICIES = ("manual", "consistent_hashing")


def routing_key_warning(router_policy: str | None, routing_key_header: str, sticky: bool = False) -> str | None:
    """One line when the router, as started, spreads a session's calls although kvgate sends the session id in
    ``routing_key_header``: a --policy other than manual or consistent_hashing, without --sticky-sessions
    (``sticky``; smg 1.13 then keeps a routing key on one worker on any policy). None when the policy is not
    known or keeps the key."""
    if router_policy is None or sticky or router_policy in ROUTING_KEY_POLICIES:
        return None
    return (f"router policy {router_policy!r} ignores {routing_key_header} without --sticky-sessions: session "
            f"traffic kvgate leaves to the router is spread without session affinity; start smg with "
            f"--sticky-sessions (any policy) or --policy consistent_hashing or manual (and set "
            f"router_sticky_sessions: true or router_policy to match), or let kvgate place sessions "
            f"(session_placement: auto with lifecycle or admission on, or kvgate)")


def engine_warnings(server_info: dict[str, Any] | None, metrics_status: int | None) -> list[tuple[str, str]]:
    """Warnings for one engine as (kind, text) from its /server_info JSON and GET /metrics status.

    Rules (sglang-engine-api.md, Sessions): enable_session_radix_cache must be on for session_id
    to tag KV; on 0.5.15-0.5.16 it also needs radix_eviction_policy=priority; /metrics 404 means
    --enable-metrics is off, so admission has only /v1/loads (or no signal).
    """
    out: list[tuple[str, str]] = []
    if server_info is None:
        out.append(("server_info_unreadable", "neither /server_info nor /get_server_info answered"))
    else:
        if not server_info.get("enable_session_radix_cache", False):
            out.append(("session_radix_cache_off",
                        "enable_session_radix_cache is off: session_id is accepted but does not order eviction; "
                        "start the engine with --enable-session-radix-cache"))
        version = parse_version(server_info.get("version"))
        if version is not None and (0, 5, 15) <= version[:3] < (0, 5, 17):
            if server_info.get("radix_eviction_policy") != "priority":
                out.append(("needs_priority_eviction",
                            "SGLang 0.5.15-0.5.16 session radix cache needs --radix-eviction-policy priority"))
        elif version is not None and version[:3] < (0, 5, 15):
            out.append(("engine_too_old", f"SGLang {server_info.get('version')} predates top-level session_id "
                                          f"(0.5.15): upgrade to >= 0.5.17"))
    if metrics_status == 404:
        out.append(("metrics_404", "/metrics is 404: start the engine with --enable-metrics"))
    return out


def parse_version(v: Any) -> tuple[int, ...] | None:
    """"0.5.17.post1" -> (0, 5, 17); None when absent or unparsable."""
    if not isinstance(v, str):
        return None
    parts = []
    for p in v.split("."):
        m = re.match(r"\d+", p)
        if m is None:
            break
        parts.append(int(m.group()))
        if m.end() < len(p):  # "17rc1": the release part ends here
            break
    return tuple(parts) if len(parts) >= 2 else None
