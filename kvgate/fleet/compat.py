"""Compatibility verdicts: does session_id reach the engines, are the engines set up for it (pure).

The session_id probe
--------------------
kvgate sends one request through the router:
    POST /generate {"input_ids": [0], "sampling_params": {"max_new_tokens": 1},
                    "session_id": "kvgate-probe-<random>", "session_params": {"id": "kvgate-probe-<random>"}}
An SGLang engine (>= 0.5.15) that receives both fields rejects the request at validation with
400 "session_id and session_params cannot both be set." (srt/managers/io_struct.py), before any KV
is touched. So:
  - that 400 comes back               -> the router forwarded session_id: "forwarded" (smg);
  - any other answer from an engine   -> session_id was dropped on the way (sglang-router <= 0.3.2
    re-serialises /generate through a typed struct) or the engine predates 0.5.15: "dropped";
    the engine then sees only session_params for a session that was never opened and aborts it
    without generating;
  - no answer / no healthy worker     -> "unknown" (probed again later).
The probe costs one rejected request and no generation.
"""

from __future__ import annotations

import re
from typing import Any

import orjson

FORWARDED, DROPPED, UNKNOWN = "forwarded", "dropped", "unknown"
BOTH_SET_MESSAGE = "session_id and session_params cannot both be set"


def probe_body(probe_id: str) -> bytes:
    """The probe request body (see module doc)."""
    return orjson.dumps({
        "input_ids": [0],
        "sampling_params": {"max_new_tokens": 1},
        "session_id": probe_id,
        "session_params": {"id": probe_id},
    })


def classify_probe(status: int | None, body: bytes) -> str:
    """Verdict from the probe's HTTP status (None = transport failure) and response body."""
    if status is None:
        return UNKNOWN
    if BOTH_SET_MESSAGE.encode() in body:
        return FORWARDED
    if status in (404, 405, 408, 429, 502, 503, 504):
        return UNKNOWN  # no route, no healthy worker, router limiter: nothing reached an engine
    if status >= 500:
        try:
            err = orjson.loads(body)
        except orjson.JSONDecodeError:
            return UNKNOWN
        if "no_available_workers" in str(err):
            return UNKNOWN
    return DROPPED


def verdict_line(verdict: str, upstream: str, lifecycle_on: bool) -> str:
    """The one startup line that tells the operator what the probe found and what to do."""
    if verdict == FORWARDED:
        return (f"compat: router {upstream} forwards top-level session_id on /generate to the engines: " +
                ("session lifecycle is effective" if lifecycle_on else
                 "session lifecycle would be effective (agentic_session_lifecycle is off)"))
    if verdict == DROPPED:
        return (f"compat: router {upstream} DROPS top-level session_id on /generate (measured: smg 1.13.0 and "
                f"sglang-router 0.3.2 re-serialise /generate), or the engines predate SGLang 0.5.15: engines "
                f"cannot tag /generate turns' KV by session. Turns sent as /v1/completions keep it (both routers "
                f"forward it there); /close_session fan-out runs either way")
    return (f"compat: could not tell whether router {upstream} forwards session_id (no engine answered the "
            f"probe yet); will probe again when engines appear")


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
