"""``kvgate bench`` / ``python -m kvgate.bench.command``: run a scenario's arms, each on a fresh fleet, and write
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

from kvgate.tools import procs
from kvgate.tools.sglang_engine import SGLANG_VERSION
from kvgate.bench import ranking, report
from kvgate.bench.runner import API_PATHS, expand_arms, run_arm
from kvgate.bench.scenario import ARMS, check_engine, load_scenario
from kvgate.bench.speed import scale, split_load_monitor_interval
from kvgate.bench.workload import (ideal_prefill_agentic, ideal_prefill_mooncake, plan_agentic, plan_mooncake,
                                   plan_summary)
from kvgate.bench.trace import read_trace
from kvgate.sim.fit import sim_settings


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Register the bench flags on ``p``."""
    p.add_argument("--scenario", required=True, help="scenario file (configs/bench/*.yaml)")
    p.add_argument("--out", required=True, help="output directory (created)")
    p.add_argument("--arms", default=None, help="comma-separated subset of the scenario's arms")
    p.add_argument("--speed", type=float, default=None, help="override the scenario's speed factor")
    p.add_argument("--seed", type=int, default=None, help="override the scenario's (first) seed")
    p.add_argument("--replicates", type=int, default=None,
                   help="override the scenario's replicates (seeds per arm)")
    p.add_argument("--compare", default=None, metavar="DIR",
                   help="an earlier run's output directory: say whether this run ranks the arms the same")
    p.add_argument("--arm-timeout-s", type=float, default=600.0, help="wall-clock limit per arm, seconds")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--engine", choices=["sim", "sglang"], default=None,
                   help="override the scenario's engine: sim (kvgate sim-engine) or sglang (real CPU SGLang engines, "
                        "speed 1; needs the engine environment, scripts/setup-engine.sh)")
    p.add_argument("--sim-fit", action="append", default=[], metavar="FILE",
                   help="simulated engines take their compute constants (and host contention) from this file, as "
                        "scripts/fit_engine_profile.py writes it for the machine at hand; over the scenario's "
                        "sim_extra; may be given twice (a fit and a --contention measurement)")


def _workload(sc, seed: int):
    """(plan, ideal prefill tokens, summary) for the scenario's workload drawn with ``seed``."""
    wl = sc.workload
    if wl["kind"] == "agentic":
        plans = plan_agentic(wl, seed)
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


def _sim_fit(path: str) -> dict:
    """sim_extra settings from a fit file (kvgate.sim.fit.sim_settings). Raises ValueError naming the file."""
    try:
        data = json.loads(Path(path).read_text())
        return sim_settings(data)
    except (OSError, ValueError) as e:
        raise ValueError(f"--sim-fit {path}: {e}") from None


