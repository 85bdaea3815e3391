"""The bench scenario file (YAML) and its validation (pure).

A scenario names the arms to run, the fleet (engines, KV pool sizes, router policy), the speed factor, kvgate's
time settings at speed 1 (the speed module scales them) and the workload (``kind: agentic`` closed-loop
sessions or ``kind: mooncake`` open-loop trace window). See configs/bench/*.yaml for commented examples.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

ARMS = ("direct", "proxy-only", "lifecycle", "lifecycle-inferred", "admission", "lifecycle+admission", "router-limit",
        "unbounded-kv")

# kvgate settings that are durations (seconds at speed 1); speed.scale() divides every one by the factor.
KVGATE_TIME_DEFAULTS = {
    "session_idle_close_s": 300.0,
    "session_close_drain_s": 30.0,
    "discovery_interval_s": 10.0,
    "admission_poll_interval_s": 2.0,
    "agentic_admission_max_wait_s": 30.0,
    "admission_window_s": 60.0,
    "admission_lease_ttl_s": 3600.0,
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
    max_total_num_tokens: int = 200_000
    unbounded_max_total_num_tokens: int = 4_000_000
    router_policy: str = "cache_aware"
    # more smg flags, the same in every arm (e.g. ["--assignment-mode", "min_group"] for policy manual)
    router_extra: list[str] = field(default_factory=list)
    router_limits: list[int] = field(default_factory=lambda: [8, 16])
    router_queue_size: int = 10_000
    router_queue_timeout_s: float = 3600.0
    kvgate_times: dict = field(default_factory=lambda: dict(KVGATE_TIME_DEFAULTS))
    kvgate_extra: dict = field(default_factory=dict)
    sample_interval_s: float = 2.0
    sim_extra: dict = field(default_factory=dict)
    explicit_close: bool = True


def parse_scenario(obj: dict[str, Any], name: str = "scenario") -> Scenario:
    """A Scenario from a YAML mapping. Raises ValueError naming the bad key."""
    if not isinstance(obj, dict):
        raise ValueError("scenario: must be a mapping")
    known = set(Scenario.__dataclass_fields__)
    unknown = set(obj) - known
    if unknown:
        raise ValueError(f"scenario: unknown keys {sorted(unknown)}")
    data = dict(obj)
    data.setdefault("name", name)
    if "arms" not in data or not data["arms"]:
        raise ValueError("arms: at least one arm is needed")
    bad = [a for a in data["arms"] if a not in ARMS]
    if bad:
        raise ValueError(f"arms: unknown {bad}; choose from {list(ARMS)}")
    wl = data.get("workload")
    if not isinstance(wl, dict) or wl.get("kind") not in ("agentic", "mooncake"):
        raise ValueError("workload: needs kind: agentic | mooncake")
    times = dict(KVGATE_TIME_DEFAULTS)
    extra_times = data.get("kvgate_times") or {}
    for k in extra_times:
        if k not in KVGATE_TIME_DEFAULTS:
            raise ValueError(f"kvgate_times: unknown key {k}; known {sorted(KVGATE_TIME_DEFAULTS)}")
    times.update({k: float(v) for k, v in extra_times.items()})
    data["kvgate_times"] = times
    sc = Scenario(**data)
    if not sc.speed > 0:
        raise ValueError(f"speed: must be > 0, got {sc.speed}")
    if not isinstance(sc.replicates, int) or sc.replicates < 1:
        raise ValueError(f"replicates: must be an integer >= 1, got {sc.replicates!r}")
    if sc.engines < 1:
        raise ValueError("engines: must be >= 1")
    return sc


def load_scenario(path: str | Path) -> Scenario:
    """Read and parse a scenario file. Raises ValueError / OSError."""
    p = Path(path)
    return parse_scenario(yaml.safe_load(p.read_text()), name=p.stem)
