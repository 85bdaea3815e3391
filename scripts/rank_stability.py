"""How often would two runs of a bench scenario rank the arms the same? A Monte-Carlo estimate from one run.

``python scripts/rank_stability.py DIR [--runs 300] [--shrink 1.0]`` reads DIR/results.json (or a results file
such as docs/bench/kvb-A.json) of a replicated ``kvgate bench`` run, fits the seeds-as-blocks model (arm effect +
seed effect + noise, kvgate.bench.ranking.block_mse), draws pairs of synthetic runs from it and ranks each with
the bench's own rule (kvgate.bench.ranking.tiers) and, for comparison, with a pairwise rule (an arm joins the
current tier while its mean is within Tukey's HSD at 95% of the tier's best). Prints, per rule, how often the two
runs' tiers are identical and how often no pair of arms is ordered oppositely. ``--shrink`` scales the arms'
observed differences from the grand mean (the observed spread includes noise, so the truth is likely smaller; 0.5
is a fair guess); unbounded-kv keeps its full difference.
"""

import argparse
import json
import math
import random

from scipy.stats import studentized_range

from kvgate.bench.command import results_path
from kvgate.bench.ranking import block_mse, contradictions, same_ranking, tiers
from kvgate.bench.report import aggregate, failed_arms


def hsd_tiers(samples: dict[str, list[float]]) -> list[list[str]]:
    """The pairwise rule the bench does not use, for comparison."""
    mse, df = block_mse(samples)
    r = len(next(iter(samples.values())))
    hsd = studentized_range.ppf(0.95, len(samples), df) * math.sqrt(mse / r)
    means = {a: sum(v) / r for a, v in samples.items()}
    out: list[list[str]] = []
    for a in sorted(means, key=means.get):
        if out and means[a] - means[out[-1][0]] <= hsd:
            out[-1].append(a)
        else:
            out.append([a])
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dir")
    p.add_argument("--runs", type=int, default=300)
    p.add_argument("--shrink", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=1)
    a = p.parse_args()
    if a.runs < 1:
        p.error("--runs must be >= 1")
    try:
        res = json.loads(results_path(a.dir).read_text())
        by_seed = res["metrics_by_seed"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        p.error(f"{a.dir}: no kvgate bench results.json with metrics_by_seed ({exc})")

    # arms that ran every seed to the end without errors: the bench's own rule (report.failed_arms)
    metrics = {arm: aggregate(ms) for arm, ms in by_seed.items() if ms}
    failed = set(failed_arms(metrics))
    data = {arm: m["makespan_s_reps"] for arm, m in metrics.items() if arm not in failed}
    r = min((len(v) for v in data.values()), default=0)
    if len(data) < 2 or r < 2:
        p.error(f"{a.dir}: needs at least 2 arms that finished on at least 2 seeds (replicates >= 2); "
                f"has {len(data)} arms x {r} seeds")
    arms = list(data)
    mse, _ = block_mse(data)
    means = {x: sum(v) / r for x, v in data.items()}
    grand = sum(means.values()) / len(arms)
    seed_eff = [sum(data[x][j] for x in arms) / len(arms) - grand for j in range(r)]
    truth = {x: grand + (means[x] - grand) * (1.0 if x == "unbounded-kv" else a.shrink) for x in arms}
    sd = math.sqrt(mse)
    rng = random.Random(a.seed)

    def draw():
        return {x: [truth[x] + seed_eff[j] + rng.gauss(0, sd) for j in range(r)] for x in arms}

    print(f"{a.dir}: {len(arms)} arms x {r} seeds, residual sd {sd:.1f} s, shrink {a.shrink}")
    for name, rule in (("bench (Scott-Knott 99%)", tiers), ("pairwise HSD 95%", hsd_tiers)):
        same = agree = 0
        for _ in range(a.runs):
            t1, t2 = rule(draw()), rule(draw())
            same += same_ranking(t1, t2)
            agree += not contradictions(t1, t2)
        print(f"  {name:24s} identical tiers {same / a.runs:.0%}, no pair ordered oppositely {agree / a.runs:.0%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
