"""Print the compact per-arm table docs/benchmark.md quotes from a bench run: ``python scripts/bench_readme_table.py
DIR`` (DIR holds results.json from ``kvgate bench``; a results file such as docs/bench/kvb-A.json works too).
Every figure is the mean over the run's seeds."""

import json
import sys

from kvgate.bench.command import results_path
from kvgate.bench.ranking import mean_ci, tier_text
from kvgate.bench.report import vs_base


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    try:
        res = json.loads(results_path(argv[0]).read_text())
        metrics = res["metrics"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"bench_readme_table: {argv[0]}: no kvgate bench results.json ({exc})", file=sys.stderr)
        return 2
    diffs = vs_base(metrics, "direct")
    print("| arm | step makespan s | vs direct s | session mean s | turn p50 s | TTFT p50 / p99 s | prefix hit | "
          "recomputed prefill | kvgate queue p50 / p99 s | admit/wait/bypass |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    def f(fmt: str, v) -> str:
        return "-" if v is None else fmt.format(v)

    for arm, m in metrics.items():
        reps = [x for x in (m.get("makespan_s_reps") or []) if x is not None]
        if m.get("failed") or m.get("errors") or not reps:
            span = "did not finish"
        else:
            mean, hw = mean_ci(reps)
            span = f"{mean:.0f} ± {hw:.0f}" if hw is not None else f"{mean:.0f}"
        vs = "-"
        if arm in diffs:
            d, dhw = diffs[arm]
            vs = f"{d:+.0f} ± {dhw:.0f}" if dhw is not None else f"{d:+.0f}"
        q = (f"{m['queue_p50_s']:.1f} / {m['queue_p99_s']:.1f}" if m.get("queue_p50_s") is not None else "-")
        print(f"| {arm} | {span} | {vs} | {f('{:.0f}', m.get('session_mean_s'))} | "
              f"{f('{:.1f}', m.get('turn_p50_s'))} | "
              f"{f('{:.1f}', m.get('ttft_p50_s'))} / {f('{:.1f}', m.get('ttft_p99_s'))} | "
              f"{f('{:.1%}', m.get('cache_hit_rate'))} | {f('{:,.0f}', m.get('recomputed_prefill_tokens'))} | {q} | "
              f"{m.get('admit_wait_bypass', '-')} |")
    print()
    print(f"Ranking: {tier_text(res['tiers'])}; wall {res['wall_s']:.0f} s, seeds {res['seeds']}, "
          f"speed {res['speed']:g}")
    if res.get("compare"):
        print(res["compare"]["text"].strip())
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
