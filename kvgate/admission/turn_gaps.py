"""Gaps between a program's turns, and when a program in a tool call counts as ended (pure).

A program's state comes from evidence, not only from the TTL: a program in a tool call idle far past what its
own gaps between turns and its group's predict (``overdue_multiple`` x the ``overdue_quantile`` of those gaps;
``overdue_default_s`` until any gap has been seen; at most the TTL) has ended. An ended program still holds
its KV on the engine, so it is the first to pause: on overflow, and whenever a waiting turn finds no room on
its place (pausing closes its engine session, which frees its KV first). If it was only slow and its next turn
comes, that turn resumes it like any paused program's.

A program's group is its GRPO siblings (the programs whose first prompt is the same). Its own gaps are kept on
the program (``gaps``, the newest OWN_GAPS); :class:`TurnGaps` keeps its group's and the fleet's.
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections import deque
from typing import Any, Hashable

__all__ = ["TurnGaps", "OWN_GAPS", "GROUP_GAPS", "FLEET_GAPS", "MIN_GAPS"]

#: Gaps between turns remembered per program, per group, and for the whole fleet (the newest kept).
OWN_GAPS, GROUP_GAPS, FLEET_GAPS = 16, 64, 512
#: Gaps needed before a quantile is read from them (fewer: the next wider source, then the default).
MIN_GAPS = 3


def _quantile(values, q: float) -> float:
    """The ``q`` quantile (0 < q <= 1) of a non-empty collection of numbers (the nearest-rank value)."""
    return _ranked(sorted(values), q)


def _ranked(xs: list, q: float) -> float:
    """The ``q`` quantile of ``xs``, sorted already (the nearest-rank value)."""
    return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]


class TurnGaps:
    """The gaps between turns (seconds) of each group of programs and of the fleet, and the overdue rule.

    Args: multiple (>= 0; 0: off, nothing is ever overdue), quantile (0, 1], default_s (> 0), ttl_s (> 0): the
    bound is multiple x the quantile of the gaps, default_s before any gap is known, at most ttl_s. A program
    passed in has ``gaps`` (its own deque, maxlen OWN_GAPS) and ``group`` (hashable or None). Values are checked
    by the coordinator."""

    __slots__ = ("multiple", "quantile", "default_s", "ttl_s", "_group", "_fleet", "_fleet_sorted", "_fleet_bound",
                 "_fresh")

    def __init__(self, multiple: float, quantile: float, default_s: float, ttl_s: float) -> None:
        self.multiple = multiple
        self.quantile = quantile
        self.default_s = default_s
        self.ttl_s = ttl_s
        self._group: dict[Hashable, deque] = {}
        self._fleet: deque = deque(maxlen=FLEET_GAPS)
        self._fleet_sorted: list[float] = []  # the same gaps in order: the quantile is read, not sorted again
        self._fleet_bound: float | None = None  # the fleet's quantile, recomputed as gaps come in
        self._fresh = 0

    def record(self, p: Any, gap: float) -> bool:
        """Record one gap between ``p``'s turns (seconds) for it, its group and the fleet (nothing while off or
        for a negative gap). Returns True when this gap makes the fleet's bound known (it was not): the
        programs whose bound was ``default_s`` may have a sooner one now."""
        if gap < 0 or not self.multiple:
            return False
        p.gaps.append(gap)
        if p.group is not None:
            g = self._group.get(p.group)
            if g is None:
                g = self._group[p.group] = deque(maxlen=GROUP_GAPS)
            g.append(gap)
        fleet, ranked = self._fleet, self._fleet_sorted
        if len(fleet) == fleet.maxlen:  # the oldest goes from both
            del ranked[bisect_left(ranked, fleet[0])]
        fleet.append(gap)
        insort(ranked, gap)
        self._fresh += 1
        first = self._fleet_bound is None and len(fleet) >= MIN_GAPS
        if self._fresh >= 16 or first:
            self._fresh = 0
            self._fleet_bound = _ranked(ranked, self.quantile)
        return first

    def overdue_after(self, p: Any) -> float:
        """Seconds after its last turn ended at which ``p`` counts as ended: multiple x the larger of the
        quantile of its own gaps and of its group's (the fleet's when its group has too few; default_s before
        any gap is known), at most ttl_s; inf when off."""
        if not self.multiple:
            return math.inf
        own = _quantile(p.gaps, self.quantile) if len(p.gaps) >= MIN_GAPS else 0.0
        g = self._group.get(p.group) if p.group is not None else None
        if g is not None and len(g) >= MIN_GAPS:
            wide = _quantile(g, self.quantile)
        elif self._fleet_bound is not None:
            wide = self._fleet_bound
        else:
            return min(self.default_s, self.ttl_s)
        return min(self.multiple * max(own, wide), self.ttl_s)

    def forget_group(self, group: Hashable) -> None:
        """The group's last program left: its gaps go."""
        self._group.pop(group, None)
