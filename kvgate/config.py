"""kvgate configuration: one schema drives the YAML file, the command-line flags and validation.

Every key is flat (``agentic_session_lifecycle: true``) and has a flag of the same name with dashes
(``--agentic-session-lifecycle``). Precedence: built-in default < YAML file < flag. Bad keys, types or
values raise one :class:`ConfigError` holding every problem found, one line each naming its key and what is
allowed; the CLI prints them and exits with status 2 before anything listens.
"""

from __future__ import annotations

import argparse
import difflib
import ipaddress
import math
import os
import re
import socket
from dataclasses import dataclass, field, replace
from typing import Any, Callable
from urllib.parse import urlsplit

import yaml

from kvgate import config_checks, config_orders
from kvgate.admission.pause_gate import FORESEE_CYCLES, START_RATIO, STOP_RATIO
from kvgate.config_credentials import ADMIN_KEY_ENV, api_key, read_admin_key, redis_url_ok  # noqa: F401
from kvgate.config_orders import Order


class ConfigError(ValueError):
    """Configuration problems: ``err.lines`` holds one line per problem, each naming its key; ``str(err)`` is
    those lines joined by newlines (one problem: one line)."""

    def __init__(self, *lines: str):
        self.lines = list(lines)
        super().__init__("\n".join(self.lines))


def _url(key: str, value: Any) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{key}: expected an http(s) URL string, got {value!r}")
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ConfigError(f"{key}: expected an http(s) URL like http://127.0.0.1:30000, got {value!r}")
    return value.rstrip("/")


@dataclass(frozen=True)
class Key:
    """One configuration key: name, type, default, allowed range and its one-line documentation."""

    name: str
    type: type | tuple
    default: Any
    doc: str
    check: Callable[[Any], bool] | None = None
    allowed: str = ""
    nullable: bool = False
    # When set, the range check (and a rule with another key: kvgate.config_orders) only applies while this
    # boolean key is on (the admission numbers are checked only when admission is enabled).
    only_when: str | None = None
    choices: tuple = ()
    convert: Callable[[str, Any], Any] | None = None
    metavar: str = ""  # the flag's value placeholder; default: the name's last word in capitals
    group: str = ""  # the title of its Group (set by _grouped from the markers in KEYS)


@dataclass(frozen=True)
class Group:
    """A section of keys: ``kvgate serve --help`` lists each group's flags under its title and description,
    in GROUPS order. In KEYS a Group marks the keys that follow it as its own (a group may be entered again)."""

    title: str
    description: str


UPSTREAM = Group("upstream and engines", "the router kvgate forwards to, the engines, kvgate's calls to them")
SERVER = Group("server", "where kvgate listens, how it serves and logs, who may use its admin API")
LIMITS = Group("server limits", "what a client may send (none below smg 1.13's; docs/guarantees.md)")
LIFECYCLE = Group("session lifecycle", "feature 1, off by default: closing sessions; docs/sessions.md")
NAMING = Group("session naming", "where a call's session id comes from; the routing key kvgate sets")
PLACEMENT = Group("placement and PD", "which engine takes a session (PD: its decode worker); docs/placement.md")
LEDGER = Group("admission (ledger)", "feature 2, off by default: the token ledger, the fifo policy")
PROGRAM = Group("admission (program policy)", "admission_policy: program: working sets of whole agent programs")
SHARED = Group("shared state (Redis)", "what replicas agree on: state_backend: redis; docs/replicas.md")
#: The groups in the order ``--help`` shows them.
GROUPS = (UPSTREAM, SERVER, LIMITS, LIFECYCLE, NAMING, PLACEMENT, LEDGER, PROGRAM, SHARED)


def _grouped(entries: list) -> list[Key]:
    """KEYS from a list of Keys and Group markers: each Key gets the title of the last marker before it.
    Raises ValueError (at import) for a Key before any marker."""
    out, current = [], None
    for e in entries:
        if isinstance(e, Group):
            current = e
        elif current is None:
            raise ValueError(f"{e.name}: no Group before it")
        else:
            out.append(replace(e, group=current.title))
    return out


def _pos(x):
    return x > 0


# An HTTP header name (RFC 9110 token characters).
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")


def _nonneg(x):
    return x >= 0


def _unit(x):
    return 0 < x <= 1


def _port(x):
    return 0 <= x <= 65535


def _host(key: str, value: Any) -> str:
    """``host``: an IP address literal, a name that resolves, or the empty string (every interface)."""
    if value == "":
        return value
    try:
        ipaddress.ip_address(value)
        return value
    except ValueError:
        pass
    try:
        socket.getaddrinfo(value, None, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError, ValueError) as exc:
        why = exc.strerror if isinstance(exc, socket.gaierror) and exc.strerror else "not a valid host name"
        raise ConfigError(f"{key}: cannot resolve {value!r} ({why}); expected an IP address like 127.0.0.1 or "
                          f"0.0.0.0, or a host name that resolves") from None
    return value


