"""The least prefill any KV-bounded policy must recompute on an agentic bench run's own timeline.

Reads a `kvgate bench` results.json that still holds its raw records (the run's directory, before
`scripts/save_bench.py` drops them) and, for one arm (by default `unbounded-kv`, whose timeline no KV limit
shaped), builds each session's live context over time from its turns:

- during a turn, from its first token (its prefill done) to its end, the session holds its prompt: it must be
  resident;
- between turns, from one turn's end to the next turn's first token (the tool call, then the queue), it holds
  prompt + output, which a policy may keep resident or drop; dropped, the next turn re-prefills it (the
  recompute);
- a GRPO group's shared task prompt is counted once, and only while one of its sessions is in a turn.

A fractional linear program (scipy's HiGHS) then keeps as much of the between-turn contexts resident as the
fleet's KV pool (engines x max_total_num_tokens, one pool: a per-engine split only constrains more) allows at
every moment, beside the turns in progress. What it cannot keep is a lower bound on the recompute of any policy
that runs the same timeline with that pool and no KV kept elsewhere. A policy may change the timeline (pause
programs, so fewer contexts are live at once); then the bound holds only for that timeline, and the pauses cost
time instead. With the engines' prefill rate (tokens/s, the fleet's), the recompute is also given in seconds of
fleet prefill.

    python scripts/kv_floor.py RESULTS_JSON [--arm unbounded-kv] [--prefill-tokens-per-s 21600] [--pool-fraction 1.0]

Token counts come from the engines' answers (a `/generate` run's meta_info): a run of text turns whose answers
carried no usage counts characters, and is refused. ``--pool-fraction F`` asks what a pool of F x the fleet's would
have to recompute (how much of the pool a policy's recompute corresponds to).

Prints, per seed: the peak of the live contexts (tokens), the share of the run they exceed the pool, the
recompute floor (tokens and seconds), and the arm's own recomputed prefill for comparison (the bench's
recomputed prefill: prefill computed beyond each distinct prompt token once; the floor is on top of that
ideal, so the two compare directly).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path


def group_of(session: str) -> str:
    """The GRPO group of a bench session id (``st{step}-g{group}-s{index}``): all but the last part."""
    return session.rsplit("-", 1)[0]


def timeline(requests: list[dict]) -> tuple[list[tuple[float, float, int]], list[tuple[float, float, int]], int]:
    """(resident, gaps, peak) from a run's request records:

    - resident: what must be in KV, as (from, to, tokens): each turn from its first token (its prefill done:
      the time before it, queued in the engine, holds nothing the policy could not drop) to its end, its
      prompt less its group's shared task prompt; and each group's shared task prompt (one copy, the least
      first prompt of its sessions) while any of its sessions is in such a turn;
    - gaps: what a policy may keep or drop, as (from, to, tokens): each session's prompt + output from one
      turn's end to the next turn's first token, less the shared task prompt;
    - peak: the largest sum of the two at any moment (tokens).
    Counting each turn's prompt without its output, and the shared prompt once, the demand is never more than
    the run's: the floor computed from it stays a lower bound."""
    by_session: dict[str, list[dict]] = defaultdict(list)
    for r in requests:
        if r.get("ok") and r.get("end") is not None and r.get("prompt_tokens"):
            by_session[r["session"]].append(r)
    shared: dict[str, int] = {}
    for sid, rs in by_session.items():
        rs.sort(key=lambda r: r["turn"])
        g = group_of(sid)
        shared[g] = min(shared.get(g, rs[0]["prompt_tokens"]), rs[0]["prompt_tokens"])

    def first_token(r: dict) -> float:
        # the records' ttft is a time, not a span; without one (no token streamed) the turn is taken as resident
        # from its end only, and the gap before it as lasting until then: never more demand than the run's
        return r["ttft"] if r.get("ttft") is not None else r["end"]

    resident, gaps = [], []
    in_turn: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for sid, rs in by_session.items():
        g = group_of(sid)
        own = shared[g]
        for k, r in enumerate(rs):
            resident.append((first_token(r), r["end"], max(0, r["prompt_tokens"] - own)))
            in_turn[g].append((first_token(r), r["end"]))
            if k + 1 < len(rs) and first_token(rs[k + 1]) > r["end"]:
                gaps.append((r["end"], first_token(rs[k + 1]),
                             max(0, r["prompt_tokens"] + (r.get("output_tokens") or 0) - own)))
    for g, spans in in_turn.items():  # the union of the group's turns: its shared prompt resident then
        spans.sort()
        lo, hi = spans[0]
        for s, e in spans[1:]:
            if s > hi:
                resident.append((lo, hi, shared[g]))
                lo = s
            hi = max(hi, e)
        resident.append((lo, hi, shared[g]))
    return resident, gaps, max((live for _, live in _live(resident + gaps)), default=0)


