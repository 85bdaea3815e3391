"""The simulator beside the real engine: one markdown table from two `kvgate bench` runs of the same scenario
and seeds, one on real SGLang engines and one on the simulator.

    python scripts/fidelity_table.py ENGINE_RUN SIM_RUN     # each an --out directory or a results.json

Per arm: step makespan (mean over the seeds) on each and the simulator's error, recomputed prefill tokens,
cached tokens per turn, retractions and evicted tokens, and (runs that recorded it) the CPU seconds the engines and
the rest of the fleet (router, kvgate, the bench's client) used, with the simulated seconds the host contention
figures added; then whether the arms rank the same (the order of the
mean makespans, and the Scott-Knott tiers each run found).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROWS = [("makespan_s", "makespan s", "{:.1f}"), ("recomputed_prefill_tokens", "recomputed prefill", "{:,.0f}"),
        ("cached_per_turn", "cached tok/turn", "{:.0f}"), ("retractions", "retractions", "{:.1f}"),
        ("evicted_tokens", "evicted tok", "{:,.0f}")]


def load(where: str) -> dict:
    p = Path(where)
    return json.loads((p / "results.json" if p.is_dir() else p).read_text())


def _mean(m: dict, key: str):
    v = m.get(key)
    return v.get("mean") if isinstance(v, dict) else v


def _cpu(m: dict) -> tuple[float, float] | None:
    """(engines, everything else) CPU seconds of an arm, or None when the run did not record them."""
    c = m.get("cpu_s")
    if not isinstance(c, dict) or "engines" not in c:
        return None
    return c["engines"], sum(v for k, v in c.items() if k != "engines")


def table(engine: dict, sim: dict) -> str:
    """The markdown table and the ranking lines (the pure part)."""
    arms = [a for a in engine["metrics"] if a in sim["metrics"]]
    with_cpu = all(_cpu(r["metrics"][a]) is not None for a in arms for r in (engine, sim))
    head = ["arm"] + [f"{t} engine / sim" for _, t, _ in ROWS] + ["sim makespan error"]
    if with_cpu:
        head += ["engines' CPU s engine / sim", "router+kvgate+client CPU s engine / sim", "sim contention s"]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    worst = 0.0
    for a in arms:
        e, s = engine["metrics"][a], sim["metrics"][a]
        cells = [a]
        for k, _, f in ROWS:
            ev, sv = _mean(e, k), _mean(s, k)
            cells.append(" / ".join("-" if v is None else f.format(v) for v in (ev, sv)))
        em, sm = _mean(e, "makespan_s"), _mean(s, "makespan_s")
        err = (sm - em) / em if em else float("nan")
        worst = max(worst, abs(err))
        cells.append(f"{err:+.0%}")
        if with_cpu:
            (ee, eo), (se, so) = _cpu(e), _cpu(s)
            cells += [f"{ee:.1f} / {se:.1f}", f"{eo:.1f} / {so:.1f}",
                      "-" if s.get("host_contention_s") is None else f"{s['host_contention_s']:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    by = lambda r: sorted(arms, key=lambda a: _mean(r["metrics"][a], "makespan_s"))  # noqa: E731
    oe, os_ = by(engine), by(sim)
    lines.append("")
    lines.append(f"Order of the mean makespans: engine {' < '.join(oe)}; simulator {' < '.join(os_)} "
                 f"({'the same' if oe == os_ else 'DIFFERENT'}). Largest makespan error {worst:.0%}.")
    fmt = lambda ts: " < ".join("{" + ", ".join(t) + "}" if len(t) > 1 else t[0] for t in ts)  # noqa: E731
    te = [[a for a in t if a in arms] for t in engine.get("tiers") or []]
    ts = [[a for a in t if a in arms] for t in sim.get("tiers") or []]
    lines.append(f"Tiers (Scott-Knott, 99%): engine {fmt([t for t in te if t])}; simulator {fmt([t for t in ts if t])}.")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    print(table(load(argv[0]), load(argv[1])), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