def _tokenizer_file(path: str) -> None:
    """``admission_tokenizer_file``: raise ConfigError unless ``path`` is a readable file the installed
    ``tokenizers`` package can load."""
    key = "admission_tokenizer_file"
    if not os.path.isfile(path):
        why = "no such file" if not os.path.exists(path) else "not a file"
        raise ConfigError(f"{key}: {path}: {why} (expected a local tokenizer.json)")
    try:
        with open(path, "rb"):
            pass
    except OSError as exc:
        raise ConfigError(f"{key}: {path}: {exc.strerror}") from None
    from kvgate.admission.reservation import load_tokenizer_counter
    try:
        load_tokenizer_counter(path)  # loaded once: the admission gate gets the same counter
    except ImportError:
        raise ConfigError(f"{key}: the 'tokenizers' package is not installed (pip install tokenizers, or unset "
                          f"{key} to estimate tokens from characters)") from None
    except Exception as exc:  # tokenizers raises its own Exception subclass for a file it cannot parse
        detail = " ".join(str(exc).split())[:200]
        raise ConfigError(f"{key}: {path}: not a tokenizer.json the 'tokenizers' package can load ({detail})") \
            from None


def cpu_count() -> int:
    """CPUs this process may run on (its affinity mask, which containers and taskset narrow), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def _workers(key: str, value: Any) -> int:
    """``workers``: a positive integer, or ``auto`` (one per CPU this process may use)."""
    if isinstance(value, str):
        text = value.strip().lower()
        if text == "auto":
            return cpu_count()
        if text.isdigit():
            value = int(text)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{key}: must be a positive integer or auto, got {value!r}")
    return value


# Session placement modes and the routes the placement path serves (docs/placement.md).
PLACEMENT_MODES = ("auto", "kvgate", "router")
PLACEMENT_ROUTES = ("/generate", "/v1/chat/completions", "/v1/completions")

KEYS: list[Key] = _grouped([
    UPSTREAM,
    Key("upstream", str, "http://127.0.0.1:30000", "Base URL of the router (smg / sglang-router) kvgate forwards to.",
        convert=_url),
    SERVER,
    Key("host", str, "127.0.0.1",
        "Address kvgate listens on: an IP address (0.0.0.0 = every IPv4 interface) or a host name that resolves.",
        convert=_host),
    Key("port", int, 8080, "Port kvgate listens on (0 picks a free port).", _port, "0..65535"),
    Key("log_level", str, "info", "Log level.", choices=("debug", "info", "warning", "error")),
    Key("workers", (int, str), 1,
        "Worker processes serving the same host:port (SO_REUSEPORT), each a full kvgate, supervised by the "
        "process you start; auto = one per CPU. More than 1 needs state_backend: redis.", convert=_workers),
    # credentials: the keys themselves are never logged, echoed or kept in the config
    UPSTREAM,
    Key("router_api_key_file", str, None,
        "A file holding the router's API key (smg --api-key): kvgate sends it as Authorization: Bearer on its "
        "own calls to the router (discovery, the session_id probe, /v1/models). null = none.", nullable=True),
    Key("router_api_key_env", str, None,
        "The name of an environment variable holding the router's API key (instead of router_api_key_file).",
        nullable=True),
    Key("engine_api_key_file", str, None,
        "A file holding the engines' API key (SGLang --api-key): sent on kvgate's own calls to the engines "
        "(KV polls, server_info, /close_session) and on session calls kvgate places on them. null = none.",
        nullable=True),
    Key("engine_api_key_env", str, None,
        "The name of an environment variable holding the engines' API key (instead of engine_api_key_file).",
        nullable=True),
    Key("connect_timeout_s", float, 5.0, "Timeout for opening a connection to the upstream router, seconds.",
        _pos, "> 0"),
    Key("read_timeout_s", float, 0.0,
        "Timeout between two reads of an upstream response, seconds; 0 = none (decodes run for minutes).",
        _nonneg, ">= 0"),
    LIMITS,
    Key("max_body_bytes", int, 512 * 1024 * 1024, "Largest request body accepted, bytes.", _pos, "> 0"),
    Key("body_parse_max_bytes", int, 4 * 1024 * 1024,
        "Largest generate body (and JSON response) kvgate parses for its session and admission features, bytes; "
        "larger ones are relayed untouched (parsing holds the event loop for every client, about 10 ms per MiB).",
        _nonneg, ">= 0"),
    UPSTREAM,
    Key("upstream_pool_size", int, 0, "Upper bound on pooled upstream connections; 0 = unbounded.",
        _nonneg, ">= 0"),
    SERVER,
    Key("event_loop", str, "uvloop", "The event loop kvgate serves on: uvloop (libuv, faster) or asyncio (the "
        "standard library's). uvloop falls back to asyncio, with one log line, where it is not installed.",
        choices=("uvloop", "asyncio")),
    Key("http_server", str, "kvgate", "The HTTP server kvgate answers its clients with: kvgate (kvgate's own, "
        "on httptools; less CPU per request and less memory per waiting connection) or aiohttp (aiohttp's "
        "general-purpose web server).",
        choices=("kvgate", "aiohttp")),
    LIMITS,  # what a client may send kvgate's own HTTP server (http_server: kvgate)
    # Each no lower than smg 1.13's (docs/guarantees.md has them beside smg's and nginx's, measured).
    Key("http_max_request_line_bytes", int, 128 * 1024,
        "Longest request line accepted, bytes (400 above; smg answers 414 above 64 KiB itself).", _pos, "> 0"),
    Key("http_max_header_line_bytes", int, 512 * 1024, "Longest header line accepted, bytes (431 above).",
        _pos, "> 0"),
    Key("http_max_head_bytes", int, 2 << 20, "Largest request head (request line and headers), bytes (431 above).",
        _pos, "> 0"),
    Key("http_max_header_count", int, 1000, "Most header lines in a request (431 above; smg takes 100).",
        _pos, "> 0"),
    Key("http_max_trailer_bytes", int, 1 << 20,
        "Largest trailer section after a chunked body, bytes (400 above); trailers are read and dropped.",
        _pos, "> 0"),
    Key("http_header_timeout_s", float, 60.0,
        "Seconds a request head may take to arrive once it began (408 and close after).", _pos, "> 0"),
    Key("http_body_timeout_s", float, 60.0,
        "Seconds a request body may go without a byte while kvgate reads it (408 and close after).", _pos, "> 0"),
    Key("http_max_inflight_body_bytes", int, 1 << 30,
        "Request body bytes held in memory at once over all connections; past it a body waits to be read "
        "(a body larger than this goes alone).", _pos, "> 0"),
    Key("http_body_budget_wait_s", float, 60.0,
        "Seconds a body may wait for room in http_max_inflight_body_bytes (503 and close after).", _pos, "> 0"),
    Key("max_session_id_bytes", int, 16384,
        "Longest session id kvgate tracks, UTF-8 bytes: longer ids on generate calls are forwarded untouched and "
        "not tracked; kvgate's close API and /kvgate/sessions/{id} answer them 400.", _pos, "> 0"),
    SERVER,
    Key("admin_key_file", str, None,
        "A file holding the admin key (its first line); null = the KVGATE_ADMIN_KEY environment variable, or no "
        "key. With a key, /kvgate/sessions, /kvgate/engines, /kvgate/stats, the session close API and the "
        "X-Kvgate-Protected and X-Kvgate-Scope headers need the header X-Kvgate-Admin-Key.", nullable=True),
    LIFECYCLE,
    Key("agentic_session_lifecycle", bool, False,
        "Inject a top-level session_id into generate calls and close finished sessions on every engine."),
    NAMING,
    Key("session_resolution_order", list, ["body", "header", "routing_key", "field", "rid"],
        "Where a request's session id is looked for, in order: body (top-level session_id), header (session_header, "
        "then session_header_aliases), routing_key (session_routing_key_headers), field (session_field), rid (the "
        "request id's lineage); prefix inference comes last.",
        lambda v: len(v) > 0 and len(set(v)) == len(v) and all(
            x in ("body", "header", "routing_key", "field", "rid") for x in v),
        "a non-empty list of distinct values from body, header, routing_key, field, rid"),
    Key("session_header", str, "X-Session-ID", "Request header carrying the session id."),
    Key("session_header_aliases", list, ["x-dynamo-session-id"],
        "Further headers carrying the session id, read after session_header (Dynamo's x-dynamo-session-id).",
        lambda v: all(isinstance(x, str) and _HEADER_NAME.fullmatch(x) for x in v), "a list of header names"),
    Key("session_routing_key_headers", list, ["X-SMG-Routing-Key"],
        "The routing-key headers smg reads (its --routing-key-headers), in order: the first present is the "
        "session id. [] = not read.",
        lambda v: all(isinstance(x, str) and _HEADER_NAME.fullmatch(x) for x in v), "a list of header names"),
    Key("session_rid_lineage", str, "suffixed",
        "The request id's lineage as the session id (rid with one _r<n>, then one _t<n> suffix stripped, as smg "
        "strips it): suffixed (only a rid with such a suffix names a session), any (every rid does) or off.",
        lambda v: v in ("suffixed", "any", "off"), "one of suffixed, any, off"),
    LIFECYCLE,
    Key("session_close_children", bool, True,
        "Close a subagent's session (one that named its parent with x-dynamo-parent-session-id) when its parent "
        "session closes first."),
    NAMING,
    Key("session_field", str, None, "Body field carrying the session id, for example rid or user; null = unused.",
        nullable=True),
    Key("session_field_regex", str, None,
        "Regex applied to session_field; its first capture group (or the whole match) is the session id.",
        nullable=True),
    Key("set_routing_key", bool, True,
        "Set the routing-key header to the session id unless the client set one, so smg keeps a session on one engine."),
    Key("routing_key_header", str, "X-SMG-Routing-Key",
        "The routing-key header kvgate sets: smg reads it under --policy manual and consistent_hashing, and under "
        "any policy with --sticky-sessions (the others ignore it)."),
    Key("router_policy", str, None,
        "The --policy the router was started with (smg does not report it); kvgate warns at startup when it "
        "ignores the routing key kvgate sets (every policy but manual and consistent_hashing, unless "
        "router_sticky_sessions). null = not said.", nullable=True),
    Key("router_sticky_sessions", bool, False,
        "The router was started with --sticky-sessions (smg 1.13: a routing key stays on one worker on any "
        "policy); silences the routing-key warning."),
    Key("session_inference", bool, True,
        "When body, header and field give no session id, infer it from the prompt's prefix."),
    Key("session_inference_block_tokens", int, 64, "Token ids per hashed block for prefix inference.", _pos, "> 0"),
    Key("session_inference_block_chars", int, 256, "Characters per hashed block (text and chat prompts).",
        _pos, "> 0"),
    Key("session_inference_min_output_fraction", float, 0.5,
        "Share of the previous output a re-rendered turn must still contain to link.", lambda x: 0 <= x <= 1,
        "in [0, 1]"),
    Key("session_inference_allow_parallel", bool, False,
        "A session with a request in flight can still be matched (agents that issue parallel calls)."),
    LIFECYCLE,
    Key("session_idle_close_s", float, 300.0, "Close a session idle for this long, seconds; 0 = never.",
        _nonneg, ">= 0"),
    Key("session_idle_close_mode", str, "fixed",
        "fixed: close after session_idle_close_s; adaptive: after a multiple of a high quantile of the "
        "gaps seen between turns, within a floor and a ceiling.", choices=("fixed", "adaptive")),
    Key("session_idle_quantile", float, 0.95, "Gap quantile the adaptive threshold is based on.", _unit, "in (0, 1]"),
    Key("session_idle_multiple", float, 3.0, "Adaptive threshold = multiple x quantile.", _pos, "> 0"),
    Key("session_idle_floor_s", float, 10.0, "Adaptive threshold floor, seconds.", _pos, "> 0"),
    Key("session_idle_ceiling_s", float, 900.0, "Adaptive threshold ceiling, seconds.", _pos, "> 0"),
    Key("session_idle_min_samples", int, 32, "Gaps seen before the threshold adapts (until then: fixed).",
        _pos, "> 0"),
    Key("session_close_on_abort", bool, True,
        "Close a session at once when its turn ends with an abort the client asked for (/abort_request naming "
        "the turn's rid); other aborts (weight update, flush, memory release) never close it."),
    Key("session_close_drain_s", float, 30.0,
        "How long a close waits for the session's in-flight requests before fanning out, seconds.", _nonneg, ">= 0"),
    Key("close_timeout_s", float, 0.5, "Timeout of one /close_session call to one engine, seconds.", _pos, "> 0"),
    Key("close_retries", int, 10,
        "Retries of an engine's /close_session after a connect error, timeout or 5xx, with backoff; then the "
        "close is given up (counted) until the session is closed again.", _nonneg, ">= 0"),
    Key("close_retry_backoff_s", float, 0.5,
        "Wait before the first retry of a failed close, seconds; doubles per retry up to close_retry_max_backoff_s.",
        _pos, "> 0"),
    Key("close_retry_max_backoff_s", float, 60.0, "Longest wait between two retries of a close, seconds.",
        _pos, "> 0"),
    Key("close_concurrency", int, 8, "/close_session calls in flight at once per engine.", _pos, "> 0"),
    Key("close_max_rate", float, 1000.0, "/close_session calls per second per engine at most; 0 = unpaced.",
        _nonneg, ">= 0"),
    Key("max_tracked_sessions", int, 100_000,
        "Cap on sessions kept in the registry; the oldest idle ones are dropped first.", _pos, "> 0"),
    SHARED,
    Key("state_backend", str, "memory",
        "Where replicas keep what they must agree on (session activity and idle close, placement, inferred "
        "sessions): memory (this process only) or redis (shared by every replica on redis_url).",
        choices=("memory", "redis")),
    Key("redis_url", str, "redis://127.0.0.1:6379/0", "The Redis server of state_backend: redis.",
        redis_url_ok, "a redis://, rediss:// or unix:// URL, its database (/N or ?db=N) a number"),
    Key("redis_key_prefix", str, "kvgate:",
        "Prefix of every Redis key kvgate writes (one prefix per kvgate deployment sharing a Redis).",
        lambda v: len(v) > 0, "a non-empty string"),
    Key("redis_session_ttl_s", float, 86400.0,
        "Seconds a session's shared record (activity, engine) lives in Redis after its last touch; keep it "
        "above the idle threshold.", _pos, "> 0"),
    Key("redis_timeout_s", float, 0.25,
        "One Redis call, seconds; a slower or failed call is treated as Redis unreachable (fail-open).",
        _pos, "> 0"),
    UPSTREAM,
    Key("engines", list, [], "Static engine base URLs; when empty, engines are discovered from the router.",
        lambda v: all(isinstance(x, str) for x in v), "a list of URL strings"),
    Key("discovery_interval_s", float, 10.0, "How often the engine list is refreshed from the router, seconds.",
        _pos, "> 0"),
    Key("compat_probe", bool, True,
        "Probe whether the router forwards a top-level session_id on each generate route (at startup, when the "
        "router restarts and when its workers change) and check each engine's server_info."),
    PLACEMENT,
    Key("session_placement", str, "auto",
        "Who picks the engine for session traffic: auto (kvgate on every generate route when session lifecycle "
        "or admission is on, else the router), kvgate (always kvgate, even with both off) or router (always the "
        "router; kvgate sends the session id as X-SMG-Routing-Key).",
        choices=PLACEMENT_MODES),
    Key("session_placement_routes", dict, {},
        "Per-route override of session_placement: {/generate: kvgate, /v1/completions: router, ...}.",
        lambda v: all(k in PLACEMENT_ROUTES and m in PLACEMENT_MODES for k, m in v.items()),
        "a mapping from /generate, /v1/chat/completions or /v1/completions to auto, kvgate or router"),
    Key("placement_pd_decode", bool, True,
        "In a prefill/decode fleet, kvgate places a session on a decode worker (room first, then its prefix) and "
        "names it to smg in X-SMG-Target-Worker (smg --decode-policy consistent_hashing, a prefill policy that "
        "ignores the header, --disable-worker-overload-protection); naming stops by itself while smg does not "
        "honour it. false: smg's decode policy picks."),
    Key("placement_pressure_threshold", float, 0.85,
        "A new session joins its prefix's engine while that engine's projected KV (with the session) stays below "
        "this share of its capacity, or no other engine has more room; a closed one goes back below this usage.",
        _unit, "in (0, 1]"),
    Key("placement_session_growth", bool, True,
        "Projected KV counts what live sessions hold and will grow to (their prompt group's largest size); "
        "false: the engines' KV figures alone."),
    Key("placement_busier_margin", int, 4,
        "A new session joins the engine holding its prefix only while that engine's running + waiting requests "
        "exceed the least busy other engine's by at most this many; null: load never moves it.",
        lambda x: x >= 0, ">= 0 (or null: load never moves it)", nullable=True, metavar="N"),
    Key("placement_reopen_hint_s", float, 600.0,
        "Seconds a closed session's engine is remembered, so a re-opened session goes back to it (0: off).",
        _nonneg, ">= 0"),
    LEDGER,
    Key("agentic_program_admission", bool, False,
        "Hold each generate call until the engines' KV can take it, as admission_policy says: fifo (one global "
        "queue in front of a token ledger) or program (started programs keep going, new ones wait for room)."),
    Key("agentic_admission_headroom", float, 0.90,
        "Fraction of the fleet's max_total_num_tokens the ledger may commit.", _unit, "in (0, 1]",
        only_when="agentic_program_admission"),
    Key("agentic_admission_pressure_threshold", float, 0.92,
        "Hold new work while the worst engine's token_usage is at or above this.", _unit, "in (0, 1]",
        only_when="agentic_program_admission"),
    Key("max_response_length", int, 4096, "The rollout's max response length in tokens.", _pos, "> 0"),
    Key("agentic_admission_expected_decode_cap", int, None,
        "Cap on the completion tokens reserved per sequence; null = max_response_length.", _pos, "> 0",
        nullable=True, only_when="agentic_program_admission"),
    Key("agentic_admission_max_wait_s", float, 30.0,
        "A request waiting this long bypasses the queue (aged), seconds.", _nonneg, ">= 0",
        only_when="agentic_program_admission"),
    Key("agentic_admission_scope", str, "train", "Which work admission holds: train (eval bypasses) or all.",
        choices=("train", "all")),
    Key("admission_poll_interval_s", float, 2.0,
        "How often each engine's KV metrics are read (admission and session placement), seconds.", _pos, "> 0"),
    Key("admission_capacity_source", str, "auto",
        "Where engine KV figures are read: auto (/v1/loads, else /metrics), loads or metrics.",
        choices=("auto", "loads", "metrics")),
    Key("admission_lease_ttl_s", float, 3600.0,
        "A lease older than this is reclaimed as stranded, seconds.", _pos, "> 0",
        only_when="agentic_program_admission"),
    Key("admission_window_s", float, 60.0, "Window for usage and rate statistics, seconds.", _pos, "> 0",
        only_when="agentic_program_admission"),
    Key("admission_chars_per_token", float, 3.0,
        "Characters per token when estimating text prompts (conservative: real BPE is ~4).", _pos, "> 0",
        only_when="agentic_program_admission", metavar="CHARS"),
    Key("admission_tokenizer_file", str, None, "A local tokenizer.json used to count text prompt tokens (needs the "
        "tokenizers package, which kvgate does not install); null = estimate at admission_chars_per_token.",
        nullable=True),
    Key("admission_policy", str, "fifo",
        "fifo: one global queue in front of the token ledger; program: per-engine working sets of whole "
        "programs (sessions), pausing programs in a tool call when an engine overflows.",
        choices=("fifo", "program")),
    Key("admission_backfill", bool, False,
        "fifo policy: a waiting request that fits may pass a head that does not, never taking the head's room."),
    Key("admission_context_length", int, None,
        "The model's context length in tokens: OpenAI-route calls without max_tokens reserve up to it; "
        "null = reserve the decode cap.", _pos, "> 0", nullable=True, only_when="agentic_program_admission"),
    Key("admission_prefix_block_tokens", int, 64,
        "Prompt prefix block size in tokens: a prefix several live requests share is reserved once.", _pos, "> 0",
        only_when="agentic_program_admission"),
    PROGRAM,
    Key("admission_pause_victim", str, "ahead",
        "program policy: which in-tool program pauses first when an engine overflows.",
        choices=("smallest", "largest", "longest-idle", "ahead")),
    Key("admission_wait_bound", str, "aging",
        "program policy: how long a turn waits for room. reprefill: no longer than re-prefilling the KV its "
        "admission would displace takes, at the prefill rate learned from the engines' answers (then it goes "
        "over the ceiling as bypass-cost), never past agentic_admission_max_wait_s; aging: "
        "agentic_admission_max_wait_s alone.", choices=("reprefill", "aging")),
    Key("admission_pause_start_ratio", float, START_RATIO,
        "program policy: hold turns and pause programs once re-prefilling KV the engines had evicted costs "
        "the calls this many seconds per engine second (measured from the answers at the learned prefill rate; "
        "CPU engines with short contexts measure 0.2-0.7, thrashing GPU-class engines 6-7) or foresight foresees "
        "it; until then every turn goes at once, as with lifecycle alone; 0 = always.", _nonneg, ">= 0",
        only_when="agentic_program_admission"),
    Key("admission_pause_stop_ratio", float, STOP_RATIO,
        "program policy: stop holding and pausing once that figure falls below this (<= "
        "admission_pause_start_ratio; ignored when it is 0).", _nonneg, ">= 0",
        only_when="agentic_program_admission"),
    Key("admission_foresee_cycles", float, FORESEE_CYCLES,
        "program policy: also pause as KV overflows if prefilling a ceiling takes N program cycles; 0 = off.",
        _nonneg, ">= 0", only_when="agentic_program_admission", metavar="N"),
    Key("admission_resume_order", str, "fifo",
        "program policy: which paused program resumes first as room frees (fifo: the longest waiting; smallest; "
        "largest: best-fit-decreasing).", choices=("smallest", "largest", "fifo")),
    Key("admission_program_overdue_multiple", float, 3.0,
        "program policy: a program in a tool call idle longer than this x the 90th percentile of its own and "
        "its group's gaps between turns counts as ended and is the first to pause; 0 = off (the TTL only).",
        _nonneg, ">= 0", only_when="agentic_program_admission"),
    Key("admission_program_overdue_default_s", float, 60.0,
        "program policy: before any gap between turns has been seen, a program idle this long counts as "
        "ended, seconds.", _pos, "> 0", only_when="agentic_program_admission"),
    Key("admission_resume_deadline_s", float, 0.0,
        "program policy: a paused program's turn that has waited this long makes its own room, pausing "
        "programs in a tool call on its engine (0 = off: it waits for room; either way at most "
        "agentic_admission_max_wait_s), seconds.", _nonneg, ">= 0",
        only_when="agentic_program_admission"),
    Key("admission_program_max_resident", int, None,
        "program policy: at most this many programs hold KV on each engine (each data-parallel rank) at once; a "
        "new program waits in kvgate for a seat, a paused one takes the next free seat first; null = off.",
        lambda x: x >= 1, ">= 1 (or null: off)", nullable=True, only_when="agentic_program_admission",
        metavar="N"),
    Key("admission_host_cache", bool, True,
        "program policy: count the KV room each engine's HiCache host pool adds (from its /server_info) for "
        "programs between turns; the fifo policy never counts it."),
    Key("admission_program_ttl_s", float, 600.0,
        "program policy: a program idle this long between turns counts as ended, seconds.", _pos, "> 0",
        only_when="agentic_program_admission"),
    LEDGER,
    Key("admission_protected_rules", list, [],
        "Rules marking protected work: [{path: GLOB, field: NAME, equals: VALUE}].",
        lambda v: all(isinstance(x, dict) for x in v), "a list of mappings"),
    Key("admission_eval_rules", list, [],
        "Rules marking eval work (out of scope when scope=train), same shape as admission_protected_rules.",
        lambda v: all(isinstance(x, dict) for x in v), "a list of mappings"),
])

KEYS_BY_NAME = {k.name: k for k in KEYS}


# Rules between two keys (kvgate.config_orders): checked when both keys' ranges are.
ORDERS = (Order("admission_pause_stop_ratio", "admission_pause_start_ratio", high_off=0.0),
          Order("session_idle_floor_s", "session_idle_ceiling_s"))
_GATES = {k.name: k.only_when for k in KEYS}


def _type_name(t) -> str:
    if isinstance(t, tuple):
        return " or ".join(_type_name(x) for x in t)
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
            dict: "a mapping"}[t]


def _coerce(key: Key, value: Any) -> Any:
    if value is None:
        if key.nullable:
            return None
        raise ConfigError(f"{key.name}: expected {_type_name(key.type)}, got null")
    if key.type is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if key.type is int and isinstance(value, bool) or key.type is float and isinstance(value, bool):
        raise ConfigError(f"{key.name}: expected {_type_name(key.type)}, got {value!r}")
    if not isinstance(value, key.type):
        raise ConfigError(f"{key.name}: expected {_type_name(key.type)}, got {value!r}"
                          + (config_checks.yaml_float_hint(value) if key.type is float else ""))
    if key.type is float and not math.isfinite(value):
        raise ConfigError(f"{key.name}: expected a finite number, got {value!r}")
    if key.convert is not None:
        value = key.convert(key.name, value)
    if key.choices and value not in key.choices:
        raise ConfigError(f"{key.name}: must be one of {', '.join(key.choices)}, got {value!r}")
    return value


@dataclass
class Config:
    """The validated configuration. Attribute names are the YAML keys."""

    values: dict[str, Any] = field(default_factory=dict)
    # Lines about settings that are valid but will not do what they seem to (kvgate.config_checks).
    warnings: list[str] = field(default_factory=list)

    def __getattr__(self, name: str) -> Any:
        try:
            return self.__dict__["values"][name]
        except KeyError:
            raise AttributeError(name) from None

    def as_dict(self) -> dict[str, Any]:
        return dict(self.values)

    @property
    def decode_cap(self) -> int:
        """Completion tokens reserved per sequence at most (Relax's rule: defaults to max_response_length)."""
        cap = self.values["agentic_admission_expected_decode_cap"]
        return cap if cap is not None else self.values["max_response_length"]


def validate(raw: dict[str, Any]) -> Config:
    """Validate a flat mapping of keys to values and return a :class:`Config` with defaults filled in.

    Raises ConfigError with one line per problem, each naming its key, for every unknown key, wrong type or
    out-of-range value, a ``host`` that does not resolve, or (admission on) an ``admission_tokenizer_file``
    that cannot be loaded. A key whose value is refused is left out of the rules between keys.
    """
    return _validate(raw, [], set())


def _validate(raw: dict[str, Any], errors: list[str], failed: set[str]) -> Config:
    """:func:`validate`, adding to ``errors`` (lines said before, such as a flag that does not parse) and
    ``failed`` (keys whose value was refused: no rule between keys looks at them)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"config: expected a mapping of keys to values, got {type(raw).__name__}")

    def check(names: tuple[str, ...], fn: Callable[[], Any]) -> Any:
        """fn() unless a key of ``names`` was refused; its ConfigError is kept, and the first of ``names`` is
        then refused too. None when it did not run or raised."""
        if failed.intersection(names):
            return None
        try:
            return fn()
        except ConfigError as exc:
            errors.extend(exc.lines)
            failed.add(names[0])
            return None

    values: dict[str, Any] = {}
    for name, value in raw.items():
        key = KEYS_BY_NAME.get(name)
        if key is None:
            close = difflib.get_close_matches(str(name), KEYS_BY_NAME, n=3, cutoff=0.75)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            errors.append(f"{name}: unknown key{hint}")
            continue
        try:
            values[name] = _coerce(key, value)
        except ConfigError as exc:
            errors.extend(exc.lines)
            failed.add(name)
    for key in KEYS:
        values.setdefault(key.name, type(key.default)(key.default) if isinstance(key.default, (list, dict))
                          else key.default)
    for key in KEYS:
        value = values[key.name]
        if key.check is None or value is None or key.name in failed:
            continue
        if key.only_when and not values[key.only_when]:
            continue
        if not key.check(value):
            errors.append(f"{key.name}: must be {key.allowed}, got {value!r}")
            failed.add(key.name)
    if values["session_field_regex"] is not None and "session_field_regex" not in failed:
        if values["session_field"] is None:
            if "session_field" not in failed:
                errors.append("session_field_regex: needs session_field (the body field the regex is applied to)")
        else:
            try:
                re.compile(values["session_field_regex"])
            except re.error as exc:
                errors.append(f"session_field_regex: not a valid regular expression ({exc})")
    # the keys the user chose: given, and away from the default (a copy of configs/kvgate.yaml gives them all)
    written = {n for n in raw if n in KEYS_BY_NAME and n not in failed and values[n] != KEYS_BY_NAME[n].default}
    for order in ORDERS:
        if (not failed.intersection((order.low, order.high)) and config_orders.applies(order, values, _GATES)
                and config_orders.broken(order, values)):
            errors.append(config_orders.error(order, values, written))
    if values["workers"] > 1 and values["state_backend"] != "redis" and not failed & {"workers", "state_backend"}:
        errors.append(f"workers: {values['workers']} worker processes need state_backend: redis (with "
                      f"{values['state_backend']}, each process would keep its own sessions and admission ledger)")
    if "engines" not in failed:
        values["engines"] = [check(("engines",), lambda u=u: _url("engines", u)) or u for u in values["engines"]]
    for who in ("router", "engine"):
        # a key that cannot be read stops startup here, naming the key (never its value)
        check((f"{who}_api_key_file", f"{who}_api_key_env"), lambda who=who: api_key(values, who))
    api = config_checks.api_path(values["upstream"]) if "upstream" not in failed else None
    if api is not None:
        errors.append(f"upstream: {values['upstream']} ends in an API path ({api}); kvgate sends each request's "
                      f"own path (/v1/completions, /generate) to the router, so give its base URL "
                      f"({values['upstream'].removesuffix(api)})")
    if values["admin_key_file"] is not None:
        check(("admin_key_file",), lambda: read_admin_key(values["admin_key_file"]))
    if values["agentic_program_admission"] and values["admission_tokenizer_file"] is not None:
        check(("admission_tokenizer_file", "agentic_program_admission"),
              lambda: _tokenizer_file(values["admission_tokenizer_file"]))
    from kvgate.admission.policy import MatchRule
    for name in ("admission_protected_rules", "admission_eval_rules"):
        for rule in values[name] if name not in failed else ():
            try:
                MatchRule.from_config(rule)
            except ValueError as exc:
                errors.append(f"{name}: {exc} (a rule is {{path: GLOB, field: NAME, equals: VALUE}})")
                break  # one line per key: the first rule it cannot read
    if errors:
        raise ConfigError(*errors)
    warnings = config_checks.cross_key_warnings(values)
    warnings += config_checks.inert_warnings(values, {k.name: k.default for k in KEYS}, PLACEMENT_ROUTES,
                                             lambda name, value: _unchecked(name, value, values, written),
                                             {k.name for k in KEYS if k.group == PROGRAM.title})
    return Config(values, warnings)


def _unchecked(name: str, value: Any, values: dict[str, Any], written: set[str]) -> str | None:
    """What key ``name`` must be when the value it holds would be refused once its feature is on (a range, or
    a rule between keys, checked only while that feature is on: Key.only_when; validate skipped it), else
    None."""
    return _unchecked_range(name, value) or config_orders.unchecked(ORDERS, name, values, written, _GATES)


def _unchecked_range(name: str, value: Any) -> str | None:
    """The range ``value`` breaks for key ``name`` when that range is checked only while the key's feature is
    on (Key.only_when; validate skipped it), else None."""
    key = KEYS_BY_NAME[name]
    if key.only_when is None or key.check is None or value is None or key.check(value):
        return None
    return key.allowed


def load_yaml(path: str) -> dict[str, Any]:
    """Read a YAML config file into a flat mapping (empty file = no keys). Raises ConfigError."""
    return load_yaml_checked(path)[0]


def load_yaml_checked(path: str) -> tuple[dict[str, Any], list[str]]:
    """:func:`load_yaml` and the warnings about the file itself (a key given twice). Raises ConfigError."""
    try:
        with open(path, encoding="utf-8") as fh:
            data, duplicates = config_checks.load_with_duplicates(fh)
    except OSError as exc:
        raise ConfigError(f"config file {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        # the parser's own words (e.g. "while parsing a flow sequence ... expected ',' or ']'"), in one line
        what = " ".join(str(x) for x in (getattr(exc, "context", None), getattr(exc, "problem", None)) if x)
        ctx = getattr(exc, "context_mark", None)
        if ctx is not None and mark is not None and ctx.line != mark.line:
            what += f" (opened on line {ctx.line + 1})"
        raise ConfigError(f"config file {path}{where}: not valid YAML" + (f": {what}" if what else "")) from None
    if data is None:
        return {}, []
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: expected a mapping of keys to values")
    return data, config_checks.duplicate_warnings(path, duplicates, data)


def flag_name(key: str) -> str:
    return "--" + key.replace("_", "-")


def _flag_help(key: Key) -> str:
    """A key's help line with its built-in default in YAML terms (the flag's own default stays unset, so a
    YAML file's value is not overridden)."""
    default = yaml.safe_dump(key.default, default_flow_style=True, width=1 << 16).strip()
    default = default.removesuffix("\n...")  # a plain scalar's document end marker
    return f"{key.doc} (default: {default})".replace("%", "%%")


def add_flags(parser: argparse.ArgumentParser) -> None:
    """Add ``--config`` and one flag per key (default: unset, so YAML values are not overridden), each in the
    argument group of its key's Group (GROUPS order), so ``--help`` reads as sections."""
    parser.add_argument("--config", metavar="FILE", help="YAML config file (see configs/kvgate.yaml)")
    sections = {g.title: parser.add_argument_group(g.title, g.description) for g in GROUPS}
    for key in KEYS:
        kwargs: dict[str, Any] = {"dest": key.name, "default": None, "help": _flag_help(key)}
        if key.type is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif key.type is dict:
            kwargs["metavar"] = "YAML"
        elif key.type is list:
            if key.name in ("admission_protected_rules", "admission_eval_rules"):
                kwargs["metavar"] = "YAML"  # parsed in _from_flag, so a bad value is a one-line ConfigError
            else:
                kwargs["nargs"] = "*"
        else:
            kwargs["type"] = str
            kwargs["metavar"] = key.metavar or key.name.upper().split("_")[-1]
        sections[key.group].add_argument(flag_name(key.name), **kwargs)


def _from_flag(key: Key, text: Any) -> Any:
    if key.type is dict or key.type is list and key.name in ("admission_protected_rules", "admission_eval_rules"):
        try:
            return yaml.safe_load(text)
        except yaml.YAMLError:
            raise ConfigError(f"{key.name}: not valid YAML: {text!r}") from None
    if not isinstance(text, str):
        return text
    if key.nullable and text.lower() in ("null", "none", ""):
        return None
    try:
        if key.type is int:
            return int(text)
        if key.type is float:
            return float(text)
    except ValueError:
        raise ConfigError(f"{key.name}: expected {_type_name(key.type)}, got {text!r}") from None
    return text


def from_args(args: argparse.Namespace) -> Config:
    """Merge defaults, the YAML file named by ``args.config`` and the flags; validate. Raises ConfigError with
    every problem found (a file that is not YAML: that one)."""
    raw, file_warnings = load_yaml_checked(args.config) if getattr(args, "config", None) else ({}, [])
    errors: list[str] = []
    failed: set[str] = set()
    for key in KEYS:
        value = getattr(args, key.name, None)
        if value is not None:
            try:
                raw[key.name] = _from_flag(key, value)
            except ConfigError as exc:
                errors.extend(exc.lines)
                failed.add(key.name)
                raw.pop(key.name, None)  # the file's value is not what the user meant either
    cfg = _validate(raw, errors, failed)
    cfg.warnings[:0] = file_warnings
    return cfg


__all__ = ["Config", "ConfigError", "GROUPS", "KEYS", "ORDERS", "Order", "add_flags", "from_args", "load_yaml", "validate",
           "flag_name"]
