"""A heap of deadlines whose entries go stale (pure).

The program policy keeps three kinds of deadline: when an idle program ends (its TTL), when a program in a tool
call turns ended (per place), and when the seat kept for a paused program lapses. Each is an entry
(deadline, n, key, stamp) pushed when the deadline is set; it is current while its program is still in the state
that set it (``current(entry)``, the owner's rule: e.g. still idle since ``stamp``). A program that moves on
leaves its entry behind instead of searching the heap: stale entries are dropped when they reach the top, and
all at once when the heap holds more than twice as many entries as there are programs (plus 64), so reading the
next deadline costs O(log n), not a scan of every program.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Any, Callable, Hashable, Iterator

__all__ = ["Deadlines"]

Entry = tuple[float, int, Hashable, Any]


class Deadlines:
    """Entries (deadline, n, key, stamp), earliest first (n: a counter, so ties keep push order).

    Args: current: entry -> whether it still holds (stale ones are skipped and dropped); live: () -> how many
    programs there are (the bound for compaction); counter: the n source (shared by an owner's heaps).
    ``heap`` is the list itself (read-only outside)."""

    __slots__ = ("heap", "current", "_live", "_n")

    def __init__(self, current: Callable[[Entry], bool], live: Callable[[], int],
                 counter: Iterator[int] | None = None) -> None:
        self.heap: list[Entry] = []
        self.current = current
        self._live = live
        self._n = counter if counter is not None else itertools.count()

    def __len__(self) -> int:
        return len(self.heap)

    def __bool__(self) -> bool:
        return bool(self.heap)

    def next_n(self) -> int:
        """The next value of the counter (an entry's n, for an owner that keeps it to test currency)."""
        return next(self._n)

    def push(self, deadline: float, key: Hashable, stamp: Any = None, n: int | None = None) -> None:
        """Add (deadline, n, key, stamp) (n: the next count unless given); when stale entries outnumber the
        live ones, keep only the current entries."""
        heap = self.heap
        heapq.heappush(heap, (deadline, next(self._n) if n is None else n, key, stamp))
        if len(heap) > 2 * self._live() + 64:  # mostly stale: keep the current entries only
            heap[:] = [e for e in heap if self.current(e)]
            heapq.heapify(heap)

    def push_entry(self, e: Entry) -> None:
        """Put an entry taken off earlier back as it was (no compaction)."""
        heapq.heappush(self.heap, e)

    def first(self) -> float | None:
        """The earliest current deadline (stale entries at the top are dropped), or None."""
        heap = self.heap
        while heap and not self.current(heap[0]):
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    def pop(self) -> Entry:
        """Take the top entry off (call after first() found it current)."""
        return heapq.heappop(self.heap)

    def pop_due(self, now: float) -> Iterator[Entry]:
        """Take off every entry due at ``now`` (deadline <= now), yielding the current ones as they come (what
        the caller does in between may make later entries stale: each is tested when it is reached)."""
        heap = self.heap
        while heap and heap[0][0] <= now:
            e = heapq.heappop(heap)
            if self.current(e):
                yield e