def run(args: argparse.Namespace) -> int:
    """Run the bench; see the module docstring for the exit codes."""
    try:
        sc = load_scenario(args.scenario)
        if args.replicates is not None:
            if args.replicates < 1:
                raise ValueError(f"--replicates: must be >= 1, got {args.replicates}")
            sc.replicates = args.replicates
        if args.speed is not None:
            if not (math.isfinite(args.speed) and args.speed > 0):
                raise ValueError(f"--speed: must be a number > 0, got {args.speed}")
            sc.speed = args.speed
        if args.seed is not None:
            sc.seed = args.seed
        if getattr(args, "engine", None) is not None:
            sc.engine = args.engine
        for f in getattr(args, "sim_fit", None) or []:
            sc.sim_extra = {**sc.sim_extra, **_sim_fit(f)}
        check_engine(sc.engine, sc.speed, sc.arms, sc.api)
        if not args.arm_timeout_s > 0:
            raise ValueError(f"--arm-timeout-s: must be > 0, got {args.arm_timeout_s}")
        if Path(args.out).exists() and not Path(args.out).is_dir():
            raise ValueError(f"--out: {args.out} exists and is not a directory")
        previous = _load_previous(args.compare) if args.compare is not None else None
        arms = expand_arms(sc)
        if args.arms is not None:
            sc.arms, wanted = _pick_arms(args.arms)
            missing = [a for a in sc.arms if "@" in a and a.partition("@")[2] not in sc.arm_settings]
            if missing:
                raise ValueError(f"--arms: {missing[0]!r}: the scenario's arm_settings has no "
                                 f"{missing[0].partition('@')[2]!r}")
            arms = [a for a in expand_arms(sc) if a.name in wanted or a.group in wanted
                    or (a.group == "router-limit" and a.name.rsplit("-", 1)[0] in wanted)]
            if not arms:
                raise ValueError(f"--arms {args.arms}: no arm to run (router-limit-N needs N in router_limits: "
                                 f"{sc.router_limits})")
        seeds = [sc.seed + i for i in range(sc.replicates)]
        # every workload is drawn before any fleet starts: a bad distribution stops the bench here
        if sc.workload["kind"] == "agentic":
            workloads = [_workload(sc, seed) for seed in seeds]  # (plan, ideal prefill, summary) per replicate
        else:  # a trace window has no seed: read it once, repeat it
            workloads = [_workload(sc, sc.seed)] * len(seeds)
    except (OSError, ValueError) as exc:
        print(f"kvgate bench: {exc}", file=sys.stderr)
        return 2
    if not procs.smg_installed():
        print("kvgate bench: the smg router is not installed (pip install smg)", file=sys.stderr)
        return 2
    pool = None
    if sc.engine == "sglang":
        from kvgate.bench.sglang_fleet import EnginePool
        from kvgate.tools.sglang_engine import unavailable_reason
        why = unavailable_reason()
        if why:
            print(f"kvgate bench: engine: sglang needs a real engine here: {why}", file=sys.stderr)
            return 2
        pool = EnginePool(sc.engines, sc.engine_profile, Path(args.out) / "logs" / "engines", sc.engine_extra)
    try:
        return _run(args, sc, arms, seeds, workloads, previous, pool)
    finally:
        if pool is not None:
            pool.stop()


def run_order(arms: list, seeds: list[int], real: bool) -> list[tuple[int, object]]:
    """(seed index, arm) in run order: replicate-major, so every arm sees replicate i before any sees i+1 and a
    slow drift of the machine spreads over all arms. On real engines (a start takes 20 s on a quiet machine,
    minutes on a busy one) the runs are grouped by KV pool size first, smallest first, replicate-major within
    a group, so the engines start once per pool size (unbounded-kv's runs come last)."""
    out = [(i, a) for i, _ in enumerate(seeds) for a in arms]
    if real:
        out.sort(key=lambda p: p[1].pool_tokens)  # stable: replicate-major within a pool size
    return out


