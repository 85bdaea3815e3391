"""Ranking arms from replicated runs (pure): means with 95% confidence intervals, the residual noise of the
seeds-as-blocks design, tiers of arms that the replicates cannot tell apart, and whether two bench runs rank the
arms the same.

Why tiers: one bench run of a KV-bound fleet is noisy (which engine smg's cache_aware policy picks, which batch a
turn joins and what is evicted depend on microsecond timing), so arms whose makespans differ by less than the
run-to-run noise swap places between runs. Each arm is therefore run on R workloads (seeds seed .. seed+R-1, the
same R in every arm, so the seeds are blocks and differences are paired), and the arms' means are grouped by
Scott and Knott's test at 99% (scott_knott): an arm ranks below another only when they land in different groups.
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


def block_mse(samples: dict[str, Sequence[float]]) -> tuple[float | None, int]:
    """(residual mean square, its degrees of freedom) of a randomized complete block design: ``samples`` is
    arm -> one value per seed, the seeds being the blocks (the same workload in every arm). The residual is what
    is left of each value after its arm's and its seed's effects (two-way additive model), pooled over all arms,
    so it has (k-1)(R-1) degrees of freedom instead of the R-1 of a single pair. (None, 0) with fewer than 2
    arms or 2 seeds. Raises ValueError when arms have different numbers of values."""
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
    return ss / df, df


# Scott & Knott (1974), "A cluster analysis method for grouping means in the analysis of variance",
# Biometrics 30(3): lambda = pi / (2 (pi - 2)) x B0 / sigma0^2 is asymptotically chi-square with k / (pi - 2)
# degrees of freedom under "all k means equal".
_SK_FACTOR = math.pi / (2.0 * (math.pi - 2.0))


@functools.lru_cache(maxsize=None)
def _chi2_isf(alpha: float, df: float) -> float:
    from scipy.stats import chi2
    return float(chi2.isf(alpha, df))


def scott_knott(means: dict[str, float], var_of_mean: float, df: int, alpha: float = 0.01) -> list[list[str]]:
    """Scott-Knott clustering of arm means into non-overlapping ranked groups.

    ``means``: arm -> mean over seeds (lower is better); ``var_of_mean``: the variance of one arm's mean
    (residual mean square / seeds, block_mse); ``df``: its degrees of freedom. The sorted means are split where
    the between-group sum of squares B0 is largest, and the split is kept only when Scott and Knott's lambda
    exceeds the chi-square (k / (pi - 2) df) critical value at ``alpha``; each side is split again the same way.
    Unlike pairwise tests, the groups never overlap, and a run of arms whose means spread evenly within the noise
    stays one group. Returns groups best first, each in mean order."""
    order = sorted(means, key=lambda a: (means[a], a))

    def split(group: list[str]) -> list[list[str]]:
        k = len(group)
        if k < 2:
            return [group]
        ys = [means[a] for a in group]
        ybar = sum(ys) / k
        best, cut = -1.0, 1
        for i in range(1, k):
            m1, m2 = sum(ys[:i]) / i, sum(ys[i:]) / (k - i)
            b0 = i * (m1 - ybar) ** 2 + (k - i) * (m2 - ybar) ** 2
            if b0 > best:
                best, cut = b0, i
        sigma2 = (sum((y - ybar) ** 2 for y in ys) + df * var_of_mean) / (k + df)
        if sigma2 <= 0 or _SK_FACTOR * best / sigma2 <= _chi2_isf(alpha, k / (math.pi - 2.0)):
            return [group]
        return split(group[:cut]) + split(group[cut:])

    return split(order)


def tiers(samples: dict[str, Sequence[float]], failed: Sequence[str] = (), alpha: float = 0.01) -> list[list[str]]:
    """Arms grouped into ranked tiers by ``samples`` (arm -> per-seed values, lower is better): Scott-Knott
    groups (scott_knott) of the arms' means, with the residual variance of the seeds-as-blocks design
    (block_mse). An arm ranks below another only when they fall in different groups. With one seed there is
    no variance to test against, so every arm is its own tier in order of its value (the plain ranking). Arms in
    ``failed`` (errors, timeouts: their sessions ended early) or without values form a last tier of their own.
    Returns tiers best first, each listing its arms by mean."""
    good = {a: list(v) for a, v in samples.items() if a not in failed and v}
    means = {a: mean_ci(v)[0] for a, v in good.items()}
    mse, df = block_mse(good)
    if mse is None:
        out = [[a] for a in sorted(means, key=lambda a: (means[a], a))]
    else:
        out = scott_knott(means, mse / len(next(iter(good.values()))), df, alpha)
    rest = [a for a in samples if a not in good]
    if rest:
        out.append(rest)
    return out


def tier_text(ts: list[list[str]]) -> str:
    """'a < {b, c} < d': tiers best first; braces group arms the replicates cannot tell apart."""
    return " < ".join(t[0] if len(t) == 1 else "{" + ", ".join(t) + "}" for t in ts)


def contradictions(a: list[list[str]], b: list[list[str]]) -> list[tuple[str, str]]:
    """Pairs (x, y) that ranking ``a`` puts in an earlier tier than y and ranking ``b`` in a later one: the two
    runs disagree about which is better, not merely about whether the seeds could tell. Sorted."""
    def tier_of(ts):
        return {x: i for i, t in enumerate(ts) for x in t}
    ta, tb = tier_of(a), tier_of(b)
    common = sorted(set(ta) & set(tb))
    return [(x, y) for x in common for y in common if ta[x] < ta[y] and tb[x] > tb[y]]


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
