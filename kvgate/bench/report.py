"""Per-arm metrics, ratios and the markdown table (pure).

Input per arm (``raw``), as the runner records it; every time is WALL seconds since the arm's start:
``requests`` [{session, start, ttft, end, ok, output_tokens, admission, queue_ms}], ``sessions`` [{id, step,
start, end, ok}], ``steps`` [{start, end}], ``sim_totals`` (the sum over engines of /sim/stats totals),
``kvgate_counters`` (/kvgate/stats counters or None). Output times are SIMULATED seconds (wall x speed, i.e.
what they would be at speed 1), so runs at different speeds compare.
"""

from __future__ import annotations

import math
from typing import Iterable

from kvgate.bench.ranking import block_mse, mean_ci, t975, tiers

HEADLINE = "makespan_s"
# metric -> (column title, format); lower is better for every time and for recomputed/evictions.
COLUMNS = [
    ("makespan_s", "step makespan s", "{:.1f}"),
    ("session_mean_s", "session mean s", "{:.1f}"),
    ("session_p50_s", "session p50 s", "{:.1f}"),
    ("session_p99_s", "session p99 s", "{:.1f}"),
    ("turn_p50_s", "turn p50 s", "{:.2f}"),
    ("turn_p99_s", "turn p99 s", "{:.2f}"),
    ("ttft_p50_s", "TTFT p50 s", "{:.2f}"),
    ("ttft_p99_s", "TTFT p99 s", "{:.2f}"),
    ("output_tok_per_s", "out tok/s", "{:.0f}"),
    ("cache_hit_rate", "prefix hit", "{:.1%}"),
    ("recomputed_prefill_tokens", "recomputed prefill", "{:,.0f}"),
    ("cached_per_turn", "cached tok/turn", "{:.0f}"),
    ("evicted_tokens", "evicted tok", "{:,.0f}"),
    ("retractions", "retract", "{:.0f}"),
    ("errors", "errors", "{:.0f}"),
    ("retries", "408/429 retries", "{:.0f}"),
    ("queue_p50_s", "kvgate queue p50 s", "{:.2f}"),
    ("queue_p99_s", "kvgate queue p99 s", "{:.2f}"),
    ("admit_wait_bypass", "admit/wait/bypass", "{}"),
    ("pause_resume", "pauses/resumes", "{}"),
    ("reprefill_share", "re-prefill ratio", "{:.2f}"),
    ("session_precision", "session precision", "{:.3f}"),
    ("session_recall", "session recall", "{:.3f}"),
    ("engine_sessions_seen", "session ids seen by engines", "{:.0f}"),
    ("reopen_home_elsewhere", "re-opened home/elsewhere", "{}"),
    ("load_spread", "engine load max/mean", "{:.2f}"),
]
# The placement view: where sessions went, kvgate's rules against smg's policies (both kvgate features off).
PLACEMENT_ARMS = ("direct", "smg-manual", "proxy-placement")
PLACEMENT_COLUMNS = [("cache_hit_rate", "prefix hit", "{:.1%}"), ("makespan_s", "step makespan s", "{:.1f}"),
                     ("recomputed_prefill_tokens", "recomputed prefill", "{:,.0f}"),
                     ("load_spread", "engine load max/mean", "{:.2f}")]
RATIO_METRICS = ["makespan_s", "session_mean_s", "session_p99_s", "turn_p50_s", "turn_p99_s", "ttft_p99_s",
                 "output_tok_per_s", "recomputed_prefill_tokens"]