def _run(args, sc, arms, seeds, workloads, previous, pool) -> int:
    scaled = scale(sc.speed, sc.kvgate_times, sc.router_queue_timeout_s, sc.sample_interval_s,
                   split_load_monitor_interval(sc.router_extra)[1])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    n_req = sum(w[2]["requests"] for w in workloads)
    print(f"kvgate bench: scenario {sc.name}, speed {sc.speed:g}, seeds {seeds}, {len(arms)} arms, "
          f"{n_req} requests per arm; workload {json.dumps(workloads[0][2])}", flush=True)
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

    raws: dict[str, list[dict]] = {a.name: [] for a in arms}
    per_rep: dict[str, list[dict]] = {a.name: [] for a in arms}
    t_all = time.monotonic()
    # replicate-major order: every arm sees replicate i before any arm sees replicate i+1, so a slow drift of
    # the machine spreads over all arms instead of landing on the last ones
    for i, arm in run_order(arms, seeds, pool is not None):
        seed, (plan, ideal, _) = seeds[i], workloads[i]
        label = arm.name if len(seeds) == 1 else f"{arm.name} seed {seed}"
        if bar is not None:
            bar.set_description(label)
        else:
            print(f"  arm {label} ...", flush=True)
        log_dir = out / "logs" / (arm.name if len(seeds) == 1 else f"{arm.name}-seed{seed}")
        t = time.monotonic()
        try:
            raw = run_arm(sc, arm, scaled, plan, log_dir, progress, args.arm_timeout_s, pool)
        except (RuntimeError, TimeoutError, OSError) as exc:
            print(f"kvgate bench: arm {label} failed to run: {exc}", file=sys.stderr)
            raw = {"arm": arm.name, "failed": str(exc), "requests": [], "sessions": [], "steps": [],
                   "samples": [], "sim_totals": {}, "kvgate_counters": None, "wall_s": 0.0, "timed_out": False}
        if raw.get("timed_out"):
            print(f"kvgate bench: arm {label} timed out after {args.arm_timeout_s:g} s wall (--arm-timeout-s); "
                  "its figures cover only what finished and it ranks last", file=sys.stderr)
        raw["arm_wall_s"] = time.monotonic() - t
        raw["seed"] = seed
        raws[arm.name].append(raw)
        per_rep[arm.name].append(report.summarize(raw, sc.speed, ideal))
    if bar is not None:
        bar.close()
    wall = time.monotonic() - t_all
    metrics = {a: report.aggregate(ms) for a, ms in per_rep.items()}
    # smg at its best: the router configuration of the sweep that finished soonest becomes ``direct``, the
    # baseline every kvgate arm is compared with (unless the run has a ``direct`` arm of its own)
    sweep_arms = {a.name: a for a in arms if a.group == "router-sweep"}
    sweep_md, best = report.router_sweep_markdown(metrics, list(sweep_arms))
    best_router = None
    if best is not None:
        spec = sweep_arms[best]
        best_router = {"arm": best, "policy": spec.router_policy,
                       "extra": [str(x) for x in sc.router_extra] + list(spec.router_flags)}
        if "direct" not in metrics:
            metrics = {"direct": metrics.pop(best), **metrics}
            per_rep = {"direct": per_rep.pop(best), **per_rep}
            raws = {"direct": raws.pop(best), **raws}
            best_router["renamed_to"] = "direct"
    tiers, se, se_df = report.ranked_tiers(metrics)
    order = report.ranking(metrics)  # plain order of the means (for Kendall tau against another run)
    summary = workloads[0][2] if len(workloads) == 1 else {"replicates": [w[2] for w in workloads]}
    per_seed = (f"{'/'.join(str(w[2]['requests']) for w in workloads)} requests per arm for the seeds"
                if len(seeds) > 1 else f"{n_req} requests per arm")
    clock = (f"real SGLang {SGLANG_VERSION} engines on the CPU (model profile `{sc.engine_profile}`), times in wall "
             f"seconds; {pool.starts if pool else 0} engine starts, flushed between runs; load average (1 min) "
             f"{_load_range(raws)} over the runs" if sc.engine == "sglang" else
             f"speed factor {sc.speed:g} (times below are simulated seconds = wall x {sc.speed:g})")
    header = (f"Scenario `{sc.name}`: {clock}, seed{'s' if len(seeds) > 1 else ''} {', '.join(map(str, seeds))}, "
              + (f"{sc.prefill_engines} prefill + {sc.engines} decode workers (PD, smg --pd-disaggregation) "
                 if sc.prefill_engines else f"{sc.engines} engines ")
              + f"x {sc.max_total_num_tokens:,} KV tokens "
              f"(unbounded-kv: {sc.unbounded_max_total_num_tokens:,}), smg policy {sc.router_policy}"
              + (f" (with kvgate: {' '.join(map(str, sc.kvgate_router_extra))})" if sc.kvgate_router_extra else "")
              + ", turns sent "
              f"to {API_PATHS[sc.api]}; "
              f"{per_seed}; bench wall time {wall:.0f} s on {platform.machine()} ({_cores()} cores, load average "
              f"{_load()})."
              + _replicate_note(sc.workload["kind"], len(seeds))
              + (f" `direct` is the best router configuration of the sweep, {best} (smg --policy "
                 f"{best_router['policy']} {' '.join(best_router['extra'])})."
                 if best_router and best_router.get("renamed_to") else "") + "\n")
    md = report.markdown(metrics, header)
    md += sweep_md
    md += report.placement_markdown(metrics, sc.router_policy)
    md += _ranking_text(tiers, len(seeds), se, se_df, report.failed_arms(metrics))
    comparison = None
    if previous is not None:
        comparison = _compare(tiers, order, previous, sc.name)
        md += comparison["text"]
    md += "\nPer-arm wall time (s): " + ", ".join(
        f"{a} {sum(r['arm_wall_s'] for r in rs):.0f}" for a, rs in raws.items()) + "\n"
    (out / "report.md").write_text(md)
    try:
        files = __import__("kvgate.bench.plots", fromlist=["write_all"]).write_all(raws, metrics, sc.speed, out)
    except ImportError as exc:
        files = []
        print(f"kvgate bench: no plots ({exc}; pip install matplotlib)", file=sys.stderr)
    results = {"scenario": sc.__dict__, "speed": sc.speed, "seeds": seeds, "scaled": scaled.__dict__,
               "workload": summary, "ideal_prefill_tokens": [w[1] for w in workloads], "wall_s": wall,
               "metrics": metrics, "metrics_by_seed": per_rep, "tiers": tiers, "se_of_mean_s": se, "se_df": se_df,
               "ranking": order, "best_router": best_router,
               "compare": comparison, "plots": files, "arms": raws}
    (out / "results.json").write_text(json.dumps(_clean(results), indent=1, default=str))
    print(md)
    print(f"kvgate bench: wrote {out / 'report.md'}, {out / 'results.json'} and {len(files)} plots "
          f"in {wall:.0f} s", flush=True)
    bad = any(m["errors"] for m in metrics.values()) or any(r.get("timed_out") or r.get("failed")
                                                            for rs in raws.values() for r in rs)
    return 1 if bad else 0


