"""The bench scenario file (YAML) and its validation (pure).

A scenario names the arms to run, the fleet (engines, KV pool sizes, router policy), the speed factor, kvgate's
time settings at speed 1 (the speed module scales them) and the workload (``kind: agentic`` closed-loop
sessions or ``kind: mooncake`` open-loop trace window). See configs/bench/*.yaml for commented examples.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kvgate.bench.speed import split_load_monitor_interval

ARMS = ("direct", "direct-overload-off", "proxy-only", "lifecycle", "lifecycle-inferred", "admission", "lifecycle+admission",
        "lifecycle+admission-2replicas",
        "admission-program", "lifecycle+admission-program", "lifecycle+admission-program-thunder",
        "router-limit", "unbounded-kv", "hicache",
        "hicache+lifecycle", "hicache+lifecycle+admission", "hicache+lifecycle+admission-program",
        "hicache+lifecycle+admission-program-thunder",
        "hicache+lifecycle+admission-program-device", "proxy-placement", "smg-manual", "direct-no-overload",
        "router-sweep")
# The router configurations the ``router-sweep`` arm runs, router-only (no kvgate), each as arm router-<name>:
# the policies and options a user of smg 1.13 would try for agentic sessions (docs/compatibility.md). Worker
# overload protection is on by default in smg 1.13; "-noprot" turns it off. Sticky sessions and the hashing
# policies key on X-SMG-Routing-Key, which the bench's client sets to the session id.
DEFAULT_ROUTER_SWEEP = [
    {"name": name + ("-noprot" if off else ""), "policy": policy,
     "extra": extra + (["--disable-worker-overload-protection"] if off else [])}
    for name, policy, extra in (("cache_aware", "cache_aware", []),
                                ("cache_aware+sticky", "cache_aware", ["--sticky-sessions"]),
                                ("consistent_hashing", "consistent_hashing", []),
                                ("prefix_hash", "prefix_hash", []),
                                ("least_load", "least_load", []))
    for off in (False, True)]
_SWEEP_NAME = __import__("re").compile(r"[A-Za-z0-9_.+]+(-[A-Za-z0-9_.+]+)*")
# How the client sends its turns (the route): token ids to /generate, chat messages, or completions text.
APIS = ("generate", "chat", "completions")
# What serves the turns: kvgate's simulated engines, or real SGLang engines (CPU, kvgate.tools.sglang_engine)
ENGINES = ("sim", "sglang")

# kvgate settings that are durations (seconds at speed 1); speed.scale() divides every one by the factor.
KVGATE_TIME_DEFAULTS = {
    "session_idle_close_s": 300.0,
    "session_close_drain_s": 30.0,
    "discovery_interval_s": 10.0,
    "admission_poll_interval_s": 2.0,
    "agentic_admission_max_wait_s": 30.0,
    "admission_window_s": 60.0,
    "admission_lease_ttl_s": 3600.0,
    "admission_program_ttl_s": 600.0,
    "admission_program_overdue_default_s": 60.0,
    "admission_resume_deadline_s": 0.0,
}


@dataclass
class Scenario:
    """A parsed scenario. Durations are seconds at speed 1; token counts are tokens."""

    name: str
    arms: list[str]
    workload: dict
    seed: int = 0
    # each arm runs once per seed seed .. seed+replicates-1 (paired: replicate i is the same workload in every
    # arm); the report gives means, 95% intervals and tiers (kvgate.bench.ranking)
    replicates: int = 1
    speed: float = 1.0
    engines: int = 2
    # > 0: a prefill/decode (PD) fleet behind smg --pd-disaggregation: this many simulated prefill workers and
    # ``engines`` decode workers (each with max_total_num_tokens of KV); 0: ``engines`` regular engines
    prefill_engines: int = 0
    max_total_num_tokens: int = 200_000
    unbounded_max_total_num_tokens: int = 4_000_000
    router_policy: str = "cache_aware"
    # more smg flags, the same in every arm (e.g. ["--assignment-mode", "min_group"] for policy manual)
    router_extra: list[str] = field(default_factory=list)
    # more smg flags in the arms with kvgate in front (the router setup kvgate relies on, e.g. a PD fleet's
    # --decode-policy consistent_hashing, which lets kvgate name the decode worker it places a session on)
    kvgate_router_extra: list[str] = field(default_factory=list)
    # the router configurations of the router-sweep arm: [{name, policy, extra: [smg flags]}]
    router_sweep: list[dict] = field(default_factory=lambda: [dict(c) for c in DEFAULT_ROUTER_SWEEP])
    router_limits: list[int] = field(default_factory=lambda: [8, 16])
    router_queue_size: int = 10_000
    router_queue_timeout_s: float = 3600.0
    kvgate_times: dict = field(default_factory=lambda: dict(KVGATE_TIME_DEFAULTS))
    kvgate_extra: dict = field(default_factory=dict)
    sample_interval_s: float = 2.0
    sim_extra: dict = field(default_factory=dict)
    explicit_close: bool = True
    api: str = "generate"
    # sim: `kvgate sim-engine`; sglang: real SGLang engines (speed 1 only; started once, reused across runs with
    # a /flush_cache between them, restarted for another pool size), serving engine_profile's model
    engine: str = "sim"
    engine_profile: str = "mlp"
    engine_extra: list[str] = field(default_factory=list)   # more SGLang server flags, every engine
    # true: every turn sends ignore_eos (the engine reserves its whole max_new_tokens, so it never retracts);
    # false: min_new_tokens = max_new_tokens instead (the same output length, but SGLang reserves only
    # new_token_ratio of it for a running request, so decode can run out of KV and retract)
    ignore_eos: bool = True
    # named sets of kvgate settings: arm "ARM@NAME" is arm ARM (one with kvgate) with NAME's settings on top
    # (durations among them in seconds at speed 1, scaled like kvgate_times), to compare settings side by side
    arm_settings: dict = field(default_factory=dict)


WORKLOAD_KEYS = {
    "agentic": {"kind", "steps", "groups", "group_size", "task_prompt_tokens", "turns", "observation_tokens",
                "output_tokens", "tool_gap_s"},
    "mooncake": {"kind", "trace", "start_s", "duration_s"},
}


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


# key -> (check, what it must be); keys absent here are checked below (arms, workload, the extras)
_CHECKS = {
    "name": (lambda v: isinstance(v, str) and v != "", "a non-empty string"),
    "seed": (_is_int, "an integer"),
    "replicates": (lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
    "speed": (lambda v: _is_num(v) and v > 0, "a number > 0"),
    "engines": (lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
    "prefill_engines": (lambda v: _is_int(v) and v >= 0, "an integer >= 0 (prefill workers; 0: no PD)"),
    "max_total_num_tokens": (lambda v: _is_int(v) and v >= 1, "an integer >= 1 (tokens)"),
    "unbounded_max_total_num_tokens": (lambda v: _is_int(v) and v >= 1, "an integer >= 1 (tokens)"),
    "router_policy": (lambda v: isinstance(v, str) and v != "", "an smg --policy name"),
    "router_extra": (lambda v: isinstance(v, list) and all(isinstance(x, (str, int, float)) for x in v),
                     "a list of smg flags and values"),
    "kvgate_router_extra": (lambda v: isinstance(v, list) and all(isinstance(x, (str, int, float)) for x in v),
                            "a list of smg flags and values"),
    "router_sweep": (lambda v: isinstance(v, list) and v != [] and all(_sweep_entry_ok(c) for c in v)
                     and len({c["name"] for c in v}) == len(v),
                     "a non-empty list of {name, policy, extra} mappings with distinct names (letters, digits, "
                     "_ . + -), a policy name and a list of smg flags"),
    "router_limits": (lambda v: isinstance(v, list) and v != [] and all(_is_int(x) and x >= 1 for x in v),
                      "a non-empty list of integers >= 1"),
    "router_queue_size": (lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
    "router_queue_timeout_s": (lambda v: _is_num(v) and v > 0, "a number of seconds > 0"),
    "sample_interval_s": (lambda v: _is_num(v) and v > 0, "a number of seconds > 0"),
    "explicit_close": (lambda v: isinstance(v, bool), "true or false"),
    "api": (lambda v: v in APIS, "one of " + ", ".join(APIS)),
    "engine": (lambda v: v in ENGINES, "one of " + ", ".join(ENGINES)),
    "engine_profile": (lambda v: v in ("tiny", "mlp"), "tiny or mlp (kvgate/tools/sglang_cpu/make_model.py)"),
    "engine_extra": (lambda v: isinstance(v, list) and all(isinstance(x, (str, int, float)) for x in v),
                     "a list of SGLang server flags and values"),
    "ignore_eos": (lambda v: isinstance(v, bool), "true or false"),
    "kvgate_extra": (lambda v: isinstance(v, dict), "a mapping of kvgate config keys to values"),
    "sim_extra": (lambda v: isinstance(v, dict), "a mapping of kvgate sim-engine flags (as keys) to values"),
    "kvgate_times": (lambda v: isinstance(v, dict), "a mapping of kvgate time keys to seconds"),
    "arm_settings": (lambda v: isinstance(v, dict) and all(isinstance(k, str) and isinstance(x, dict)
                                                          for k, x in v.items()),
                     "a mapping of names to mappings of kvgate config keys to values"),
}


def _sweep_entry_ok(c) -> bool:
    return (isinstance(c, dict) and set(c) <= {"name", "policy", "extra"} and isinstance(c.get("name"), str)
            and _SWEEP_NAME.fullmatch(c["name"]) is not None and isinstance(c.get("policy"), str) and c["policy"] != ""
            and isinstance(c.get("extra", []), list) and all(isinstance(x, (str, int, float)) for x in c.get("extra", [])))


def parse_scenario(obj: dict[str, Any], name: str = "scenario") -> Scenario:
    """A Scenario from a YAML mapping, every key checked (type, range; workload keys; kvgate_extra against
    kvgate's config schema; sim_extra against the simulator's flags), so a typo stops the bench before any
    fleet starts. Raises ValueError naming the bad key."""
    if not isinstance(obj, dict):
        raise ValueError("scenario: must be a mapping")
    known = set(Scenario.__dataclass_fields__)
    unknown = set(obj) - known
    if unknown:
        raise ValueError(f"scenario: unknown keys {sorted(unknown)}")
    data = dict(obj)
    data.setdefault("name", name)
    for key, value in data.items():
        if key in _CHECKS and not _CHECKS[key][0](value):
            raise ValueError(f"{key}: must be {_CHECKS[key][1]}, got {value!r}")
    arms = data.get("arms")
    if not isinstance(arms, list) or not arms:
        raise ValueError(f"arms: must be a non-empty list of arms, got {arms!r}")
    settings = data.get("arm_settings") or {}
    for sname, keys in settings.items():
        try:
            _check_kvgate_extra(keys)
        except ValueError as exc:
            raise ValueError(f"arm_settings.{sname}: {exc}") from None
    bad = [a for a in arms if a.partition("@")[0] not in ARMS
           or "@" in a and a.partition("@")[2] not in settings]
    if bad:
        raise ValueError(f"arms: unknown {bad}; choose from {list(ARMS)}")
    wl = data.get("workload")
    if not isinstance(wl, dict) or wl.get("kind") not in WORKLOAD_KEYS:
        raise ValueError("workload: needs kind: agentic | mooncake")
    extra = set(wl) - WORKLOAD_KEYS[wl["kind"]]
    if extra:
        raise ValueError(f"workload: unknown keys {sorted(extra)} for kind {wl['kind']}; known "
                         f"{sorted(WORKLOAD_KEYS[wl['kind']])}")
    for k in ("steps", "groups", "group_size"):
        if k in wl and not (_is_int(wl[k]) and wl[k] >= 1):
            raise ValueError(f"workload.{k}: must be an integer >= 1, got {wl[k]!r}")
    times = dict(KVGATE_TIME_DEFAULTS)
    extra_times = data.get("kvgate_times") or {}
    for k, v in extra_times.items():
        if k not in KVGATE_TIME_DEFAULTS:
            raise ValueError(f"kvgate_times: unknown key {k}; known {sorted(KVGATE_TIME_DEFAULTS)}")
        if not (_is_num(v) and v >= 0):
            raise ValueError(f"kvgate_times.{k}: must be a number of seconds >= 0, got {v!r}")
    times.update({k: float(v) for k, v in extra_times.items()})
    data["kvgate_times"] = times
    check_engine(data.get("engine", "sim"), data.get("speed", 1.0), arms, data.get("api", "generate"))
    check_pd(data.get("prefill_engines", 0), data.get("engine", "sim"), arms)
    split_load_monitor_interval(data.get("router_extra") or [])  # the bench scales it: a bad value stops here
    _check_kvgate_extra(data.get("kvgate_extra") or {})
    _check_sim_extra(data.get("sim_extra") or {})
    return Scenario(**data)


def check_engine(engine: str, speed: float, arms: list[str], api: str) -> None:
    """Real engines run at their own pace (speed 1), with the arms and route they support here. Raises
    ValueError naming the key."""
    if engine != "sglang":
        return
    if speed != 1:
        raise ValueError(f"speed: must be 1 with engine: sglang (a real engine cannot run faster), got {speed!r}")
    hicache = [a for a in arms if a.startswith("hicache")]
    if hicache:
        raise ValueError(f"arms: {hicache} need HiCache engines, not run on the CPU engine (engine: sglang)")
    if api != "generate":
        raise ValueError(f"api: engine: sglang runs token ids to /generate, got {api!r}")


def check_pd(prefill_engines: int, engine: str, arms: list[str]) -> None:
    """A PD fleet (prefill_engines > 0) runs simulated workers (SGLang's PD mode does not run on the CPU engine,
    docs/real-engines.md) without HiCache (the simulator's prefill and decode workers do not model it). Raises
    ValueError naming the key."""
    if not prefill_engines:
        return
    if engine != "sim":
        raise ValueError("prefill_engines: a PD fleet needs engine: sim (SGLang's PD mode does not run on the CPU "
                         "engine, docs/real-engines.md)")
    hicache = [a for a in arms if a.startswith("hicache")]
    if hicache:
        raise ValueError(f"arms: {hicache} need HiCache engines; the simulator's PD workers do not model HiCache")


def _check_kvgate_extra(extra: dict) -> None:
    """kvgate_extra keys are kvgate config keys (kvgate.config): validate them with kvgate's own rules."""
    from kvgate.config import ConfigError, validate
    try:
        validate(dict(extra))
    except ConfigError as exc:
        raise ValueError(f"kvgate_extra: {'; '.join(exc.lines)}") from None


def sim_extra_flags(extra: dict) -> list[str]:
    """The ``kvgate sim-engine`` command-line flags for a scenario's sim_extra: key ``compute_profile`` -> flag
    ``--compute-profile``, then the value as text. The runner starts engines with these and the scenario check
    parses these, so the check sees exactly what the engines will."""
    return [x for k, v in extra.items() for x in ("--" + str(k).replace("_", "-"), str(v))]


def _check_sim_extra(extra: dict) -> None:
    """sim_extra keys are ``kvgate sim-engine`` flags: parse them with the simulator's own parser."""
    import argparse

    from kvgate.sim import args as sim_cli

    class _Parser(argparse.ArgumentParser):
        def error(self, message):  # raise instead of printing usage and exiting
            raise ValueError(f"sim_extra: {message}")

    p = _Parser(add_help=False)
    sim_cli.add_arguments(p)
    p.parse_args(sim_extra_flags(extra))


def load_scenario(path: str | Path) -> Scenario:
    """Read and parse a scenario file. Raises ValueError (bad YAML or a bad key, naming it) / OSError."""
    p = Path(path)
    try:
        obj = yaml.safe_load(p.read_text())
    except yaml.YAMLError as exc:
        raise ValueError(f"{p}: not valid YAML ({' '.join(str(exc).split())})") from None
    return parse_scenario(obj, name=p.stem)
