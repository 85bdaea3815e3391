"""``kvgate bench`` / ``python -m kvgate.bench.cli``: run a scenario's arms, each on a fresh fleet, and write
DIR/results.json, DIR/report.md and PNG plots.

``add_arguments(parser)`` registers the flags; ``run(args) -> int`` runs (0 = every arm finished without
errors, 1 = some arm had errors or timed out, 2 = bad scenario / missing router).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from importlib import resources
from pathlib import Path

from kvgate import procs
from kvgate.bench import report
from kvgate.bench.runner import expand_arms, run_arm
from kvgate.bench.scenario import load_scenario
from kvgate.bench.speed import scale
from kvgate.bench.workload import (ideal_prefill_agentic, ideal_prefill_mooncake, plan_agentic, plan_mooncake,
                                   plan_summary)
from kvgate.trace import read_trace


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Register the bench flags on ``p``."""
    p.add_argument("--scenario", required=True, help="scenario file (configs/bench/*.yaml)")
    p.add_argument("--out", required=True, help="output directory (created)")
    p.add_argument("--arms", default=None, help="comma-separated subset of the scenario's arms")
    p.add_argument("--speed", type=float, default=None, help="override the scenario's speed factor")
    p.add_argument("--seed", type=int, default=None, help="override the scenario's seed")
    p.add_argument("--arm-timeout-s", type=float, default=600.0, help="wall-clock limit per arm, seconds")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _workload(sc):
    """(plan, ideal prefill tokens, summary) for the scenario's workload."""
    wl = sc.workload
    if wl["kind"] == "agentic":
        plans = plan_agentic(wl, sc.seed)
        return plans, ideal_prefill_agentic(plans), plan_summary(plans)
    path = wl.get("trace") or str(resources.files("kvgate") / "data" / "mooncake_slice.jsonl")
    records = read_trace(path, int(float(wl.get("start_s", 0)) * 1000), int(float(wl.get("duration_s", 60)) * 1000))
    reqs = plan_mooncake(records)
    return reqs, ideal_prefill_mooncake(records), {
        "requests": len(reqs), "sessions": len({r.session_id for r in reqs}),
        "prompt_tokens": sum(len(r.prompt) for r in reqs), "output_tokens": sum(r.max_tokens for r in reqs),
        "window_s": [wl.get("start_s", 0), wl.get("duration_s", 60)]}


def _clean(x):
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_clean(v) for v in x]
    return x


def run(args: argparse.Namespace) -> int:
    """Run the bench; see the module docstring for the exit codes."""
    try:
        sc = load_scenario(args.scenario)
    except (OSError, ValueError) as exc:
        print(f"kvgate bench: {exc}", file=sys.stderr)
        return 2
    if args.speed is not None:
        sc.speed = args.speed
    if args.seed is not None:
        sc.seed = args.seed
    if procs.find_executable("smg") is None:
        print("kvgate bench: the smg router is not installed (pip install smg)", file=sys.stderr)
        return 2
    arms = expand_arms(sc)
    if args.arms:
        wanted = set(args.arms.split(","))
        arms = [a for a in arms if a.name in wanted or a.name.rsplit("-", 1)[0] in wanted]
    scaled = scale(sc.speed, sc.kvgate_times, sc.router_queue_timeout_s, sc.sample_interval_s)
    plan, ideal, summary = _workload(sc)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    n_req = summary["requests"]
    print(f"kvgate bench: scenario {sc.name}, speed {sc.speed:g}, seed {sc.seed}, {len(arms)} arms, "
          f"{n_req} requests per arm; workload {json.dumps(summary)}", flush=True)
    bar = None
    if not args.no_progress:
        try:
            from tqdm import tqdm
            bar = tqdm(total=n_req * len(arms), unit="req", dynamic_ncols=True)
        except ImportError:  # the bar is a nicety
            bar = None

    def progress() -> None:
        if bar is not None:
            bar.update(1)

    raws: dict[str, dict] = {}
    metrics: dict[str, dict] = {}
    t_all = time.monotonic()
    for arm in arms:
        if bar is not None:
            bar.set_description(arm.name)
        else:
            print(f"  arm {arm.name} ...", flush=True)
        t = time.monotonic()
        try:
            raw = run_arm(sc, arm, scaled, plan, out / "logs" / arm.name, progress, args.arm_timeout_s)
        except (RuntimeError, TimeoutError, OSError) as exc:
            print(f"kvgate bench: arm {arm.name} failed to run: {exc}", file=sys.stderr)
            raw = {"arm": arm.name, "failed": str(exc), "requests": [], "sessions": [], "steps": [],
                   "samples": [], "sim_totals": {}, "kvgate_counters": None, "wall_s": 0.0, "timed_out": False}
        raw["arm_wall_s"] = time.monotonic() - t
        raws[arm.name] = raw
        metrics[arm.name] = report.summarize(raw, sc.speed, ideal)
    if bar is not None:
        bar.close()
    wall = time.monotonic() - t_all
    header = (f"Scenario `{sc.name}`: speed factor {sc.speed:g} (times below are simulated seconds = wall x "
              f"{sc.speed:g}), seed {sc.seed}, {sc.engines} engines x {sc.max_total_num_tokens:,} KV tokens "
              f"(unbounded-kv: {sc.unbounded_max_total_num_tokens:,}), smg policy {sc.router_policy}; "
              f"{n_req} requests per arm; bench wall time {wall:.0f} s on {platform.machine()} "
              f"({_cores()} cores).\n")
    md = report.markdown(metrics, header)
    md += f"\nRanking by step makespan: {' < '.join(report.ranking(metrics))}\n"
    md += "\nPer-arm wall time (s): " + ", ".join(f"{a} {r['arm_wall_s']:.0f}" for a, r in raws.items()) + "\n"
    (out / "report.md").write_text(md)
    try:
        files = __import__("kvgate.bench.plots", fromlist=["write_all"]).write_all(raws, metrics, sc.speed, out)
    except ImportError as exc:
        files = []
        print(f"kvgate bench: no plots ({exc}; pip install matplotlib)", file=sys.stderr)
    results = {"scenario": sc.__dict__, "speed": sc.speed, "scaled": scaled.__dict__, "workload": summary,
               "ideal_prefill_tokens": ideal, "wall_s": wall, "metrics": metrics,
               "ranking": report.ranking(metrics), "plots": files,
               "arms": {a: {k: v for k, v in r.items()} for a, r in raws.items()}}
    (out / "results.json").write_text(json.dumps(_clean(results), indent=1, default=str))
    print(md)
    print(f"kvgate bench: wrote {out / 'report.md'}, {out / 'results.json'} and {len(files)} plots "
          f"in {wall:.0f} s", flush=True)
    bad = any(m["errors"] for m in metrics.values()) or any(r.get("timed_out") or r.get("failed")
                                                            for r in raws.values())
    return 1 if bad else 0


def _cores() -> int:
    import os
    return os.cpu_count() or 0


def main(argv=None) -> int:
    """Standalone entry: ``python -m kvgate.bench.cli``."""
    p = argparse.ArgumentParser(prog="kvgate bench", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
