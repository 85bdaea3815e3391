"""The engines ordered by free room, kept up to date as holdings change (pure, no I/O).

A turn that waits in the program policy may go to any engine with room (work-conserving). Ranking the engines
for it by a sort of every engine's free room, on every submit and pump that finds it waiting, was the largest
share of a decision's cost on a fleet of 64 engines. Free room changes on one place at a time (a grant, a
release, a pause, a program's KV held between turns), so the order is sorted once per capacity snapshot and
then each read moves only the places whose holdings changed since the last read (a binary search and a list
insert each: O(changed x log engines)).
"""

from __future__ import annotations

from bisect import bisect_left, insort
from typing import Any, Iterable

from .working_set import Holdings

__all__ = ["FreeRank"]

#: Places moved one by one up to this many changed since the last read; beyond it, one sort of them all.
_FEW = 8


class FreeRank:
    """Engine places as (held - ceiling, index, place), i.e. most free room first, ties in the given order.

    Args: hold: the ledger's Holdings (its ``touched`` set names the places that changed; this class drains
    it); places: (place, ceiling in tokens, under pressure) in the snapshot's order. Build a new one when the
    snapshot (the places, their ceilings or their usage) changes. ``pressed``: the places under pressure;
    ``smallest_ceiling``: the least ceiling of them all (tokens; 0 without places).
    """

    __slots__ = ("_hold", "_ceiling", "_key", "_order", "pressed", "smallest_ceiling")

    def __init__(self, hold: Holdings, places: Iterable[tuple[Any, int, bool]]) -> None:
        self._hold = hold
        self._ceiling: dict[Any, tuple[int, int]] = {}  # place -> (its index, its ceiling)
        self._key: dict[Any, tuple[int, int, Any]] = {}
        self.pressed: set[Any] = set()
        for i, (place, ceiling, pressed) in enumerate(places):
            self._ceiling[place] = (i, ceiling)
            self._key[place] = (hold.total(place) - ceiling, i, place)
            if pressed:
                self.pressed.add(place)
        self._order = sorted(self._key.values())
        self.smallest_ceiling = min((c for _, c in self._ceiling.values()), default=0)
        hold.touched.clear()

    def __contains__(self, place: Any) -> bool:
        """Whether ``place`` is one of the engine places ranked."""
        return place in self._key

    def key(self, place: Any) -> tuple[int, int, Any]:
        """``place``'s entry in order(), as of the last call to it: (-free tokens, index, place)."""
        return self._key[place]

    def order(self) -> list[tuple[int, int, Any]]:
        """Every place as (-free tokens, index, place), most free first; the list itself (read, do not keep:
        the next call updates it in place)."""
        touched = self._hold.touched
        if touched:
            order, key, total = self._order, self._key, self._hold.total
            few = len(touched) <= _FEW
            for place in touched:
                old = key.get(place)
                if old is None:
                    continue  # not an engine of the snapshot (the fleet, or an engine gone)
                i, ceiling = self._ceiling[place]
                new = (total(place) - ceiling, i, place)
                if new != old:
                    key[place] = new
                    if few:
                        del order[bisect_left(order, old)]
                        insort(order, new)
            if not few:  # most places moved: one sort (in C) beats a search and a list insert each
                order[:] = sorted(key.values())
            touched.clear()
        return self._order
