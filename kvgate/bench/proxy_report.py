"""The proxy hot-path benchmark's summary: medians over rounds, added cost per hop, ratios to smg (pure).

Input: one record per (round, arm, shape, mode) measured by ``kvgate bench-proxy`` (kvgate/bench/proxy_bench.py).
Added latency of a hop = its arm's p50 minus the p50 of the arm it sits in front of, in the same round: smg
adds p50(smg) - p50(direct); a kvgate arm adds p50(kvgate arm) - p50(smg) (``kvgate-nosmg`` talks to the stand-in
directly: it adds p50(kvgate-nosmg) - p50(direct); so do the placing arms, whose kvgate sends /generate to the
engine itself, taking smg's place). The reported figure is the median over rounds of those
per-round differences, so a noisy round moves one sample, not the whole comparison. Ratios divide a kvgate arm's
added latency by smg's. CPU per request (the proxy process group's user + system time over the requests it
relayed) is reported for the latency runs too: on a shared machine it is the steadier measure of a hop's work.
"""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

#: Arms in table order. "direct" talks to the upstream stand-in, "smg" to the router in front of it, every
#: kvgate arm to a kvgate in front of smg.
DIRECT, SMG = "direct", "smg"
NOSMG = "kvgate-nosmg"
#: nginx as a reverse proxy in front of smg, doing nothing else: the cost of one more hop on this machine.
NULL_PROXY = "nginx-proxy"
#: Arms where kvgate places /generate sessions itself and sends them to the engine: smg is not on their path,
#: so their hop replaces smg's and is compared with it (added over direct).
PLACING = ("placement", "placement+admission", "defaults+admission")
KVGATE_ARMS = ("kvgate-off", "lifecycle", "lifecycle+admission", *PLACING, NOSMG)
ARM_ORDER = (DIRECT, SMG, NULL_PROXY, *KVGATE_ARMS)
SHAPE_ORDER = ("small", "8k", "64k", "sse")
SHAPE_TITLES = {"small": "small /generate", "8k": "8K-token /generate", "64k": "64K-token /generate",
                "sse": "small /generate, SSE stream"}


@dataclass
class Sample:
    """One measurement. mode "latency": p50_us (microseconds at 1 connection); mode "throughput": rps
    (requests/second at many connections) and cpu_us_per_req (the proxy process's CPU per request, us;
    None for direct). errors: non-2xx answers and socket errors seen by the load generator."""

    round: int
    arm: str
    shape: str
    mode: str
    p50_us: float | None = None
    rps: float | None = None
    cpu_us_per_req: float | None = None
    requests: int = 0
    errors: int = 0


@dataclass
class Summary:
    """Medians over rounds. latency[shape][arm] = p50 us; added[shape][arm] = us added by that arm's own hop;
    ratio[shape][arm] = added / smg's added; rps[shape][arm]; cpu[shape][arm] us/request; errors summed."""

    latency: dict[str, dict[str, float]] = field(default_factory=dict)
    latency_cpu: dict[str, dict[str, float]] = field(default_factory=dict)
    added: dict[str, dict[str, float]] = field(default_factory=dict)
    ratio: dict[str, dict[str, float | None]] = field(default_factory=dict)
    # shape -> arm -> (lowest, highest) over rounds of its added latency / smg's in the same round: how far the
    # rounds spread around the median ratio (on a shared machine they can straddle a target)
    ratio_range: dict[str, dict[str, tuple[float, float]]] = field(default_factory=dict)
    rps: dict[str, dict[str, float]] = field(default_factory=dict)
    cpu: dict[str, dict[str, float]] = field(default_factory=dict)
    # shape -> "ARM-wN[@base]" -> (median, min, max) over rounds of its req/s / ARM-w1[@base]'s in the same round
    scaling: dict[str, dict[str, tuple[float, float, float]]] = field(default_factory=dict)
    errors: int = 0
    # "arm shape mode" -> load-generator errors summed over rounds, for the samples that had any
    errors_by: dict[str, int] = field(default_factory=dict)
    rounds: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"rounds": self.rounds, "errors": self.errors, "errors_by": self.errors_by, "p50_us": self.latency,
                "added_us": self.added, "ratio_to_smg": self.ratio,
                "ratio_to_smg_range_by_round": {s: {a: list(v) for a, v in d.items()} for s, d in self.ratio_range.items()},
                "max_rps": self.rps, "cpu_us_per_request": self.cpu,
                "cpu_us_per_request_one_connection": self.latency_cpu,
                "workers_scaling": {s: {a: list(v) for a, v in d.items()} for s, d in self.scaling.items()}}


def base_arm(arm: str) -> str:
    """The arm's name without its variant: "ARM@base" (a baseline tree) and "ARM-wN" (N worker processes)."""
    name = arm.partition("@")[0]
    m = re.search(r"-w\d+$", name)
    return name[:m.start()] if m else name