def _load() -> str:
    """The 1, 5 and 15 minute load averages (how busy the shared machine was), or "unknown"."""
    try:
        import os
        return "/".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "unknown"


def _load_range(raws: dict) -> str:
    """The lowest and highest 1-minute load average sampled at the start and end of the runs."""
    xs = [la[0] for rs in raws.values() for r in rs for la in (r.get("loadavg") or []) if la]
    return f"{min(xs):.1f}-{max(xs):.1f}" if xs else "unknown"


def _replicate_note(kind: str, n: int) -> str:
    if n == 1:
        return ""
    if kind == "mooncake":  # a trace window has no seed: replicates repeat it, measuring run-to-run noise
        return f" Every figure is the mean over {n} repeats of the same trace window (the seed does not change it)."
    return " Every figure is the mean over the seeds; each seed is one workload, the same in every arm."


def _pick_arms(spec: str) -> tuple[list[str], set[str]]:
    """--arms a,b,router-limit-8: (the scenario arms to expand, the names to keep). Any known arm may be named,
    also one the scenario's own list leaves out; router-limit-N keeps only that limit. Raises ValueError."""
    wanted = [w.strip() for w in spec.split(",") if w.strip()]
    if not wanted:
        raise ValueError(f"--arms: no arm named in {spec!r}; choose from {list(ARMS)}")
    base = []
    for w in wanted:
        b = (w if w in ARMS or w.partition("@")[0] in ARMS  # ARM@NAME: arm_settings
             else "router-limit" if w.startswith("router-limit-") else "router-sweep" if w.startswith("router-") else w)
        if b.partition("@")[0] not in ARMS:
            raise ValueError(f"--arms: unknown arm {w!r}; choose from {list(ARMS)} (router-limit-N for one limit, "
                             f"router-NAME for one router-sweep configuration)")
        if b not in base:
            base.append(b)
    return base, set(wanted)


