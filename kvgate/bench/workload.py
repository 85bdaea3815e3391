"""Bench workloads (pure): closed-loop agent sessions and the open-loop Mooncake window.

Closed loop (``kind: agentic``), the RL rollout shape: a step starts ``groups x group_size`` sessions at once;
the sessions of a GRPO group share one task prompt (then a short per-sample line so their outputs differ, as
sampling would make them). Turn 1 sends that prompt; every later turn sends the previous prompt + the previous
output text + a tool observation (:func:`next_prompt`), after a tool gap. Turns per session, observation
sizes, output lengths and gaps are drawn from distributions with a seeded RNG, so every arm replays the same
plan. Texts are printable ASCII: with the simulator's byte tokenizer one character is one token, and with its
byte-level model (``--token-vocab byte``, the default) output text re-tokenizes to the cached output ids.

Distribution specs (mappings): ``{dist: const, value: V}``, ``{dist: lognormal, median: M, sigma: S,
min: A, max: B}``, ``{dist: quantiles, points: [[q, v], ...]}`` (inverse CDF, log-linear between points;
q from 0 to 1, v > 0).
"""

from __future__ import annotations

import bisect
import math
import random
from dataclasses import dataclass
from typing import Sequence

from kvgate.bench.trace import BLOCK_TOKENS, TokenBook, TraceRecord, infer_sessions, iter_turns

ALPHABET = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,;:=()[]{}_-+*/\n"

# SWE-style agent defaults: ~11 turns, tool gaps p10 1.6 s, p50 2.5 s, p90 7.8 s, tail to minutes.
DEFAULT_AGENTIC = {
    "steps": 1,
    "groups": 4,
    "group_size": 4,
    "task_prompt_tokens": {"dist": "lognormal", "median": 3000, "sigma": 0.3, "min": 500, "max": 12000},
    "turns": {"dist": "lognormal", "median": 10, "sigma": 0.4, "min": 2, "max": 30},
    "observation_tokens": {"dist": "lognormal", "median": 600, "sigma": 0.9, "min": 20, "max": 8000},
    "output_tokens": {"dist": "lognormal", "median": 200, "sigma": 0.6, "min": 16, "max": 1024},
    "tool_gap_s": {"dist": "quantiles",
                   "points": [[0.0, 1.0], [0.1, 1.6], [0.5, 2.5], [0.9, 7.8], [0.99, 60.0], [1.0, 180.0]]},
}


def sample(spec: dict, rng: random.Random) -> float:
    """One draw from a distribution spec (see the module docstring). Raises ValueError on a bad spec."""
    kind = spec.get("dist")
    if kind == "const":
        return float(spec["value"])
    if kind == "lognormal":
        v = float(spec["median"]) * math.exp(float(spec.get("sigma", 0.0)) * rng.gauss(0.0, 1.0))
        return min(max(v, float(spec.get("min", 0.0))), float(spec.get("max", math.inf)))
    if kind == "quantiles":
        return quantile(spec["points"], rng.random())
    raise ValueError(f"unknown distribution {kind!r} (const | lognormal | quantiles)")


def quantile(points: Sequence[Sequence[float]], u: float) -> float:
    """Inverse CDF through ``points`` [[q, v], ...] (q ascending from 0 to 1, v > 0) at ``u`` in [0, 1],
    interpolating log(v) linearly in q. Raises ValueError on a malformed table."""
    qs = [float(p[0]) for p in points]
    vs = [float(p[1]) for p in points]
    if len(qs) < 2 or qs[0] != 0.0 or qs[-1] != 1.0 or any(b <= a for a, b in zip(qs, qs[1:])) \
            or any(v <= 0 for v in vs):
        raise ValueError("quantiles: points need q strictly ascending from 0 to 1 and v > 0")
    u = min(max(u, 0.0), 1.0)
    i = max(1, bisect.bisect_left(qs, u))
    f = (u - qs[i - 1]) / (qs[i] - qs[i - 1])
    return math.exp(math.log(vs[i - 1]) + f * (math.log(vs[i]) - math.log(vs[i - 1])))


def random_text(rng: random.Random, n: int) -> str:
    """``n`` printable ASCII characters (= n simulator tokens)."""
    return "".join(rng.choices(ALPHABET, k=n))


@dataclass(frozen=True)
class TurnPlan:
    """One turn: ``max_tokens`` to generate; after it (unless last) the tool runs ``gap_s`` seconds (speed 1)
    and returns ``observation`` (text appended to the next prompt)."""

    max_tokens: int
    gap_s: float
    observation: str


@dataclass(frozen=True)
class SessionPlan:
    """One agent session of a step: its group, the shared task length (tokens) and turn 1's prompt."""

    session_id: str
    step: int
    group: int
    index: int
    task_tokens: int
    first_prompt: str
    turns: tuple[TurnPlan, ...]