def front_of(arm: str) -> str | None:
    """The arm whose p50 ``arm``'s hop adds to: direct for smg, kvgate-nosmg and the arms where kvgate places
    sessions (smg is not on their path; their hop takes the place of smg's), smg for the other kvgate arms
    (and for every arm, its ``@base`` and ``-wN`` variants alike)."""
    if arm == DIRECT:
        return None
    return DIRECT if arm == SMG or base_arm(arm) in (NOSMG, *PLACING) else SMG


def _median(values: Iterable[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def summarise(samples: Iterable[Sample]) -> Summary:
    """Medians per (shape, arm) over rounds, then added latency and ratios (see the module doc)."""
    samples = list(samples)
    out = Summary(rounds=len({s.round for s in samples}))
    for s in samples:
        if s.errors:
            key = f"{s.arm} {s.shape} {s.mode}"
            out.errors_by[key] = out.errors_by.get(key, 0) + s.errors
    out.errors = sum(out.errors_by.values())
    groups: dict[tuple[str, str, str], list[Sample]] = {}
    for s in samples:
        groups.setdefault((s.mode, s.shape, s.arm), []).append(s)
    for (mode, shape, arm), group in groups.items():
        if mode == "latency":
            m = _median(s.p50_us for s in group)
            if m is not None:
                out.latency.setdefault(shape, {})[arm] = m
            cpu = _median(s.cpu_us_per_req for s in group)
            if cpu is not None:
                out.latency_cpu.setdefault(shape, {})[arm] = cpu
        else:
            rps = _median(s.rps for s in group)
            if rps is not None:
                out.rps.setdefault(shape, {})[arm] = rps
            cpu = _median(s.cpu_us_per_req for s in group)
            if cpu is not None:
                out.cpu.setdefault(shape, {})[arm] = cpu
    out.scaling = worker_scaling(samples)
    per_round: dict[tuple[str, int], dict[str, float]] = {}
    for s in samples:
        if s.mode == "latency" and s.p50_us is not None:
            per_round.setdefault((s.shape, s.round), {})[s.arm] = s.p50_us
    diffs: dict[str, dict[str, list[float]]] = {}
    round_ratios: dict[str, dict[str, list[float]]] = {}
    for (shape, _), lat in per_round.items():
        smg_added = lat[SMG] - lat[DIRECT] if SMG in lat and DIRECT in lat else None
        for arm, v in lat.items():
            front = front_of(arm)
            if front is not None and front in lat:
                diffs.setdefault(shape, {}).setdefault(arm, []).append(v - lat[front])
                if arm != SMG and smg_added is not None and smg_added > 0:
                    round_ratios.setdefault(shape, {}).setdefault(arm, []).append((v - lat[front]) / smg_added)
    out.ratio_range = {shape: {arm: (min(v), max(v)) for arm, v in by.items()} for shape, by in round_ratios.items()}
    for shape, by_arm in diffs.items():
        added = {arm: statistics.median(v) for arm, v in by_arm.items()}
        out.added[shape] = added
        smg_added = added.get(SMG)
        out.ratio[shape] = {arm: (a / smg_added if smg_added and smg_added > 0 else None)
                            for arm, a in added.items() if arm != SMG}
    return out


def worker_scaling(samples: Iterable[Sample]) -> dict[str, dict[str, tuple[float, float, float]]]:
    """For each throughput arm run with N > 1 workers ("ARM-wN", "ARM-wN@base"): its req/s divided by the
    one-worker arm's ("ARM-w1", same tree) in the same round, as (median, min, max) over the rounds. Per
    round, because the load on a shared machine moves between rounds more than between two arms of one."""
    per_round: dict[tuple[str, int], dict[str, float]] = {}
    for s in samples:
        if s.mode == "throughput" and s.rps:
            per_round.setdefault((s.shape, s.round), {})[s.arm] = s.rps
    ratios: dict[str, dict[str, list[float]]] = {}
    for (shape, _), rps in per_round.items():
        for arm, v in rps.items():
            name, at, tag = arm.partition("@")
            m = re.search(r"-w(\d+)$", name)
            if not m or m.group(1) == "1":
                continue
            one = f"{name[:m.start()]}-w1{at}{tag}"
            if rps.get(one):
                ratios.setdefault(shape, {}).setdefault(arm, []).append(v / rps[one])
    return {shape: {arm: (statistics.median(v), min(v), max(v)) for arm, v in by.items()}
            for shape, by in ratios.items()}


def _us(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v / 1000:.2f} ms" if abs(v) >= 1000 else f"{v:.0f} us"


def arm_order(arms: Iterable[str]) -> list[str]:
    """``arms`` in table order: ARM_ORDER first, then the others (baseline arms, "name@base") sorted after
    the arm they compare with."""
    def key(a: str) -> tuple[int, int, str]:
        name = base_arm(a)
        return (ARM_ORDER.index(name) if name in ARM_ORDER else len(ARM_ORDER), 1 if "@" in a else 0, a)
    return sorted(set(arms), key=key)


def markdown(summary: Summary, meta: Mapping[str, Any] | None = None) -> str:
    """The report: one row per request shape (added p50 per hop, ratio to smg), one throughput row per shape
    measured at many connections (req/s and the proxy's CPU us per request), and the run's settings."""
    arms = [a for a in arm_order(a for d in summary.latency.values() for a in d) if a != DIRECT]
    lines = []
    if meta:
        lines.append("Settings: " + ", ".join(f"{k} {v}" for k, v in meta.items()))
        lines.append("")
    head = ["request"] + [("smg adds" if a == SMG else f"{a} adds") for a in arms]
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "---|" * len(head))
    for shape in SHAPE_ORDER:
        if shape not in summary.latency:
            continue
        row = [f"{SHAPE_TITLES.get(shape, shape)}, p50"]
        for a in arms:
            added = summary.added.get(shape, {}).get(a)
            cell = _us(added)
            ratio = summary.ratio.get(shape, {}).get(a)
            if a != SMG and ratio is not None:
                cell += f" ({ratio:.2f}x)"
            row.append(cell)
        lines.append("| " + " | ".join(row) + " |")
        if summary.rounds > 1 and summary.ratio_range.get(shape):
            row = [f"{SHAPE_TITLES.get(shape, shape)}, p50 x smg's, lowest-highest round"]
            for a in arms:
                r = summary.ratio_range[shape].get(a)
                row.append("-" if r is None else f"{r[0]:.2f} to {r[1]:.2f}x")
            lines.append("| " + " | ".join(row) + " |")
    for shape in SHAPE_ORDER:
        if shape not in summary.rps:
            continue
        row = [f"{SHAPE_TITLES.get(shape, shape)}, max req/s (CPU/req)"]
        for a in arms:
            rps = summary.rps[shape].get(a)
            cpu = summary.cpu.get(shape, {}).get(a)
            row.append("-" if rps is None else f"{rps:,.0f}" + (f" ({cpu:.0f} us)" if cpu is not None else ""))
        lines.append("| " + " | ".join(row) + " |")
    for shape in SHAPE_ORDER:
        if shape not in summary.latency_cpu:
            continue
        cpu = summary.latency_cpu[shape]
        row = [f"{SHAPE_TITLES.get(shape, shape)}, CPU/req at 1 connection"]
        for a in arms:
            v = cpu.get(a)
            ratio = f" ({v / cpu[SMG]:.2f}x)" if v is not None and a != SMG and cpu.get(SMG) else ""
            row.append("-" if v is None else f"{_us(v)}{ratio}")
        lines.append("| " + " | ".join(row) + " |")
    for shape in SHAPE_ORDER:
        if shape not in summary.scaling:
            continue
        row = [f"{SHAPE_TITLES.get(shape, shape)}, req/s of N workers / 1 worker, per round"]
        for a in arms:
            v = summary.scaling[shape].get(a)
            row.append("-" if v is None else f"{v[0]:.2f}x ({v[1]:.2f}-{v[2]:.2f})")
        lines.append("| " + " | ".join(row) + " |")
    lines.append("")
    direct = {s: summary.latency[s].get(DIRECT) for s in SHAPE_ORDER if s in summary.latency}
    lines.append("Direct to the upstream stand-in, p50: " + ", ".join(f"{s} {_us(v)}" for s, v in direct.items())
                 + (f"; direct max req/s {summary.rps['small'].get(DIRECT, 0):,.0f}" if "small" in summary.rps else ""))
    where = "; ".join(f"{k}: {n}" for k, n in sorted(summary.errors_by.items()))
    lines.append(f"Medians over {summary.rounds} interleaved rounds; load-generator errors: {summary.errors}"
                 + (f" ({where}; those runs' figures are not a hop's cost)" if where else "") + ".")
    if NULL_PROXY in arms:
        lines.append("nginx-proxy: nginx as a reverse proxy in front of smg (one worker, kept-alive upstream "
                     "connections, no buffering), doing nothing else: what one more hop costs on this machine, "
                     "the floor for any proxy there. Not run on SSE: smg's delayed-ACK stall lands on nginx's "
                     "connection to smg as on wrk's.")
    if any(base_arm(a) in PLACING for a in arms):
        lines.append("The placing arms (kvgate places /generate sessions and sends them to the engine; smg is not on "
                     "their path) add their p50 over direct: their hop replaces smg's, so their ratio compares the two.")
    return "\n".join(lines) + "\n"
