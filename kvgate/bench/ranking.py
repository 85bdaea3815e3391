"""Ranking arms from replicated runs (pure): means with 95% confidence intervals, paired differences, tiers of
arms that the replicates cannot tell apart, and whether two bench runs rank the arms the same.

Why tiers: one bench run of a KV-bound fleet is noisy (which engine smg's cache_aware policy picks, which batch a
turn joins and what is evicted depend on microsecond timing), so arms whose makespans differ by less than the
run-to-run noise swap places between runs. Each arm is therefore run on R workloads (seeds seed .. seed+R-1, the
same R in every arm, so the seeds are blocks and differences are paired), and an arm only ranks below another
when the difference of their means exceeds Tukey's HSD at 95% for all the arms at once (block_hsd).
"""

from __future__ import annotations

import functools
import math
from typing import Sequence


def t975(df: int) -> float:
    """The two-sided 95% Student t critical value for ``df`` >= 1 degrees of freedom (scipy.stats.t). Raises
    ValueError for df < 1."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    from scipy.stats import t
    return float(t.ppf(0.975, df))


def mean_ci(xs: Sequence[float]) -> tuple[float, float | None]:
    """(mean, half-width of its 95% confidence interval) of ``xs``; the half-width is None for fewer than two
    values. Raises ValueError when ``xs`` is empty."""
    if not xs:
        raise ValueError("mean of no values")
    n = len(xs)
    m = sum(xs) / n
    if n < 2:
        return m, None
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1))
    return m, t975(n - 1) * sd / math.sqrt(n)


def paired_diff(a: Sequence[float], b: Sequence[float]) -> tuple[float, float | None]:
    """Mean and 95% half-width of a[i] - b[i] over replicates (replicate i of both arms ran the same workload).
    Raises ValueError when the lengths differ or are 0."""
    if len(a) != len(b):
        raise ValueError(f"paired samples differ in length: {len(a)} vs {len(b)}")
    return mean_ci([x - y for x, y in zip(a, b)])


def block_hsd(samples: dict[str, Sequence[float]]) -> tuple[float | None, int]:
    """Tukey's honestly significant difference (95%) for the arms' mean makespans, and its residual degrees of
    freedom, in a randomized complete block design: ``samples`` is arm -> one value per seed, the seeds being the
    blocks (the same workload in every arm). The residual variance is what is left of each value after its arm's
    and its seed's effects (two-way additive model), pooled over all arms, so it has (k-1)(R-1) degrees of freedom
    instead of the R-1 of a single pair; HSD = q(0.95; k, df) x sqrt(MSE / R), q from
    scipy.stats.studentized_range. Two arms differ at 95% (for all pairs at once) when their means differ by
    more than HSD. Returns (None, 0) with fewer than 2 arms or 2 seeds. Raises ValueError when arms have
    different numbers of values."""
    arms = list(samples)
    lens = {len(samples[a]) for a in arms}
    if len(lens) > 1:
        raise ValueError(f"arms have different numbers of seeds: {sorted(lens)}")
    k, r = len(arms), (lens.pop() if lens else 0)
    if k < 2 or r < 2:
        return None, 0
    arm_mean = {a: sum(samples[a]) / r for a in arms}
    seed_mean = [sum(samples[a][j] for a in arms) / k for j in range(r)]
    grand = sum(arm_mean.values()) / k
    ss = sum((samples[a][j] - arm_mean[a] - seed_mean[j] + grand) ** 2 for a in arms for j in range(r))
    df = (k - 1) * (r - 1)
    return _q95(k, df) * math.sqrt(ss / df / r), df


@functools.lru_cache(maxsize=None)
def _q95(k: int, df: int) -> float:
    # the studentized range quantile is a numerical integral (tens of ms); a report asks for one (k, df)
    from scipy.stats import studentized_range
    return float(studentized_range.ppf(0.95, k, df))


def tiers(samples: dict[str, Sequence[float]], failed: Sequence[str] = ()) -> list[list[str]]:
    """Arms grouped into ranked tiers by ``samples`` (arm -> per-seed values, lower is better).

    Arms are sorted by mean; walking that order, an arm joins the current tier unless its mean exceeds the tier's
    first (best) arm's by more than block_hsd(), in which case it opens the next tier. With one seed no difference
    can be shown, so every arm is its own tier in order of its value (the plain ranking). Arms in ``failed``
    (errors, timeouts: their sessions ended early) or without values form a last tier of their own. Returns
    tiers best first, each listing its arms by mean."""
    good = {a: list(v) for a, v in samples.items() if a not in failed and v}
    ok = sorted(good, key=lambda a: (mean_ci(good[a])[0], a))
    hsd, _ = block_hsd(good)
    out: list[list[str]] = []
    for arm in ok:
        if out and hsd is not None and mean_ci(good[arm])[0] - mean_ci(good[out[-1][0]])[0] <= hsd:
            out[-1].append(arm)
            continue
        out.append([arm])
    rest = [a for a in samples if a not in good]
    if rest:
        out.append(rest)
    return out


def tier_text(ts: list[list[str]]) -> str:
    """'a < {b, c} < d': tiers best first; braces group arms the replicates cannot tell apart."""
    return " < ".join(t[0] if len(t) == 1 else "{" + ", ".join(t) + "}" for t in ts)


def same_ranking(a: list[list[str]], b: list[list[str]]) -> bool:
    """True when two runs put the same arms in the same tiers in the same order (arm order inside a tier is
    not a ranking and is ignored). Arms only one run has are ignored."""
    common = {x for t in a for x in t} & {x for t in b for x in t}
    ka = [frozenset(x for x in t if x in common) for t in a]
    kb = [frozenset(x for x in t if x in common) for t in b]
    return [t for t in ka if t] == [t for t in kb if t]


def kendall_tau(a: Sequence[str], b: Sequence[str]) -> float:
    """Kendall's tau between two orderings of the same arms (1 = identical, -1 = reversed; ties impossible).
    Arms only one ordering has are ignored; fewer than two common arms give 1.0."""
    common = [x for x in a if x in set(b)]
    pos = {x: i for i, x in enumerate(x for x in b if x in set(common))}
    n = len(common)
    if n < 2:
        return 1.0
    s = 0
    for i in range(n):
        for j in range(i + 1, n):
            s += 1 if pos[common[i]] < pos[common[j]] else -1
    return s / (n * (n - 1) / 2)
