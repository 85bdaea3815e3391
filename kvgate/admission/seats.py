"""The resident bound's seats: which programs hold KV per place, and the seats kept for paused ones (pure).

The resident bound (``max_resident`` N, off by default) is for programs that each grow to a large part of an
engine's KV pool: admitted when their first turn fits, they outgrow the pool together, get paused and
re-prefilled, and thrash. With the bound, at most N programs per KV pool (an engine, or one data-parallel
rank of it; N x every pool for the fleet) hold KV. A program is resident while it is live, or in a tool call
having answered a turn (one whose only turn was cancelled holds nothing); paused programs and one-turn
requests are not. Rules:
- a new program's first turn starts only while its place has a free seat; otherwise it waits with reason
  "resident-bound" and goes, in arrival order, when a seat frees: a resident program's session closes, it
  ends (TTL; or idle past its predicted gap: an ended program is paused to free its seat, as it is for room),
  or the seat kept for a paused program lapses;
- a program paused while it is expected back (not as ended) keeps its seat against new programs until its
  predicted gap has passed (``overdue_multiple`` x the quantile of its own and its group's gaps after its
  last turn, at most the TTL; until its session closes or the TTL when ``overdue_multiple`` is 0), so a new
  program never takes the seat of a paused one about to ask for it, and the bound keeps the same N programs
  to their end;
- a paused program's resume counts resident programs only (the seat kept for it is its own) and goes before
  any new program on its place, so resumes are never starved by new programs; at ``resume_deadline_s`` it
  makes its own seat as it makes its own room, pausing in-tool programs (ended ones first, then the victim
  rule); aging bounds every wait;
- protected, aged and degraded turns bypass the bound as they bypass the ledger (still counted as resident
  once they run), and a program placement moves to another engine counts there: the only ways a place holds
  more than N.
There is no automatic N. N = capacity / the final context of the programs seen to end is unsound within one
rollout step: every program of the step starts at once, so the decision is taken before any program has ended,
and the first to end are the shortest, so the evidence understates the final contexts exactly while most
programs are being admitted. The user sets N from what the step's programs grow to:
floor(max_total_num_tokens x headroom / a long program's final context) keeps every resident program's KV
to its end.

:class:`Seats` keeps the books; the coordinator (kvgate.admission.program) decides whom to pause for a seat.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Hashable, Iterator

from .deadlines import Deadlines
from .ledger import Ledger
from .records import NO_SEAT, ProgramState, _Program, _Waiter, decrement, one_turn
from .working_set import FLEET

__all__ = ["Seats", "SEAT_FREE"]

SEAT_FREE: Any = object()  # Seats.short: a seat is free


class Seats:
    """The resident bound's books: seats held per place and in all, seats kept for paused programs per place
    and in all, and when those keeps lapse, earliest first.

    Args: max_resident (None: off, every method keeps nothing; else N >= 1, checked by the coordinator);
    ledger (its KV pools per place); programs: the coordinator's {session id: program} (read to tell a current
    keep from a stale one); counter: the n source of the coordinator's deadline heaps."""

    __slots__ = ("max_resident", "ledger", "_programs", "resident_on", "resident_n", "claims_on", "claims_n",
                 "claim_due")

    def __init__(self, max_resident: int | None, ledger: Ledger, programs: Mapping[Hashable, _Program],
                 counter: Iterator[int]) -> None:
        self.max_resident = max_resident
        self.ledger = ledger
        self._programs = programs
        self.resident_on: dict[Any, int] = {}
        self.resident_n = 0
        self.claims_on: dict[Any, int] = {}
        self.claims_n = 0
        # (until, n, sid, None): current while the program's claim is (until, n)
        self.claim_due = Deadlines(self._claim_current, lambda: len(programs), counter)

    def sync(self, p: _Program) -> None:
        """Bring ``p``'s seat in line with its state: held on its place while it is resident (live, or in a
        tool call having answered a turn; not one-turn), else none. Call after every change of its state or
        place (idempotent)."""
        if self.max_resident is None:
            return
        if p.state is ProgramState.LIVE or p.state is ProgramState.IN_TOOL and p.last_end is not None:
            want = NO_SEAT if one_turn(p.sid) else p.place
        else:
            want = NO_SEAT
        if p.seat is want or p.seat == want:
            return
        if p.seat is not NO_SEAT:
            self.resident_n -= 1
            decrement(self.resident_on, p.seat)
        if want is not NO_SEAT:
            self.resident_n += 1
            self.resident_on[want] = self.resident_on.get(want, 0) + 1
        p.seat = want

    def claim(self, p: _Program, until: float) -> None:
        """Keep a seat on ``p``'s place for the paused ``p`` against new programs until ``until`` (seconds)."""
        self.unclaim(p)
        n = self.claim_due.next_n()
        p.claim = (until, n)
        self.claims_n += 1
        self.claims_on[p.place] = self.claims_on.get(p.place, 0) + 1
        if until < math.inf:
            self.claim_due.push(until, p.sid, None, n)

    def unclaim(self, p: _Program) -> None:
        """``p`` no longer has a seat kept for it (resumed, gone, or its keep lapsed)."""
        if p.claim is None:
            return
        p.claim = None
        self.claims_n -= 1
        decrement(self.claims_on, p.place)

    def _claim_current(self, e: tuple) -> bool:
        p = self._programs.get(e[2])
        return p is not None and p.claim == (e[0], e[1])

    def expire_claims(self, now: float) -> None:
        """Drop the seats kept for paused programs whose predicted gap has passed: they count as ended."""
        for e in self.claim_due.pop_due(now):
            self.unclaim(self._programs[e[2]])

    def next_claim_end(self) -> float | None:
        """When the next seat kept for a paused program lapses, or None."""
        return self.claim_due.first()

    def seats(self, place: Any) -> int:
        """The seats on ``place``: max_resident x its KV pools (FLEET: every pool)."""
        return self.max_resident * self.ledger.pools_of(place)

    def short(self, w: _Waiter) -> Any:
        """Where ``w``'s program finds no free seat: its place (full), FLEET (the fleet's N x pools are all
        taken), or SEAT_FREE. A new program counts the seats kept for paused programs; a resume does not
        (the kept seat is its own, and resumes go before new programs)."""
        new = not w.resume
        place = self.ledger.resolve_place(w.place)
        if place is not FLEET:
            used = self.resident_on.get(place, 0) + (self.claims_on.get(place, 0) if new else 0)
            if used >= self.seats(place):
                return place
        if self.resident_n + (self.claims_n if new else 0) >= self.seats(FLEET):
            return FLEET
        return SEAT_FREE

    def by_place(self, label) -> dict[str, dict[str, int]]:
        """{label(place): {resident, kept_for_paused, limit}} for every place with either; {} while off."""
        if self.max_resident is None:
            return {}
        out: dict[str, dict[str, int]] = {}
        for place in set(self.resident_on) | set(self.claims_on):
            out[label(place)] = {"resident": self.resident_on.get(place, 0),
                                 "kept_for_paused": self.claims_on.get(place, 0),
                                 "limit": self.seats(place)}
        return out
