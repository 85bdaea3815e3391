"""Configuration warnings: settings that are valid but will not do what they seem to (pure).

``kvgate check-config`` prints each warning and still answers ok; ``kvgate serve`` logs each at WARNING when
it starts. A warning never stops startup: an error does (kvgate.config.ConfigError). The kinds:

  - a key given twice in the YAML file (YAML loaders keep the last value without a word),
  - an ``upstream`` with a path: kvgate puts the path in front of every request's own path (a router
    mounted under a prefix behind another proxy works); one that ends in an API path (``/v1``) is refused
    instead (kvgate.config), since no router serves ``/v1/v1/completions``,
  - a key set to something other than its default while the feature it tunes is off (placement settings
    with no route placed by kvgate, admission numbers with admission off, Redis settings with
    ``state_backend: memory`` ...). A key left at its default is never warned about: the example config
    lists every key,
  - keys that disagree with each other (:func:`cross_key_warnings`): the program policy without session
    lifecycle or on several workers, a Redis session TTL not above the idle close, a router_policy no router
    knows.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Iterable
from urllib.parse import urlsplit

import yaml

# API paths an OpenAI-style base URL ends with: an upstream with one of them is a doubled path, always.
API_PATH_SUFFIXES = ("/v1", "/generate", "/v1/completions", "/v1/chat/completions", "/v1/responses")


class DuplicateKeyLoader(yaml.SafeLoader):
    """A safe YAML loader that records keys given twice in one mapping: ``duplicates`` holds
    (key, first line, repeated line), lines from 1. The last value wins, as in yaml.safe_load."""

    def __init__(self, stream):
        super().__init__(stream)
        self.duplicates: list[tuple[Any, int, int]] = []

    def construct_mapping(self, node, deep=False):
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            try:
                key = self.construct_object(key_node, deep=True)
                hash(key)
            except (TypeError, yaml.YAMLError):
                continue  # an unhashable key: SafeLoader's own error says so below
            line = key_node.start_mark.line + 1
            if key in seen:
                self.duplicates.append((key, seen[key], line))
            seen.setdefault(key, line)
        return super().construct_mapping(node, deep=deep)


def load_with_duplicates(stream) -> tuple[Any, list[tuple[Any, int, int]]]:
    """yaml.safe_load of ``stream`` and the keys it gives twice (see DuplicateKeyLoader). Raises YAMLError."""
    loader = DuplicateKeyLoader(stream)
    try:
        return loader.get_single_data(), loader.duplicates
    finally:
        loader.dispose()


def duplicate_warnings(path: str, duplicates: Iterable[tuple[Any, int, int]], data: Any) -> list[str]:
    """One line per key given twice in ``path``, naming both lines and the value kvgate uses (the last)."""
    out = []
    for key, first, again in duplicates:
        used = data.get(key) if isinstance(data, dict) else None
        out.append(f"{key}: given twice in {path} (lines {first} and {again}); the last value, {used!r}, is used")
    return out


def yaml_float_hint(value: Any) -> str:
    """For a number in exponent form that YAML read as text (YAML 1.1, PyYAML's: a float needs a dot and a signed
    exponent, so ``1e3`` and ``1.5e3`` are strings), how to write it so it reads as a number: `` (YAML reads 1e3 as
    text: write 1.0e+3)``; else ""."""
    m = re.fullmatch(r"([-+]?)(\d+)(?:\.(\d*))?[eE]([-+]?)(\d+)", value.strip()) if isinstance(value, str) else None
    if m is None:
        return ""
    sign, whole, frac, esign, exp = m.groups()
    return f" (YAML reads {value.strip()} as text: write {sign}{whole}.{frac or '0'}e{esign or '+'}{exp})"


def upstream_path(url: str) -> str:
    """The path of an upstream URL, without its trailing slash ("" for a base URL)."""
    return urlsplit(url).path.rstrip("/")


def api_path(url: str) -> str | None:
    """The API path an upstream URL ends with (``/v1``, ``/v1/completions`` ...), or None."""
    path = upstream_path(url)
    ends = [p for p in API_PATH_SUFFIXES if path.endswith(p)]
    return max(ends, key=len) if ends and url.rstrip("/").endswith(path) else None


def upstream_path_warning(url: str) -> str | None:
    """The warning for an upstream with a path kvgate honours as a prefix, or None for a plain base URL."""
    path = upstream_path(url)
    if not path:
        return None
    return (f"upstream: {url} has a path ({path}): every request goes to {path} + its own path "
            f"({path}/v1/completions, {path}/generate) and engines are discovered at {path}/workers; "
            f"a router's base URL has no path (http://HOST:PORT)")


def program_without_lifecycle_warning(values: dict[str, Any]) -> str | None:
    """The warning for the program policy with session lifecycle off (kvgate then knows no session, so there
    is no program to keep or pause), or None."""
    if (values["agentic_program_admission"] and values["admission_policy"] == "program"
            and not values["agentic_session_lifecycle"]):
        return ("admission_policy: program with agentic_session_lifecycle off: kvgate knows no sessions, so every "
                "request is a one-turn program (admitted when its engine has room, never paused); "
                "--agentic-session-lifecycle would make each session a program")
    return None


# The --policy names the routers kvgate fronts accept (smg 1.13; sglang-router 0.3.2's are among them).
ROUTER_POLICIES = ("random", "round_robin", "passthrough", "cache_aware", "power_of_two", "least_load", "manual",
                   "consistent_hashing", "prefix_hash")


def router_policy_warning(values: dict[str, Any]) -> str | None:
    """The warning for a ``router_policy`` no router kvgate fronts knows (its routing-key warning then says
    nothing true), with the nearest name, or None."""
    import difflib

    policy = values["router_policy"]
    if policy is None or policy in ROUTER_POLICIES:
        return None
    near = difflib.get_close_matches(policy.replace("-", "_").lower(), ROUTER_POLICIES, n=1, cutoff=0.6)
    return (f"router_policy: {policy!r} is not a router's --policy ({', '.join(ROUTER_POLICIES)})"
            + (f"; did you mean {near[0]}?" if near else "")
            + " (it tells kvgate how the router was started, for the routing-key warning)")


def redis_ttl_warning(values: dict[str, Any]) -> str | None:
    """The warning for ``redis_session_ttl_s`` at or below the idle close with replicas sharing Redis: a
    session's shared record (its activity, its engine) is gone before it is idle, so another replica may place
    it anew or close it while it lives on elsewhere; or None."""
    ttl = values["redis_session_ttl_s"]
    if values["session_idle_close_mode"] == "adaptive":  # the threshold goes up to the ceiling
        key, idle = "session_idle_ceiling_s", max(values["session_idle_close_s"], values["session_idle_ceiling_s"])
    else:
        key, idle = "session_idle_close_s", values["session_idle_close_s"]
    if values["state_backend"] != "redis" or not values["agentic_session_lifecycle"] or idle <= 0 or ttl > idle:
        return None
    return (f"redis_session_ttl_s: {ttl:g} is not above {key} ({idle:g}): a session's shared record (its activity "
            f"and engine) expires before the session is idle, so the replicas no longer agree on it; keep "
            f"redis_session_ttl_s above {key}")


def program_workers_warning(values: dict[str, Any]) -> str | None:
    """The warning for the program policy with several worker processes: each keeps its own working sets and
    the kernel spreads connections over them, so no worker sees a whole program; or None."""
    if values["workers"] > 1 and values["agentic_program_admission"] and values["admission_policy"] == "program":
        return (f"admission_policy: program with workers: {values['workers']}: each worker keeps its own working "
                f"sets and the kernel spreads connections over the workers, so each sees part of every program; "
                f"run one worker per kvgate with the program policy (replicas behind a load balancer with session "
                f"affinity, docs/replicas.md)")
    return None


def cross_key_warnings(values: dict[str, Any]) -> list[str]:
    """The warnings above for the validated ``values``, in order (None answers left out)."""
    return [w for w in (upstream_path_warning(values["upstream"]), program_without_lifecycle_warning(values),
                        program_workers_warning(values), redis_ttl_warning(values), router_policy_warning(values))
            if w]


def placeable(values: dict[str, Any], routes: Iterable[str]) -> bool:
    """Whether kvgate may place some route's session traffic itself (kvgate.fleet.placement.placement_active
    for a verdict that may come: ``kvgate`` always, ``auto`` with lifecycle on)."""
    modes = [values["session_placement_routes"].get(r, values["session_placement"]) for r in routes]
    return any(m == "kvgate" or (m == "auto" and values["agentic_session_lifecycle"]) for m in modes)


Rule = tuple[Callable[[str], bool], str, str | None]


def _rules(values: dict[str, Any], routes: tuple[str, ...], program_keys: Iterable[str] = ()) -> list[Rule]:
    """(which keys, why they do nothing now, the flag that would make them do something or None) for the
    current values; the first rule that names a key wins."""
    lifecycle = values["agentic_session_lifecycle"]
    admission = values["agentic_program_admission"]
    places = placeable(values, routes)
    names_session = lifecycle or any(
        values["session_placement_routes"].get(r, values["session_placement"]) == "kvgate" for r in routes)
    rules: list[Rule] = []
    lifecycle_on = "--agentic-session-lifecycle"
    if not places:
        why = ("agentic_session_lifecycle is off and no route has session_placement: kvgate" if not lifecycle
               else "session_placement is router on every route")
        rules.append((lambda k: k in ("placement_pressure_threshold", "placement_reopen_hint_s",
                                      "placement_busier_margin", "placement_session_growth"),
                      f"kvgate places no session traffic ({why})",
                      lifecycle_on if not lifecycle else
                      None if values["session_placement_routes"] else "--session-placement kvgate"))
    if not lifecycle:
        off = "agentic_session_lifecycle is off"
        rules.append((lambda k: k in ("session_placement", "session_placement_routes") and not places,
                      f"{off} (session_placement: auto places sessions only with lifecycle on)", lifecycle_on))
        rules.append((lambda k: k == "placement_reopen_hint_s", f"{off} (no session is ever closed)", lifecycle_on))
        rules.append((lambda k: k in ("session_resolution_order", "session_header", "session_field",
                                      "session_field_regex") and not names_session,
                      f"{off} and no route has session_placement: kvgate", lifecycle_on))
        rules.append((lambda k: k.startswith(("session_inference", "session_idle", "session_close", "close_"))
                      or k in ("set_routing_key", "routing_key_header", "router_policy"), off, lifecycle_on))
    else:
        if not values["session_inference"]:
            rules.append((lambda k: k.startswith("session_inference_"), "session_inference is off",
                          "--session-inference"))
        if values["session_idle_close_mode"] == "fixed":
            rules.append((lambda k: k in ("session_idle_quantile", "session_idle_multiple", "session_idle_floor_s",
                                          "session_idle_ceiling_s", "session_idle_min_samples"),
                          "session_idle_close_mode is fixed", "--session-idle-close-mode adaptive"))
        if not values["set_routing_key"]:
            rules.append((lambda k: k in ("routing_key_header", "router_policy"), "set_routing_key is off",
                          "--set-routing-key"))
    if not admission:
        polled = places  # the KV poller also runs for session placement
        rules.append((lambda k: (k.startswith(("agentic_admission_", "admission_")) or k == "max_response_length")
                      and not (polled and k in ("admission_poll_interval_s", "admission_capacity_source")),
                      "agentic_program_admission is off", "--agentic-program-admission"))
    elif values["admission_policy"] == "fifo":
        rules.append((lambda k: k in program_keys, "admission_policy is fifo (a program policy key)",
                      "--admission-policy program"))
    else:
        rules.append((lambda k: k == "admission_backfill", "admission_policy is program (a fifo policy key)",
                      "--admission-policy fifo"))
        if values["admission_pause_start_ratio"] == 0:  # pausing always on: nothing starts or stops it
            rules.append((lambda k: k in ("admission_pause_stop_ratio", "admission_foresee_cycles"),
                          "admission_pause_start_ratio is 0 (pausing is always on)", None))
        wait = values["agentic_admission_max_wait_s"]
        if values["admission_resume_deadline_s"] >= wait:
            # the wait bound lets the turn bypass (and overflow the engine) before the deadline makes its room
            rules.append((lambda k: k == "admission_resume_deadline_s",
                          f"agentic_admission_max_wait_s ({wait:g} s) is not above it: a waiting turn bypasses "
                          "first", None))
    if values["state_backend"] == "memory":
        rules.append((lambda k: k.startswith("redis_"), "state_backend is memory", "--state-backend redis"))
    return rules


def inert_warnings(values: dict[str, Any], defaults: dict[str, Any], routes: tuple[str, ...],
                   unchecked: Callable[[str, Any], str | None] = lambda key, value: None,
                   program_keys: Iterable[str] = ()) -> list[str]:
    """One line per key set away from its default that does nothing with the other values, in key order:
    the key, its value, why it does nothing, the flag that would make it do something and, when ``unchecked``
    (key, value) gives the range the value breaks (a range checked only while the key's feature is on), that
    the value would then be refused: ``agentic_admission_headroom: set to 1.5, but it does nothing while
    agentic_program_admission is off; --agentic-program-admission would enable it, and then 1.5 would be refused
    (it must be in (0, 1])``. ``program_keys``: the program policy's keys, which do nothing under the fifo policy."""
    rules = _rules(values, routes, frozenset(program_keys))
    out = []
    for key, default in defaults.items():
        value = values.get(key, default)
        if value == default:
            continue
        for applies, why, enable in rules:
            if applies(key):
                line = f"{key}: set to {value!r}, but it does nothing while {why}"
                if enable:
                    line += f"; {enable} would enable it"
                    broken = unchecked(key, value)
                    if broken:
                        line += f", and then {value!r} would be refused (it must be {broken})"
                out.append(line)
                break
    return out