def _live(spans) -> list[tuple[float, int]]:
    """The sum of ``spans`` ((from, to, tokens)) over time: (time, the sum from then on), one per span end."""
    out, live = [], 0
    for t, d in sorted([(s, c) for s, _, c in spans] + [(e, -c) for _, e, c in spans]):
        live += d
        out.append((t, live))
    return out


def floor(turns, gaps, pool: int) -> tuple[int, float]:
    """(the least tokens of the gaps' contexts that cannot stay resident, the share of the run's time the live
    contexts exceed ``pool``): the fractional LP max sum(c x) s.t. at every moment sum(c x of the gaps open) <=
    pool - sum(``turns``: what must be resident then), 0 <= x <= 1. A fraction kept is a prefix of the context
    kept (the radix cache evicts a context's tail first), so the fractional optimum is a floor too."""
    import numpy as np
    from scipy.optimize import linprog
    from scipy.sparse import lil_matrix

    if not gaps:
        return 0, 0.0
    # between two such points the gaps open are the same and what must be resident only falls: the load is
    # highest at a point where a gap or a resident span starts (checked there, every one of them)
    points = sorted({s for s, _, _ in gaps} | {s for s, _, _ in turns})
    idx = {t: i for i, t in enumerate(points)}
    fixed = np.zeros(len(points))
    for s, e, c in turns:  # the turns in progress at each point
        lo = np.searchsorted(points, s, side="left")
        hi = np.searchsorted(points, e, side="left")
        fixed[lo:hi] += c
    a = lil_matrix((len(points), len(gaps)))
    for j, (s, e, c) in enumerate(gaps):
        lo, hi = idx[s], int(np.searchsorted(points, e, side="left"))
        for i in range(lo, hi):
            a[i, j] = c
    cap = np.maximum(0.0, pool - fixed)
    cost = -np.array([c for _, _, c in gaps], dtype=float)
    res = linprog(cost, A_ub=a.tocsr(), b_ub=cap, bounds=(0, 1), method="highs")
    if res.status != 0:
        raise SystemExit(f"kv_floor: the linear program did not solve: {res.message}")
    kept = -res.fun
    total = -cost.sum()
    # the share of time the live contexts exceed the pool
    changes = _live(turns + gaps)
    over = sum(t1 - t0 for (t0, live), (t1, _) in zip(changes, changes[1:]) if live > pool)
    span = changes[-1][0] - changes[0][0]
    return int(round(total - kept)), over / span if span > 0 else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", help="a kvgate bench results.json with its raw records (arms)")
    ap.add_argument("--arm", default="unbounded-kv")
    ap.add_argument("--pool-fraction", type=float, default=1.0,
                    help="the pool as a fraction of the fleet's (engines x max_total_num_tokens; default 1.0)")
    ap.add_argument("--prefill-tokens-per-s", type=float, default=None,
                    help="the fleet's prefill rate, to give the floor in seconds (default: the scenario's "
                         "sim_extra prefill_tokens_per_s x engines)")
    args = ap.parse_args()
    data = json.loads(Path(args.results).read_text())
    sc = data["scenario"]
    raws = (data.get("arms") or {}).get(args.arm)
    if not raws:
        raise SystemExit(f"kv_floor: {args.results} holds no raw records of arm {args.arm!r} "
                         f"(arms with records: {sorted(k for k, v in (data.get('arms') or {}).items() if v)})")
    if sc.get("api", "generate") != "generate":
        raise SystemExit(f"kv_floor: {args.results} sent its turns to {sc.get('api')!r}: its records count the "
                         f"answers' characters, not tokens; the floor needs a /generate run (api: generate)")
    if not args.pool_fraction > 0:
        raise SystemExit(f"kv_floor: --pool-fraction must be > 0, got {args.pool_fraction}")
    pool = int(int(sc["engines"]) * int(sc["max_total_num_tokens"]) * args.pool_fraction)
    rate = args.prefill_tokens_per_s or float((sc.get("sim_extra") or {}).get("prefill_tokens_per_s", 0)) * int(
        sc["engines"])
    seeds = data.get("seeds") or list(range(len(raws)))
    print(f"arm {args.arm}, pool {pool:,} tokens ({args.pool_fraction:g} x {sc['engines']} x "
          f"{int(sc['max_total_num_tokens']):,}), "
          f"fleet prefill {rate:,.0f} tokens/s")
    print("seed  peak live KV  x pool  time over pool  recompute floor tokens  s of fleet prefill  "
          "arm's own recompute")
    per = data.get("metrics_by_seed", {}).get(args.arm) or [{}] * len(raws)  # in the seeds' order
    for seed, raw, m in zip(seeds, raws, per):
        turns, gaps, peak = timeline(raw["requests"])  # wall seconds: only their order matters here
        f, over = floor(turns, gaps, pool)
        own = m.get("recomputed_prefill_tokens")
        print(f"{seed:>4}  {peak:>12,}  {peak / pool:>6.2f}  {over:>13.0%}  {f:>22,}  "
              f"{f / rate if rate else float('nan'):>18.1f}  {own if own is not None else '-':>19}")


if __name__ == "__main__":
    sys.exit(main())
