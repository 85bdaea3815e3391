"""Summarize the per-arm raw records of a bench run that was dumped before it finished (a JSON {"raws": {arm:
[raw, ...]}}), with the same report.summarize / aggregate / tiers as `kvgate bench`. Usage:
    python scripts/partial_results.py DUMP.json SCENARIO.yaml [OUT.json]"""
import json
import sys

from kvgate.bench import report
from kvgate.bench.command import _workload
from kvgate.bench.scenario import load_scenario


def main(argv):
    raws = json.load(open(argv[0]))["raws"]
    sc = load_scenario(argv[1])
    ideal = {}
    per_rep = {}
    for arm, rs in raws.items():
        for r in rs:
            seed = r["seed"]
            if seed not in ideal:
                ideal[seed] = _workload(sc, seed)[1]
            per_rep.setdefault(arm, []).append(report.summarize(r, sc.speed, ideal[seed]))
    metrics = {a: report.aggregate(ms) for a, ms in per_rep.items() if ms}
    full = {a: m for a, m in metrics.items() if m["replicates"] == max(x["replicates"] for x in metrics.values())}
    tiers, se, df = report.ranked_tiers(full) if len(full) > 1 else ([[a] for a in full], None, 0)
    for a, ms in per_rep.items():
        m = metrics[a]
        print(f"{a}: seeds {[r['seed'] for r in raws[a]]} makespans {[round(x['makespan_s'], 1) for x in ms]} "
              f"mean {m['makespan_s']:.1f}; recomputed {m['recomputed_prefill_tokens']:.0f}; cached/turn "
              f"{m['cached_per_turn']:.0f}; retract {m['retractions']:.1f}; evicted {m['evicted_tokens']:.0f}; "
              f"hit {m['cache_hit_rate']:.1%}; pauses {m['pause_resume']}; errors {m['errors']:.0f}; "
              f"load {[r.get('loadavg') for r in raws[a]]}")
    print("tiers over the arms with the most seeds:", tiers, "se", se)
    if len(argv) > 2:
        json.dump({"metrics": metrics, "tiers": tiers, "metrics_by_seed": per_rep, "se_of_mean_s": se},
                  open(argv[2], "w"), indent=1, default=str)


if __name__ == "__main__":
    main(sys.argv[1:])
