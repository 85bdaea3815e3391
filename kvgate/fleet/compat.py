"""Compatibility verdicts: does session_id reach the engines, are the engines set up for it (pure).

The session_id probe, once per generate route
---------------------------------------------
kvgate sends one request through the router on each of /generate, /v1/chat/completions and /v1/completions whose
top-level ``session_id`` is a JSON number (``PROBE_SESSION_ID``), not a string, with a 1-token budget; the
/generate probe also carries ``"session_params": {"id": "kvgate-probe-<random>"}``, a session never opened. An
SGLang engine (>= 0.5.15) validates ``session_id`` as a string on every generate route before anything runs
(srt/entrypoints/openai/protocol.py and srt/managers/io_struct.py declare ``session_id: Optional[str]``; the
HTTP server answers a pydantic error naming ``('body', 'session_id')``, 400). So, per route:
  - the engine's validation error on session_id comes back -> the router forwarded session_id: "forwarded"
    (so does SGLang's 400 "session_id and session_params cannot both be set.", which an engine that saw both
    fields on /generate answers, and which older simulators answer on every route);
  - an answer that shows the engine ran the request without session_id -> "dropped": a generate answer (200
    with ``meta_info`` on /generate, ``choices`` on the OpenAI routes), or, on /generate, the engine's 400
    "Invalid request: session id kvgate-probe-... does not exist" (it saw session_params alone);
  - anything else -> "unknown" (probed again later): no answer, no healthy worker, a limiter, a credentials
    refusal, or an error kvgate does not recognise (an engine without a tokenizer answering a text route, a
    router rejecting the field itself). An answer that is not understood is never taken for a verdict.
Measured on SGLang 0.5.23 (CPU) behind smg 1.13.0: forwarded on all three routes; behind sglang-router 0.3.2:
dropped on /generate and chat, forwarded on /v1/completions. SGLang 0.5.23's OpenAI routes never pass
``session_params`` on to the engine (serving_chat.py and serving_completions.py build GenerateReqInput with
session_id only), so the both-fields check cannot show anything there: the probe does not rely on it.
"""

from __future__ import annotations

import re
from typing import Any

import orjson

FORWARDED, DROPPED, UNKNOWN = "forwarded", "dropped", "unknown"
BOTH_SET_MESSAGE = "session_id and session_params cannot both be set"
#: The probe's top-level session_id: a number, which an engine that receives it rejects (it must be a string).
PROBE_SESSION_ID = 0

# SGLang's answer to a non-string session_id (pydantic, through http_server.py's validation handler):
# "{'type': 'string_type', 'loc': ('body', 'session_id'), 'msg': 'Input should be a valid string', ...}"
_SESSION_ID_INVALID = re.compile(rb"""'loc': \('body', 'session_id'\)""")
# The engine saw the probe's session_params alone (scheduler.py: the session was never opened)
_SESSION_UNKNOWN = re.compile(rb"Invalid request: session id \S+ does not exist")


# The generate routes probed (and served by session placement when the router drops session_id there).
PROBE_ROUTES = ("/generate", "/v1/chat/completions", "/v1/completions")


def probe_body(probe_id: str, route: str = "/generate", model: str | None = None) -> bytes:
    """The probe request body for ``route`` (see module doc): session_id PROBE_SESSION_ID; on /generate also
    ``session_params`` {"id": probe_id}. ``model``: a served model name (smg routes the OpenAI routes by it).
    Raises ValueError on a route that is not in PROBE_ROUTES."""
    if route == "/generate":
        return orjson.dumps({"input_ids": [1], "sampling_params": {"max_new_tokens": 1},
                             "session_id": PROBE_SESSION_ID, "session_params": {"id": probe_id}})
    if route == "/v1/chat/completions":
        return orjson.dumps({"model": model or "default", "messages": [{"role": "user", "content": "kvgate probe"}],
                             "max_tokens": 1, "session_id": PROBE_SESSION_ID})
    if route == "/v1/completions":
        return orjson.dumps({"model": model or "default", "prompt": "kvgate probe", "max_tokens": 1,
                             "session_id": PROBE_SESSION_ID})
    raise ValueError(f"no probe for {route}")


def classify_probe(status: int | None, body: bytes) -> str:
    """Verdict (forwarded | dropped | unknown) from the probe's HTTP status (None = transport failure) and
    response body; only an answer recognised as an engine's gives forwarded or dropped (module doc): a refused
    key (401/403), no worker, a limiter or a router's own validation error is unknown, and kvgate probes again."""
    if status is None:
        return UNKNOWN
    if status in (400, 422) and (_SESSION_ID_INVALID.search(body) or BOTH_SET_MESSAGE.encode() in body):
        return FORWARDED
    if status == 400 and _SESSION_UNKNOWN.search(body):
        return DROPPED
    if status == 200 and _generated(body):
        return DROPPED
    return UNKNOWN


def _generated(body: bytes) -> bool:
    """Whether ``body`` is an engine's generate answer (it ran the request): /generate's ``meta_info`` (a list of
    them for n > 1), the OpenAI routes' ``choices``."""
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
# (docs/compatibility.md; tests/test_e2e_router.py measures manual and consistent_hashing).
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

    Rules (docs/simulator-fidelity.md, Sessions): enable_session_radix_cache must be on for session_id
    to tag KV; on 0.5.15-0.5.16 it also needs radix_eviction_policy=priority; /metrics 404 means
    --enable-metrics is off, so admission has only /v1/loads (or no signal); enable_cache_report off (said
    explicitly) means the OpenAI routes report no cached tokens; a PD decode worker without its radix cache
    (disaggregation_decode_enable_radix_cache false) keeps no session KV between turns.
    """
    out: list[tuple[str, str]] = []
    if server_info is None:
        out.append(("server_info_unreadable", "neither /server_info nor /get_server_info answered"))
    else:
        if not server_info.get("enable_session_radix_cache", False):
            out.append(("session_radix_cache_off",
                        "enable_session_radix_cache is off: session_id is accepted but does not order eviction; "
                        "start the engine with --enable-session-radix-cache"))
        if server_info.get("enable_cache_report") is False:
            # SGLang then sends usage.prompt_tokens_details: null on the OpenAI routes (measured on 0.5.23)
            out.append(("cache_report_off",
                        "enable_cache_report is off: chat and completions answers carry no cached-token count, so "
                        "kvgate's session records show none for them; start the engine with --enable-cache-report"))
        if server_info.get("disaggregation_mode") == "decode" \
                and server_info.get("disaggregation_decode_enable_radix_cache") is False:
            # SGLang's decode worker then disables its radix cache (arg_groups/pd_disaggregation_hook.py)
            out.append(("decode_radix_cache_off",
                        "a decode worker without --disaggregation-decode-enable-radix-cache keeps no session KV "
                        "between turns: every turn's prompt is sent again from a prefill worker"))
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