def next_prompt(prev_prompt: str, prev_output: str, observation: str) -> str:
    """The next turn's prompt: the whole previous prompt, the previous output, then the tool observation."""
    return prev_prompt + prev_output + observation


def plan_agentic(workload: dict, seed: int) -> list[SessionPlan]:
    """The closed-loop plan: steps x groups x group_size sessions (keys as in DEFAULT_AGENTIC, which fills
    what ``workload`` leaves out). Deterministic in (workload, seed)."""
    wl = {**DEFAULT_AGENTIC, **{k: v for k, v in workload.items() if k != "kind"}}
    rng = random.Random(seed)
    out: list[SessionPlan] = []
    for step in range(int(wl["steps"])):
        for g in range(int(wl["groups"])):
            task_len = int(round(sample(wl["task_prompt_tokens"], rng)))
            task = random_text(rng, task_len)
            for i in range(int(wl["group_size"])):
                n_turns = max(1, int(round(sample(wl["turns"], rng))))
                turns = []
                for t in range(n_turns):
                    last = t == n_turns - 1
                    turns.append(TurnPlan(
                        max_tokens=max(1, int(round(sample(wl["output_tokens"], rng)))),
                        gap_s=0.0 if last else sample(wl["tool_gap_s"], rng),
                        observation="" if last else random_text(
                            rng, max(1, int(round(sample(wl["observation_tokens"], rng)))))))
                out.append(SessionPlan(f"st{step}-g{g}-s{i}", step, g, i, task_len,
                                       task + f"\n[sample {i}]\n", tuple(turns)))
    return out


def ideal_prefill_agentic(plans: list[SessionPlan]) -> int:
    """Prefill tokens an engine with an unlimited cache and perfect routing must compute for the plan:
    each group's task prompt once, each session's own turn-1 tail, then each observation once (the previous
    prompt and output are cached). Recomputed prefill = computed - this."""
    total = 0
    seen_groups: set[tuple[int, int]] = set()
    for s in plans:
        key = (s.step, s.group)
        total += len(s.first_prompt) - (s.task_tokens if key in seen_groups else 0)
        seen_groups.add(key)
        total += sum(len(t.observation) for t in s.turns[:-1])
    return total


def plan_summary(plans: list[SessionPlan]) -> dict:
    """Counts and sizes of a closed-loop plan (tokens; gaps in seconds at speed 1)."""
    turns = [len(s.turns) for s in plans]
    final_ctx = [len(s.first_prompt) + sum(t.max_tokens + len(t.observation) for t in s.turns) for s in plans]
    gaps = sorted(t.gap_s for s in plans for t in s.turns[:-1])
    return {"sessions": len(plans), "requests": sum(turns), "turns_mean": sum(turns) / max(1, len(turns)),
            "final_context_tokens_max": max(final_ctx, default=0),
            "final_context_tokens_mean": sum(final_ctx) / max(1, len(final_ctx)),
            "working_set_tokens": sum(final_ctx),
            "output_tokens": sum(t.max_tokens for s in plans for t in s.turns),
            "tool_gap_s_p50": gaps[len(gaps) // 2] if gaps else 0.0,
            "tool_gap_s_max": gaps[-1] if gaps else 0.0}


@dataclass(frozen=True)
class TraceRequest:
    """One open-loop request: at ``t_s`` (seconds after the window start, speed 1) send ``prompt`` text."""

    t_s: float
    session_id: str
    turn: int
    prompt: str
    max_tokens: int


def plan_mooncake(records: list[TraceRecord]) -> list[TraceRequest]:
    """The open-loop plan of a trace window: sessions from hash chains (kvgate.bench.trace), prompts as text of
    input_length characters, times relative to the first record."""
    if not records:
        return []
    book = TokenBook()
    t0 = records[0].timestamp_ms
    return [TraceRequest((r.timestamp_ms - t0) / 1000.0, sid, turn, book.prompt_text(r), max(1, r.output_length))
            for r, sid, turn in iter_turns(records, infer_sessions(records))]


def ideal_prefill_mooncake(records: list[TraceRecord]) -> int:
    """Prefill tokens with an unlimited cache: per request, input_length minus 512 x its leading full blocks
    already seen in an earlier request (block granularity, so a slight over-estimate of the minimum)."""
    seen: set[tuple[int, ...]] = set()
    total = 0
    for r in records:
        full = r.full_blocks
        k = 0
        while k < len(full) and full[:k + 1] in seen:
            k += 1
        total += r.input_length - k * BLOCK_TOKENS
        for j in range(1, len(full) + 1):
            seen.add(full[:j])
    return total