def percentile(xs: Iterable[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of ``xs``; NaN when empty. p50 of [1, 2, 3, 4] is 2 (rank
    ceil(q/100 x n))."""
    s = sorted(xs)
    if not s:
        return float("nan")
    k = max(1, math.ceil(q / 100.0 * len(s)))
    return s[min(k, len(s)) - 1]


def summarize(raw: dict, speed: float, ideal_prefill_tokens: int) -> dict:
    """The metrics of one arm (see COLUMNS); times in simulated seconds. ``ideal_prefill_tokens``: prefill
    an unlimited cache would compute (workload.ideal_prefill_*); recomputed = computed - ideal, >= 0."""
    reqs = raw.get("requests", [])
    ok = [r for r in reqs if r["ok"]]
    sess = [s for s in raw.get("sessions", []) if s["ok"] and s.get("end") is not None]
    steps = [s for s in raw.get("steps", []) if s.get("end") is not None]
    totals = raw.get("sim_totals") or {}
    span = max((r["end"] for r in ok), default=0.0) - min((r["start"] for r in reqs), default=0.0)
    out_tokens = sum(r.get("output_tokens", 0) for r in ok)
    prompt = totals.get("prompt_tokens", 0)
    cached = totals.get("cached_tokens", 0)
    computed = prompt - cached
    q = [r["queue_ms"] / 1000.0 * speed for r in reqs if r.get("queue_ms") is not None]
    counters = raw.get("kvgate_counters")
    m = {
        "makespan_s": (sum(s["end"] - s["start"] for s in steps) / len(steps) * speed) if steps else float("nan"),
        "session_mean_s": (sum(s["end"] - s["start"] for s in sess) / len(sess) * speed) if sess else float("nan"),
        "session_p50_s": percentile((s["end"] - s["start"] for s in sess), 50) * speed,
        "session_p99_s": percentile((s["end"] - s["start"] for s in sess), 99) * speed,
        "turn_p50_s": percentile((r["end"] - r["start"] for r in ok), 50) * speed,
        "turn_p99_s": percentile((r["end"] - r["start"] for r in ok), 99) * speed,
        "ttft_p50_s": percentile((r["ttft"] - r["start"] for r in ok if r.get("ttft") is not None), 50) * speed,
        "ttft_p99_s": percentile((r["ttft"] - r["start"] for r in ok if r.get("ttft") is not None), 99) * speed,
        "output_tok_per_s": out_tokens / (span * speed) if span > 0 else float("nan"),
        "cache_hit_rate": cached / prompt if prompt else float("nan"),
        "prefill_computed_tokens": computed,
        "recomputed_prefill_tokens": max(0, computed - ideal_prefill_tokens),
        # what the engines answered each turn (meta_info.cached_tokens), the same on a real and a simulated engine
        "cached_per_turn": (sum(r["cached_tokens"] for r in ok if r.get("cached_tokens") is not None) / len(ok))
        if ok else float("nan"),
        "evicted_tokens": totals.get("evicted_tokens", 0),
        "retractions": totals.get("retractions", 0),
        # HiCache arms: prompt tokens loaded back from host memory instead of prefilled (counted as cached)
        "load_back_tokens": totals.get("load_back_tokens", 0),
        "aborted": totals.get("aborted", 0),
        "errors": len(reqs) - len(ok),
        "retries": sum(r.get("retries", 0) for r in reqs),
        "requests": len(reqs),
        "queue_p50_s": percentile(q, 50) if q else None,
        "queue_p99_s": percentile(q, 99) if q else None,
        "admit": counters["admit"] if counters else None,
        "wait": counters["wait"] if counters else None,
        "bypass": sum(v for k, v in counters.items() if k.startswith("bypass_")) if counters else None,
        "bypass_by_reason": {k[len("bypass_"):]: counters[k] for k in counters if k.startswith("bypass_")}
        if counters else None,
    }
    m["admit_wait_bypass"] = (f"{m['admit']}/{m['wait']}/{m['bypass']}" if counters else "-")
    # program policy only: programs paused on overflow and resumed
    m["pauses"] = counters["pause"] if counters and "pause" in counters else None
    m["resumes"] = counters["resume"] if counters and "resume" in counters else None
    m["pause_resume"] = (f"{m['pauses']}/{m['resumes']}" if m["pauses"] is not None else "-")
    # program policy only: the engines' time re-prefilling KV the programs had held, as kvgate's pause gate
    # measured it (learned prefill rate), over the engines' wall time of the step
    gate = raw.get("kvgate_pause_gate")
    engines = len(raw.get("sim_engines_prompt_tokens") or []) or 1
    m["reprefill_share"] = (gate["reprefill_s"] / (span * engines)) if gate and span > 0 else None
    # and what its foresight read when an engine's working set first outgrew its ceiling, and at most
    m["foresight_first"] = gate.get("foresight_first") if gate else None
    m["foresight_peak"] = gate.get("foresight_peak") if gate else None
    # the resident bound (admission_program_max_resident): turns that waited for a seat
    m["bound_waits"] = counters.get("wait_resident_bound") if counters else None
    # the arm did not run to the end (its fleet failed to start, or --arm-timeout-s cut it): not comparable
    m["failed"] = bool(raw.get("failed") or raw.get("timed_out"))
    m["session_precision"], m["session_recall"] = session_accuracy(reqs)
    seen = raw.get("sim_engines_sessions_seen")
    m["engine_sessions_seen"] = sum(seen) if seen is not None else None
    m["load_spread"] = load_spread(raw.get("sim_engines_prompt_tokens"))
    # kvgate's placement: closed sessions that came back, to their engine or (moved) to another
    placed = raw.get("kvgate_placement") or {}
    m["reopened_home"] = placed.get("reopened")
    m["reopened_elsewhere"] = placed.get("reopen_elsewhere")
    m["reopen_home_elsewhere"] = _pair(m["reopened_home"], m["reopened_elsewhere"])
    # what shared the host's cores during the run (CPU seconds by role, wall time), and on simulated engines
    # with a host contention figure the simulated seconds it added to their batches
    m["cpu_s"] = raw.get("cpu_s")
    m["host_contention_s"] = totals.get("host_contention_seconds")
    return m


def _pair(a: float | None, b: float | None) -> str:
    return f"{a:.0f}/{b:.0f}" if a is not None and b is not None and (a or b) else "-"


def load_spread(per_engine: list[float] | None) -> float | None:
    """max / mean of the engines' prompt tokens (1.0 = even; the number of engines = all on one); None when
    unknown or nothing was sent."""
    if not per_engine or sum(per_engine) <= 0:
        return None
    return max(per_engine) / (sum(per_engine) / len(per_engine))


def placement_markdown(metrics: dict[str, dict], router_policy: str) -> str:
    """The placement view (empty when the run has none of its arms but direct): prefix hit, makespan,
    recomputed prefill and load spread for smg's scenario policy (direct), smg manual and kvgate's placement."""
    arms = [a for a in PLACEMENT_ARMS if a in metrics]
    if arms == ["direct"] or not arms:
        return ""
    names = {"direct": f"smg {router_policy} (direct)", "smg-manual": "smg manual (routing key)",
             "proxy-placement": "kvgate placement (proxy-placement)"}
    lines = ["", "Placement (both kvgate features off):", "",
             "| placement | " + " | ".join(t for _, t, _ in PLACEMENT_COLUMNS) + " |",
             "|---|" + "---|" * len(PLACEMENT_COLUMNS)]
    for a in arms:
        lines.append(f"| {names[a]} | " + " | ".join(_fmt(f, metrics[a].get(k)) for k, _, f in PLACEMENT_COLUMNS) + " |")
    return "\n".join(lines) + "\n"


def aggregate(reps: list[dict]) -> dict:
    """One arm's metrics over its replicates (summarize() outputs, one per workload seed): the mean of every
    numeric metric (None/NaN values skipped; None when no replicate has one), ``replicates`` = how many, and
    ``makespan_s_reps`` = the per-replicate makespans. admit/wait/bypass and pauses/resumes are per-replicate means. Raises
    ValueError when ``reps`` is empty."""
    if not reps:
        raise ValueError("aggregate of no replicates")
    out: dict = {}
    for k in reps[0]:
        vals = [r.get(k) for r in reps]
        if k == "failed":
            out[k] = any(vals)
            continue
        nums = [v for v in vals if isinstance(v, (int, float)) and not isinstance(v, bool)
                and not (isinstance(v, float) and math.isnan(v))]
        if nums:
            out[k] = sum(nums) / len(nums)
        elif all(isinstance(v, dict) for v in vals):
            keys = {kk for v in vals for kk in v}
            out[k] = {kk: sum(v.get(kk, 0) for v in vals) / len(vals) for kk in sorted(keys)}
        elif all(isinstance(v, (int, float)) for v in vals):  # every replicate NaN
            out[k] = float("nan")
        else:
            out[k] = None
    if out.get("admit") is not None:
        out["admit_wait_bypass"] = f"{out['admit']:.0f}/{out['wait']:.0f}/{out['bypass']:.0f}"
    else:
        out["admit_wait_bypass"] = "-"
    # a string per replicate cannot be averaged: rebuild it from the mean counts
    out["pause_resume"] = (f"{out['pauses']:.0f}/{out['resumes']:.0f}" if out.get("pauses") is not None else "-")
    out["reopen_home_elsewhere"] = _pair(out.get("reopened_home"), out.get("reopened_elsewhere"))
    out["replicates"] = len(reps)
    out["makespan_s_reps"] = [r.get(HEADLINE) for r in reps]
    return out


def session_accuracy(reqs: list[dict]) -> tuple[float | None, float | None]:
    """Precision and recall of the session ids kvgate gave the turns (``kv_session``, from its
    X-Kvgate-Session-Id header) against the workload's true sessions, over same-session pairs of turns
    (kvgate.sessions.inference.score). (None, None) when kvgate named no turn (no kvgate, or lifecycle off)."""
    from kvgate.sessions.inference import score
    named = [r for r in reqs if r.get("kv_session")]
    if not named:
        return None, None
    return score([r["kv_session"] for r in named], [r["session"] for r in named])


def ratios(metrics: dict[str, dict], base: str) -> dict[str, dict]:
    """metric / the same metric of arm ``base`` for RATIO_METRICS; {} when ``base`` did not run. A NaN or
    zero base gives None."""
    if base not in metrics:
        return {}
    b = metrics[base]
    out = {}
    for arm, m in metrics.items():
        row = {}
        for k in RATIO_METRICS:
            x, y = m.get(k), b.get(k)
            ok = isinstance(x, (int, float)) and isinstance(y, (int, float)) and y and not math.isnan(y) \
                and not math.isnan(x)
            row[k] = x / y if ok else None
        out[arm] = row
    return out


def _fmt(fmt: str, v) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return fmt.format(v)


def markdown(metrics: dict[str, dict], header: str = "") -> str:
    """The report table: one row per arm (insertion order), then makespan ratios to direct and unbounded-kv."""
    lines = [header] if header else []
    reps = max((len(m.get("makespan_s_reps") or []) for m in metrics.values()), default=0)
    diffs = vs_base(metrics, "direct")
    paired = reps >= 2 and "direct" in metrics
    titles = [t for _, t, _ in COLUMNS]
    if reps >= 2:
        titles[0] += f" (mean ± 95% CI, {reps} seeds)"
    if paired:
        titles.insert(1, "vs direct s (paired, 95%)")
    lines.append("| arm | " + " | ".join(titles) + " |")
    lines.append("|---|" + "---|" * len(titles))
    for arm, m in metrics.items():
        cells = [_fmt(f, m.get(k)) for k, _, f in COLUMNS]
        xs = [x for x in (m.get("makespan_s_reps") or []) if x is not None]
        if reps >= 2 and len(xs) >= 2:
            mean, hw = mean_ci(xs)
            cells[0] = f"{mean:.1f} ± {hw:.1f}"
        if paired:
            cells.insert(1, _paired_cell(arm, diffs))
        shown = arm + (" (did not finish)" if m.get("failed") else "")
        lines.append(f"| {shown} | " + " | ".join(cells) + " |")
    for base in ("direct", "unbounded-kv"):
        r = ratios(metrics, base)
        if not r:
            continue
        lines.append("")
        lines.append(f"Ratio to {base} (lower is better except out tok/s):")
        lines.append("")
        lines.append("| arm | " + " | ".join(k for k in RATIO_METRICS) + " |")
        lines.append("|---|" + "---|" * len(RATIO_METRICS))
        for arm, row in r.items():
            lines.append(f"| {arm} | " + " | ".join(_fmt("{:.2f}", row[k]) for k in RATIO_METRICS) + " |")
    return "\n".join(lines) + "\n"


def router_sweep_markdown(metrics: dict[str, dict], names: list[str]) -> tuple[str, str | None]:
    """The router sweep's table (its arms by mean makespan, with the paired difference to the best and each
    arm's tier) and the best arm's name, from ``metrics`` of the ``names`` router-sweep arms that finished.
    ("", None) when fewer than one sweep arm finished."""
    failed = set(failed_arms(metrics))
    done = [a for a in names if a in metrics and a not in failed]
    if not done:
        return "", None
    best = min(done, key=lambda a: metrics[a]["makespan_s"])
    sub = {a: metrics[a] for a in done}
    diffs = vs_base(sub, best)
    tier_of = {a: i + 1 for i, t in enumerate(tiers({a: list(m["makespan_s_reps"]) for a, m in sub.items()}, []))
               for a in t}
    lines = ["", f"Router sweep (router only, no kvgate; best: {best}):", "",
             "| router configuration | makespan s | vs best s (paired, 95%) | tier | cache hit | TTFT p99 s |",
             "|---|---|---|---|---|---|"]
    for a in sorted(done, key=lambda a: metrics[a]["makespan_s"]):
        xs = [x for x in metrics[a]["makespan_s_reps"] if x is not None]
        if len(xs) >= 2:
            mean, hw = mean_ci(xs)
            span = f"{mean:.1f} ± {hw:.1f}"
        else:
            span = f"{metrics[a]['makespan_s']:.1f}"
        lines.append(f"| {a} | {span} | {'-' if a == best else _paired_cell(a, diffs)} | {tier_of.get(a, '-')} | "
                     f"{_fmt('{:.1%}', metrics[a].get('cache_hit_rate'))} | {_fmt('{:.1f}', metrics[a].get('ttft_p99_s'))} |")
    gone = [a for a in names if a not in done]
    if gone:
        lines.append(f"\nDid not finish: {', '.join(gone)}.")
    return "\n".join(lines) + "\n", best


def failed_arms(metrics: dict[str, dict]) -> list[str]:
    """Arms whose makespans cannot be compared: errors, or a seed without a makespan."""
    return [a for a, m in metrics.items() if m.get("errors") or m.get("failed") or not m.get("makespan_s_reps")
            or any(x is None or (isinstance(x, float) and math.isnan(x)) for x in m["makespan_s_reps"])]


def vs_base(metrics: dict[str, dict], base: str = "direct") -> dict[str, tuple[float, float | None]]:
    """arm -> (mean makespan difference to ``base`` s, 95% half-width), seed by seed (paired). The half-width
    uses the residual variance pooled over every comparable arm (block_mse; Student t on its degrees of freedom),
    so it matches the ranking's noise; with one comparable pair it is the plain paired t interval. {} when
    ``base`` is missing or failed, or there is one seed."""
    failed = set(failed_arms(metrics))
    if base not in metrics or base in failed:
        return {}
    good = {a: list(m["makespan_s_reps"]) for a, m in metrics.items() if a not in failed}
    r = len(good[base])
    if r < 2:
        return {}
    mse, df = block_mse(good)
    out = {}
    for a, xs in good.items():
        if a == base:
            continue
        d = sum(x - y for x, y in zip(xs, good[base])) / r
        out[a] = (d, t975(df) * math.sqrt(2.0 * mse / r) if mse is not None else None)
    return out


def _paired_cell(arm: str, diffs: dict[str, tuple[float, float | None]]) -> str:
    if arm not in diffs:
        return "-"
    d, hw = diffs[arm]
    return f"{d:+.1f} ± {hw:.1f}" if hw is not None else f"{d:+.1f}"


def ranked_tiers(metrics: dict[str, dict]) -> tuple[list[list[str]], float | None, int]:
    """(tiers, standard error of one arm's mean makespan s, its degrees of freedom): arms in Scott-Knott tiers
    by their per-seed makespans (kvgate.bench.ranking.tiers, 99%). Arms with errors or no makespan come last and
    do not enter the variance. The standard error is None with one seed."""
    failed = failed_arms(metrics)
    samples = {a: list(m.get("makespan_s_reps") or []) for a, m in metrics.items()}
    good = {a: v for a, v in samples.items() if a not in failed}
    mse, df = block_mse(good)
    se = math.sqrt(mse / len(next(iter(good.values())))) if mse is not None else None
    return tiers(samples, failed), se, df


def ranking(metrics: dict[str, dict], key: str = HEADLINE) -> list[str]:
    """Arms ordered by ``key`` ascending; arms with errors (their sessions ended early) and NaN go last."""
    def k(arm):
        v = metrics[arm].get(key)
        if v is None or (isinstance(v, float) and math.isnan(v)) or metrics[arm].get("errors") \
                or metrics[arm].get("failed"):
            return (1, 0.0 if v is None or isinstance(v, float) and math.isnan(v) else v)
        return (0, v)
    return sorted(metrics, key=k)
