"""Which program pauses first, and which paused program resumes first (pure).

Victim rule (``victim``): "smallest" pauses the smallest in-tool program first, as ThunderAgent's
paper and code do: re-prefilling a context of c tokens costs ~c^2 attention work, so the smallest victim
costs the least to bring back; "largest" frees the most per pause (fewest programs paused); "longest-idle"
pauses the program whose tool call has run longest: tool times are heavy-tailed, so it is the least likely
to come back soon and wait for room itself (the radix cache's LRU would evict it first anyway); "ahead"
(default) aims at the step's makespan (the last program to finish): the in-tool program furthest ahead of
its group (GRPO siblings: the programs whose first prompt is the same) in turns done pauses first, then the
one with the most turns done, then the smallest; a program far along has the least work left, so delaying
it is least likely to delay the step's last program (the programs with the most work left).
Whatever the rule, ended programs (idle past their predicted gap, kvgate.admission.turn_gaps) pause first.

Resume order (``resume``): "smallest" (ThunderAgent's greedy resume packs the most programs into the room freed),
"largest" (best-fit-decreasing, as Dynamo's ThunderAgent router resumes: a paused program resumes on the engine
that holds its prefix, so its best fit is that engine, and the largest that fits goes first: the room freed goes
to the programs that are the dearest to re-prefill) or "fifo" (default: longest waiting first, so no paused
program starves behind smaller ones). On the bench's
many-programs scenario the defaults finished as soon as ThunderAgent's smallest/smallest and a little sooner
than longest-idle, which has the shorter TTFT tail (docs/benchmark.md).
"""

from __future__ import annotations

import enum
from heapq import heapify
from collections.abc import Mapping
from typing import Any, Callable, Hashable, Iterable

__all__ = ["VictimRule", "ResumeOrder", "VICTIM_RULES", "RESUME_ORDERS", "Groups", "victim_order", "victim_heap",
           "resume_key"]


class VictimRule(enum.StrEnum):
    """Which in-tool program pauses first (the module doc)."""

    SMALLEST = "smallest"
    LARGEST = "largest"
    LONGEST_IDLE = "longest-idle"
    AHEAD = "ahead"


class ResumeOrder(enum.StrEnum):
    """Which paused program's turn resumes first (the module doc)."""

    SMALLEST = "smallest"
    LARGEST = "largest"
    FIFO = "fifo"


#: The rules' names, as config and the coordinator take them.
VICTIM_RULES: tuple[str, ...] = tuple(r.value for r in VictimRule)
RESUME_ORDERS: tuple[str, ...] = tuple(r.value for r in ResumeOrder)


class Groups(dict):
    """GRPO groups: group -> the set of its programs' ids, and ``turns``: group -> the turns its programs have
    done, summed as they change (the "ahead" rule reads a group's mean without a pass over its programs)."""

    __slots__ = ("turns",)

    def __init__(self) -> None:
        super().__init__()
        self.turns: dict[Hashable, int] = {}

    def join(self, group: Hashable, sid: Hashable, turns: int = 0) -> None:
        """Program ``sid`` (``turns`` done) belongs to ``group``."""
        self.setdefault(group, set()).add(sid)
        self.turns[group] = self.turns.get(group, 0) + turns

    def turned(self, group: Hashable) -> None:
        """A program of ``group`` answered one more turn."""
        if group in self.turns:
            self.turns[group] += 1

    def leave(self, group: Hashable, sid: Hashable, turns: int) -> bool:
        """Program ``sid`` (``turns`` done) left ``group``; True when that emptied the group (it is dropped)."""
        g = self.get(group)
        if g is None:
            return False
        if sid in g:
            g.discard(sid)
            self.turns[group] -= turns
        if g:
            return False
        del self[group], self.turns[group]
        return True


def victim_order(progs: Iterable[Any], rule: VictimRule, now: float, groups: Mapping[Hashable, set],
                 programs: Mapping[Hashable, Any]) -> list:
    """``progs`` in pause order: ended ones (``overdue_at`` <= ``now``) first, then by ``rule``. A program has
    ``resident`` (tokens), ``since`` (seconds), ``turns``, ``group`` and ``overdue_at``; ``groups`` maps a group to
    its programs' ids and ``programs`` an id to its program (the "ahead" rule compares turns within a group)."""
    key: Callable[[Any], Any]
    if rule == VictimRule.AHEAD:
        means: dict[Hashable, float] = {}  # per group, once per call: siblings on one place share it
        sums = getattr(groups, "turns", None)  # kept by Groups as turns are done

        def ahead(p: Any) -> float:
            g = groups.get(p.group) if p.group is not None else None
            if not g or len(g) < 2:
                return 0.0
            mean = means.get(p.group)
            if mean is None:
                total = sums.get(p.group) if sums is not None else None
                if total is None:
                    total = sum(programs[s].turns for s in g)
                mean = means[p.group] = total / len(g)
            return p.turns - mean
        key = lambda p: (-ahead(p), -p.turns, p.resident)  # noqa: E731
    elif rule == VictimRule.LONGEST_IDLE:
        key = lambda p: -(now - p.since)  # noqa: E731
    elif rule == VictimRule.LARGEST:
        key = lambda p: -p.resident  # noqa: E731
    else:
        key = lambda p: p.resident  # noqa: E731
    return sorted(progs, key=lambda p: (p.overdue_at > now, key(p)))


def victim_heap(progs: Iterable[Any], rule: VictimRule, now: float, groups: Groups) -> list[tuple]:
    """``progs`` (each with a distinct ``n``) as a heap (heapq) of (victim_order's key..., n, program): popped one
    by one they come in victim_order's order over ``progs`` sorted by ``n`` (its ties: the order given). A place
    that overflows pauses the first one or two of its in-tool programs: their keys are read in one pass, without a
    call per program, and the rest is not sorted."""
    if rule != VictimRule.AHEAD:
        keyed = victim_order(sorted(progs, key=lambda p: p.n), rule, now, groups, {})
        return [(i, p.n, p) for i, p in enumerate(keyed)]  # already in order: a heap as it is
    sums, means, heap = groups.turns, {}, []
    for p in progs:
        g = p.group
        mean = means.get(g)
        if mean is None:  # per group once (siblings on one place share it): victim_order's ahead(), inline
            members = groups.get(g) if g is not None else None
            mean = means[g] = sums[g] / len(members) if members and len(members) >= 2 else None
        heap.append((p.overdue_at > now, 0.0 if mean is None else mean - p.turns, -p.turns, p.resident, p.n, p))
    heapify(heap)
    return heap


def resume_key(order: ResumeOrder) -> Callable[[Any], Any]:
    """The sort key of paused programs' waiting turns (``tokens``, ``seq``: arrival) in ``order``."""
    if order == ResumeOrder.SMALLEST:
        return lambda w: (w.tokens, w.seq)
    if order == ResumeOrder.LARGEST:
        return lambda w: (-w.tokens, w.seq)
    return lambda w: w.seq