def _ranking_text(tiers: list[list[str]], n_seeds: int, se: float | None, df: int, failed: list[str]) -> str:
    out = ""
    if n_seeds == 1:
        out = (f"\nRanking by step makespan: {ranking.tier_text(tiers)} (one seed: no confidence intervals, so "
               "arms closer than the run-to-run noise may swap between runs; set replicates >= 3)\n")
    elif se is None:
        out = (f"\nRanking by step makespan: {ranking.tier_text(tiers)} (fewer than two arms finished on every "
               "seed: nothing to test)\n")
    else:
        out = (f"\nRanking by step makespan: {ranking.tier_text(tiers)}\n\nBraces hold arms the {n_seeds} seeds "
               "cannot tell apart: tiers are Scott-Knott groups of the mean makespans at 99% (seeds as blocks; the "
               f"residual noise gives each arm's mean a standard error of {se:.1f} s, {df} degrees of freedom). An "
               "arm ranks below another only when they are in different tiers.\n")
    if failed:
        out += (f"\nDid not finish (errors, a timeout or a fleet that failed to start; ranked last, not compared): "
                f"{', '.join(failed)}. See logs/ and the errors column.\n")
    return out


def results_path(where: str) -> Path:
    """DIR/results.json of a bench run's --out directory, or ``where`` itself when it names a results file
    (docs/bench/*.json keep the runs docs/benchmark.md quotes)."""
    p = Path(where)
    return p / "results.json" if p.is_dir() else p


def _load_previous(path: str) -> dict:
    """The results.json of an earlier run (a directory or the file). Raises OSError / ValueError naming
    --compare."""
    p = results_path(path)
    try:
        res = json.loads(p.read_text())
    except FileNotFoundError:
        raise ValueError(f"--compare: {p} not found (give an earlier run's --out directory)") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--compare: cannot read {p} ({exc})") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"--compare: {p} is not JSON ({exc})") from None
    def names(x) -> bool:
        return isinstance(x, list) and all(isinstance(a, str) for a in x)
    tiers = res.get("tiers") if isinstance(res, dict) else None
    if not isinstance(res, dict) or not names(res.get("ranking")) \
            or not (tiers is None or (isinstance(tiers, list) and all(names(t) for t in tiers))):
        raise ValueError(f"--compare: {p} is not a kvgate bench results.json")
    res["_path"] = str(p)
    return res


def _compare(tiers: list[list[str]], order: list[str], previous: dict, scenario: str | None = None) -> dict:
    """This run's tiers and mean order against an earlier run's: the same tiers? any pair the two runs order
    oppositely? ``same_ranking`` is None when the runs share fewer than two arms (nothing to compare)."""
    prev_tiers = previous.get("tiers") or [[a] for a in previous["ranking"]]
    common = {a for t in tiers for a in t} & {a for t in prev_tiers for a in t}
    prev_name = (previous.get("scenario") or {}).get("name") if isinstance(previous.get("scenario"), dict) else None
    note = (f" (that run was scenario {prev_name}, this one {scenario})"
            if prev_name and scenario and prev_name != scenario else "")
    if len(common) < 2:
        text = (f"\nCompared with {previous['_path']}: nothing to compare, the runs share {len(common)} arm(s)"
                f"{note}.\n")
        return {"previous": previous["_path"], "same_ranking": None, "contradictions": [], "kendall_tau": None,
                "common_arms": sorted(common), "previous_tiers": prev_tiers, "text": text}
    same = ranking.same_ranking(tiers, prev_tiers)
    against = ranking.contradictions(tiers, prev_tiers)
    tau = ranking.kendall_tau(order, previous["ranking"])
    only = "" if len(common) == len({a for t in tiers for a in t}) else f" over the {len(common)} arms in common"
    text = (f"\nCompared with {previous['_path']}{note} (then: {ranking.tier_text(prev_tiers)}): "
            f"{'the same' if same else 'a DIFFERENT'} ranking{only}; "
            + (f"{len(against)} pairs ordered oppositely ({', '.join(f'{x} < {y}' for x, y in against)} here)"
               if against else "no pair of arms ordered oppositely")
            + f"; Kendall tau of the mean makespan orders {tau:.2f}.\n")
    return {"previous": previous["_path"], "same_ranking": same, "contradictions": against, "kendall_tau": tau,
            "common_arms": sorted(common), "previous_tiers": prev_tiers, "text": text}


def _cores() -> int:
    import os
    return os.cpu_count() or 0


def main(argv=None) -> int:
    """Standalone entry: ``python -m kvgate.bench.command``."""
    p = argparse.ArgumentParser(prog="kvgate bench", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
