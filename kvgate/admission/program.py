"""Program-aware admission: per-engine working sets of whole programs, pause and resume (pure, injected ``now``).

A program is one session (its session_id): a chain of turns with tool calls in between. Its resident KV
between turns is its last prompt + output (the engine's own prompt_tokens + completion_tokens once a turn
has answered). For every place (an engine, one of its data-parallel ranks, or the whole fleet when
kvgate does not know where a session goes) the working set is the resident KV of its live programs plus
the in-flight reservations, counted in the ledger (shared prompt prefixes once) against the place's
capacity (max_total_num_tokens x headroom).

Rules (ThunderAgent's program scheduler, reference program-scheduling.md section 1, adapted to a proxy
that can only hold requests and close engine sessions):
- a continuing turn of a live program is never held: it reserves its increment (its prompt minus the
  prefix it already holds, plus its decode budget) and goes at once;
- a new program starts only when its place has room for its whole first turn, and not ahead of a paused
  program waiting on that place;
- when a place's working set exceeds its capacity, programs that are in a tool call (no request in flight)
  are paused until it fits: their resident KV stops counting, and the shell closes their engine session so
  SGLang evicts that KV first (0.5.17+: closing drops the session's references; the next request re-opens
  it and is tagged again). If only running programs are left, they are marked and pause at the end of
  their turn: kvgate never interrupts a running decode;
- a paused program's next turn waits in kvgate and resumes when its place has room for its whole context
  again (its KV is assumed gone, as in the paper);
- aging: any waiting turn goes after ``max_wait_s`` (bypass-aged, still reserving), so nothing starves;
- fail-open as the fifo policy: protected work bypasses (reserving), a missing or stale capacity signal
  lets everything bypass and pauses nothing.

Victim rule (``victim``): "smallest" pauses the smallest in-tool program first, as ThunderAgent's
paper and code do: re-prefilling a context of c tokens costs ~c^2 attention work, so the smallest victim
costs the least to bring back; "largest" frees the most per pause (fewest programs paused); "longest-idle"
pauses the program whose tool call has run longest: tool times are heavy-tailed, so it is the least likely
to come back soon and wait for room itself (the radix cache's LRU would evict it first anyway); "ahead"
(default) aims at the step's makespan (the last program to finish): the in-tool program furthest ahead of
its group (GRPO siblings: the programs whose first prompt is the same) in turns done pauses first, then the
one with the most turns done, then the smallest; a program far along has the least work left, so delaying
it is least likely to delay the step's last program (the programs with the most work left).
Resume order (``resume``): "smallest" (ThunderAgent's greedy resume packs the most programs into the room freed)
or "fifo" (default: longest waiting first, so no paused program starves behind smaller ones). On the bench's
many-programs scenario the defaults finished as soon as ThunderAgent's smallest/smallest and a little sooner
than longest-idle, which has the shorter TTFT tail (docs/benchmark.md).

A program's state comes from evidence, not only from the TTL:
- live (a turn in flight), in a tool call, paused (held by kvgate), and ended: a program in a tool call
  idle far past what its own gaps between turns and its group's predict (``overdue_multiple`` x the
  ``overdue_quantile`` of those gaps; ``overdue_default_s`` until any gap has been seen; at most the TTL).
  An ended program still holds its KV on the engine, so it is the first to pause: on overflow, and whenever a
  waiting turn finds no room on its place (pausing closes its engine session, which frees its KV first). If
  it was only slow and its next turn comes, that turn resumes it like any paused program's.
- the TTL (``program_ttl_s``) stays as the backstop; a program whose session closed (the client, or
  kvgate's idle close) leaves the working set at once (:meth:`ProgramCoordinator.forget`).
Pauses are bounded (``resume_deadline_s``): a paused program's turn that has waited that long resumes
ahead of everything, pausing in-tool programs on its place (ended ones first, then by the victim rule) to
make its room; when only running programs hold the place it waits for them (aging still bounds it).

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

The shell calls submit / pump / release / cancel / reconcile / invalidate like the fifo coordinator, and
after each call executes ``take_actions()`` (close the engine session of each paused program).
"""

from __future__ import annotations

import enum
import heapq
import itertools
import math
from collections import deque
from dataclasses import dataclass, field
from collections.abc import Mapping
from typing import Any, Hashable, Iterator

from .capacity import ClusterSnapshot
from .coordinator import Decision, DecisionTally, Kind
from .ledger import Grant, Ledger, Refusal, check_tokens
from .working_set import FLEET

__all__ = ["ProgramCoordinator", "ProgramState", "Action", "VICTIM_RULES", "RESUME_ORDERS", "BOUND_REASON"]

VICTIM_RULES = ("smallest", "largest", "longest-idle", "ahead")
RESUME_ORDERS = ("smallest", "fifo")
#: The reason a waiter gives while its place has no free seat under the resident bound.
BOUND_REASON = "resident-bound"
_NO_SEAT = object()  # _Program.seat of a program that holds no seat
_SEAT_FREE = object()  # _seat_short: a seat is free


class ProgramState(str, enum.Enum):
    """live: a turn is in flight; in_tool: between turns (a tool call runs); paused: held by kvgate; ended:
    in a tool call far past what its own and its group's gaps predict (reported by program_states; inside the
    coordinator such a program is IN_TOOL with an overdue deadline behind it)."""

    LIVE = "live"
    IN_TOOL = "in_tool"
    PAUSED = "paused"
    ENDED = "ended"


#: Gaps between turns remembered per program, per group, and for the whole fleet (the newest kept).
OWN_GAPS, GROUP_GAPS, FLEET_GAPS = 16, 64, 512
#: Gaps needed before a quantile is read from them (fewer: the next wider source, then the default).
MIN_GAPS = 3


@dataclass(frozen=True)
class Action:
    """Something the shell must do: ``kind`` "close" = close ``session_id``'s engine session (a pause)."""

    kind: str
    session_id: str
    place: Any


@dataclass
class _Program:
    sid: Hashable
    place: Any
    state: ProgramState
    since: float
    resident: int = 0
    blocks: tuple = ()
    turns: int = 0
    marked: bool = False
    ended: bool = False  # the session closed while a turn was in flight: drop it when the turn ends
    inflight: dict = field(default_factory=dict)  # ticket -> see _start_turn
    scale: float = 1.0  # engine prompt_tokens / kvgate's estimate, from the last answered turn
    group: Hashable = None  # the chain hash of its first turn's prompt: GRPO siblings share it
    last_end: float | None = None  # when its last turn ended (None: no turn has ended yet)
    overdue_at: float = float("inf")  # idle past this: ended (from its and its group's gaps)
    gaps: deque = field(default_factory=lambda: deque(maxlen=OWN_GAPS))
    seat: Any = _NO_SEAT  # the place whose resident seat it holds (resident bound on)
    claim: tuple | None = None  # paused, expected back: (until, n) of the seat kept for it against new programs


@dataclass(slots=True)
class _Waiter:
    ticket: Hashable
    sid: Hashable
    tokens: int
    prompt_tokens: int
    place: Any
    blocks: tuple
    enqueued_at: float
    resume: bool
    seq: int
    reason: str | None = None
    bound: bool = False  # counted once in wait_resident_bound
    movable: bool = False  # kvgate places it: it may go to any engine with room


class ProgramCoordinator:
    """Program-level admission in front of a :class:`Ledger` (see the module doc for the rules).

    Args: ledger; max_wait_s (>= 0): aging bound, seconds; window_s: window for rates (default the ledger's);
    victim: one of VICTIM_RULES; resume: one of RESUME_ORDERS; program_ttl_s (> 0): a program idle this long
    between turns (or paused without a waiting turn) is treated as ended. overdue_multiple (>= 0; 0: off):
    a program in a tool call idle longer than this x the ``overdue_quantile`` (0, 1] of its own and its
    group's gaps between turns (the fleet's when they have too few; ``overdue_default_s`` (> 0) before any
    gap is known) counts as ended, the first to pause. resume_deadline_s (None or 0: off; else > 0): a paused
    program's turn waiting this long makes its own room (see the module doc), seconds. max_resident (None:
    off; else an int >= 1): at most this many programs resident per KV pool, new programs waiting for a seat
    (the module doc's resident bound). reclaim_after_s (None: off; else >= 0): a turn that has waited this long
    (the capacity poll interval) with no room anywhere it may go pauses programs that hold KV without evidence
    they will come back (one answered turn, no gap between turns seen), longest idle first. Raises ValueError
    on bad values.
    """

    def __init__(self, ledger: Ledger, max_wait_s: float = 30.0, *, window_s: float | None = None,
                 victim: str = "ahead", resume: str = "fifo", program_ttl_s: float = 600.0,
                 overdue_multiple: float = 3.0, overdue_quantile: float = 0.9, overdue_default_s: float = 60.0,
                 resume_deadline_s: float | None = None, max_resident: int | None = None,
                 reclaim_after_s: float | None = 2.0) -> None:
        if isinstance(max_wait_s, bool) or not isinstance(max_wait_s, (int, float)) or not max_wait_s >= 0:
            raise ValueError(f"max_wait_s must be >= 0, got {max_wait_s!r}")
        if victim not in VICTIM_RULES:
            raise ValueError(f"victim must be one of {VICTIM_RULES}, got {victim!r}")
        if resume not in RESUME_ORDERS:
            raise ValueError(f"resume must be one of {RESUME_ORDERS}, got {resume!r}")
        if not (isinstance(program_ttl_s, (int, float)) and program_ttl_s > 0):
            raise ValueError(f"program_ttl_s must be > 0, got {program_ttl_s!r}")
        self.ledger = ledger
        self.max_wait_s = float(max_wait_s)
        self.window_s = float(window_s) if window_s is not None else ledger.window_s
        self.victim = victim
        self.resume = resume
        self.program_ttl_s = float(program_ttl_s)
        if not (isinstance(overdue_multiple, (int, float)) and math.isfinite(overdue_multiple) and overdue_multiple >= 0):
            raise ValueError(f"overdue_multiple must be >= 0, got {overdue_multiple!r}")
        if not (isinstance(overdue_quantile, (int, float)) and 0 < overdue_quantile <= 1):
            raise ValueError(f"overdue_quantile must be in (0, 1], got {overdue_quantile!r}")
        if not (isinstance(overdue_default_s, (int, float)) and overdue_default_s > 0):
            raise ValueError(f"overdue_default_s must be > 0, got {overdue_default_s!r}")
        if resume_deadline_s is not None and not (isinstance(resume_deadline_s, (int, float))
                                                  and resume_deadline_s >= 0):
            raise ValueError(f"resume_deadline_s must be >= 0 or None, got {resume_deadline_s!r}")
        self.overdue_multiple = float(overdue_multiple)
        self.overdue_quantile = float(overdue_quantile)
        self.overdue_default_s = float(overdue_default_s)
        self.resume_deadline_s = float(resume_deadline_s) if resume_deadline_s else None
        if max_resident is not None and (isinstance(max_resident, bool) or not isinstance(max_resident, int)
                                         or max_resident < 1):
            raise ValueError(f"max_resident must be an int >= 1 or None, got {max_resident!r}")
        self.max_resident = max_resident
        if reclaim_after_s is not None and not (isinstance(reclaim_after_s, (int, float))
                                                and math.isfinite(reclaim_after_s) and reclaim_after_s >= 0):
            raise ValueError(f"reclaim_after_s must be >= 0 or None, got {reclaim_after_s!r}")
        self._failed: dict[Any, int] = {}  # within one pump: place -> the smallest charge refused there
        self._failed_max = 0  # the largest of those records
        self._reclaim_due: deque = deque()  # (enqueued_at + reclaim_after_s, ticket) per waiter, in arrival order
        self.reclaim_after_s = None if reclaim_after_s is None else float(reclaim_after_s)
        # the resident bound's books (kept only while it is on): seats held per place and in all, seats kept
        # for paused programs per place and in all, and when those keeps lapse, earliest first:
        # (until, n, sid), current while the program's claim is (until, n)
        self._resident_on: dict[Any, int] = {}
        self._resident_n = 0
        self._claims_on: dict[Any, int] = {}
        self._claims_n = 0
        self._claim_due: list[tuple[float, int, Hashable]] = []
        # gaps between turns (seconds): per group of programs and for the fleet, the newest kept
        self._group_gaps: dict[Hashable, deque] = {}
        self._fleet_gaps: deque = deque(maxlen=FLEET_GAPS)
        self._fleet_bound: float | None = None  # the fleet's quantile, recomputed as gaps come in
        self._fleet_fresh = 0
        self._groups: dict[Hashable, set] = {}  # group -> its programs (for the "ahead" victim rule)
        # per place: (overdue_at, n, sid, last_end) of its in-tool programs, earliest first; stale entries
        # (the program moved on) are dropped when read
        self._due: dict[Any, list] = {}
        self._programs: dict[Hashable, _Program] = {}
        # Idle programs' TTL deadlines, earliest first: (since + program_ttl_s, n, sid, since). An entry is
        # current while its program is idle (no turn in flight) with that ``since``; stale ones are dropped when
        # they reach the top, or all at once when they outnumber the programs. Expiry and the next deadline
        # read the top instead of scanning every program on every request.
        self._idle: list[tuple[float, int, Hashable, float]] = []
        self._idle_n = itertools.count()
        # entries that came due while their program had a turn waiting: back in the heap when the waiter leaves
        self._idle_waiting: dict[Hashable, tuple[float, int, Hashable, float]] = {}
        self._ticket_sid: dict[Hashable, Hashable] = {}
        self._queue: dict[Hashable, _Waiter] = {}  # in arrival order (each waiter joins once, at the end)
        self._waiting_on: dict[Any, int] = {}   # place -> waiters on it
        self._resuming_on: dict[Any, int] = {}  # place -> paused programs' turns waiting on it
        self._resume_q: dict[Hashable, _Waiter] = {}  # paused programs' turns, in arrival order
        self._from_queue: set[Hashable] = set()
        self._seq = itertools.count(1)
        self._actions: list[Action] = []
        self.pauses: dict[str, int] = {}
        self.resumes: dict[str, int] = {}
        self.tally = DecisionTally((
            "admit", "wait", "bypass", "bypass_protected", "bypass_degraded", "bypass_aged", "cancelled",
            "backfilled", "pause", "resume", "marked", "programs_ended", "prefix_miss_tokens", "pause_overdue",
            "resume_deadline", "wait_resident_bound", "moved", "reclaimed"), self.window_s)
        self.counters = self.tally.counters  # the same dict: lifetime counters

    # ---------------------------------------------------------------- bookkeeping
    def _count(self, name: str, now: float, by: int = 1) -> None:
        self.tally.count(name, now, by)

    def _record(self, d: Decision, now: float) -> Decision:
        return self.tally.record(d, now)

    @staticmethod
    def _label(place: Any) -> str:
        if place is FLEET:
            return "fleet"
        return f"{place[0]}#{place[1]}" if isinstance(place, tuple) else str(place)

    def take_actions(self) -> list[Action]:
        """The actions decided since the last call (pauses to execute), oldest first."""
        out, self._actions = self._actions, []
        return out

    # ---------------------------------------------------------------- the request path
    def submit(self, ticket: Hashable, tokens: int, protected: bool, now: float, *, place: Any = None,
               blocks: tuple = (), session_id: Hashable | None = None, prompt_tokens: int | None = None,
               movable: bool = False) -> Decision:
        """Decide for a new in-scope request of ``tokens`` reservation (``prompt_tokens`` of it the prompt,
        ``blocks`` its prefix hashes) from ``session_id`` (None = a one-turn program) going to ``place``.
        ``movable``: kvgate places this call itself, so a turn that would wait may go to another engine with
        room (its decision's lease names the place; the shell sends it there).

        Returns ADMIT or BYPASS_* (forward now; release it when the attempt ends) or WAIT (a later pump()
        returns its final decision). Raises ValueError for negative or non-int tokens.
        """
        if type(tokens) is not int or tokens < 0:  # one check for the usual int; then the precise rule
            check_tokens(tokens)
        if ticket in self._queue:
            w = self._queue[ticket]
            return Decision(ticket, Kind.WAIT, w.tokens, now - w.enqueued_at, True, None, w.reason)
        held = self.ledger.lease(ticket)
        if held is not None:
            return Decision(ticket, Kind.BYPASS_PROTECTED if held.forced else Kind.ADMIT, held.tokens, 0.0, False, held)
        sid = session_id if session_id is not None else ("one-turn", ticket)
        prompt = tokens if prompt_tokens is None else max(0, min(int(prompt_tokens), tokens))
        self._expire(now)
        p = self._programs.get(sid)
        if p is not None and not p.inflight and p.last_end is not None:
            self._gap(p, now - p.last_end)  # its tool call (or the client's think time) took this long
        place = self.ledger.resolve_place(place)
        if p is not None and p.state is not ProgramState.PAUSED and p.place != place and not p.inflight:
            self._move(p, place)  # placement learned (or changed) where this session goes
        place = p.place if p is not None and p.inflight else place
        tokens, prompt = self._corrected(p, tokens, prompt)
        degraded = self.ledger.is_degraded(now)
        if protected or degraded:
            kind = Kind.BYPASS_PROTECTED if protected else Kind.BYPASS_DEGRADED
            lease = None
            if not degraded:
                lease = self.ledger.try_acquire(ticket, tokens, now, place=place, blocks=blocks, force=True).lease
            self._start_turn(sid, ticket, place, tokens, prompt, blocks, now, resumed=False)
            d = self._record(Decision(ticket, kind, tokens, lease=lease), now)
            if lease is not None:
                self._relieve(place, now)
            return d
        if p is not None and p.state is not ProgramState.PAUSED and not (
                p.seat is _NO_SEAT and p.state is ProgramState.IN_TOOL and self.max_resident is not None):
            # a continuing turn of a live program: never held (its KV is resident; holding it would thrash).
            # Under the resident bound, a program whose only turn was cancelled holds no KV and no seat: its
            # next turn waits for a seat like a new program's.
            self.ledger.unhold(sid)
            lease = self.ledger.try_acquire(ticket, tokens, now, place=place, blocks=blocks, force=True).lease
            self._start_turn(sid, ticket, place, tokens, prompt, blocks, now, resumed=False)
            d = self._record(Decision(ticket, Kind.ADMIT, tokens, 0.0, False, lease), now)
            self._relieve(place, now)
            return d
        resume = p is not None and p.state is ProgramState.PAUSED
        w = _Waiter(ticket, sid, tokens, prompt, place, tuple(blocks), float(now), resume, next(self._seq),
                    movable=movable)
        self._ticket_sid[ticket] = sid
        if self.max_resident is not None and self._seat_short(w) is not _SEAT_FREE:
            self._bound_reason(w, now)  # the pump that follows pauses ended programs to free a seat
        else:
            # Work-conserving: it waits only when no engine it may go to has room now (earlier waiters that
            # fit nowhere do not hold it back; aging bounds theirs).
            r, where = self._fit(w, now)
            if isinstance(r, Grant):
                self._moved(w, where, now)
                self._start_turn(sid, ticket, where, tokens, prompt, blocks, now, resumed=resume)
                return self._record(Decision(ticket, Kind.ADMIT, tokens, 0.0, False, r.lease), now)
            w.reason = r.reason
        self._join(w)
        return self._record(Decision(ticket, Kind.WAIT, tokens, 0.0, True, None, w.reason), now)

    # ---------------------------------------------------------------- the resident bound
    def _wait_reason(self, w: _Waiter, reason: str, now: float) -> None:
        if reason == BOUND_REASON:
            self._bound_reason(w, now)
        else:
            w.reason = reason

    def _bound_reason(self, w: _Waiter, now: float) -> None:
        w.reason = BOUND_REASON
        if not w.bound:
            w.bound = True
            self._count("wait_resident_bound", now)

    @staticmethod
    def _one_turn(sid: Hashable) -> bool:
        return isinstance(sid, tuple) and bool(sid) and sid[0] == "one-turn"

    def _sync_seat(self, p: _Program) -> None:
        """Bring ``p``'s seat in line with its state: held on its place while it is resident (live, or in a
        tool call having answered a turn; not one-turn), else none. Call after every change of its state or
        place (idempotent)."""
        if self.max_resident is None:
            return
        if p.state is ProgramState.LIVE or p.state is ProgramState.IN_TOOL and p.last_end is not None:
            want = _NO_SEAT if self._one_turn(p.sid) else p.place
        else:
            want = _NO_SEAT
        if p.seat is want or p.seat == want:
            return
        if p.seat is not _NO_SEAT:
            self._resident_n -= 1
            _decrement(self._resident_on, p.seat)
        if want is not _NO_SEAT:
            self._resident_n += 1
            self._resident_on[want] = self._resident_on.get(want, 0) + 1
        p.seat = want

    def _claim(self, p: _Program, until: float) -> None:
        """Keep a seat on ``p``'s place for the paused ``p`` against new programs until ``until``."""
        self._unclaim(p)
        n = next(self._idle_n)
        p.claim = (until, n)
        self._claims_n += 1
        self._claims_on[p.place] = self._claims_on.get(p.place, 0) + 1
        if until < math.inf:
            heapq.heappush(self._claim_due, (until, n, p.sid))
            if len(self._claim_due) > 2 * len(self._programs) + 64:  # mostly stale: keep the current ones
                self._claim_due = [e for e in self._claim_due if self._claim_current(e)]
                heapq.heapify(self._claim_due)

    def _unclaim(self, p: _Program) -> None:
        if p.claim is None:
            return
        p.claim = None
        self._claims_n -= 1
        _decrement(self._claims_on, p.place)

    def _claim_current(self, e: tuple[float, int, Hashable]) -> bool:
        p = self._programs.get(e[2])
        return p is not None and p.claim == (e[0], e[1])

    def _expire_claims(self, now: float) -> None:
        """Drop the seats kept for paused programs whose predicted gap has passed: they count as ended."""
        due = self._claim_due
        while due and due[0][0] <= now:
            e = heapq.heappop(due)
            if self._claim_current(e):
                self._unclaim(self._programs[e[2]])

    def _next_claim_end(self) -> float | None:
        due = self._claim_due
        while due and not self._claim_current(due[0]):
            heapq.heappop(due)
        return due[0][0] if due else None

    def _seats(self, place: Any) -> int:
        return self.max_resident * self.ledger.pools_of(place)

    def _seat_short(self, w: _Waiter) -> Any:
        """Where ``w``'s program finds no free seat: its place (full), FLEET (the fleet's N x pools are all
        taken), or _SEAT_FREE. A new program counts the seats kept for paused programs; a resume does not
        (the kept seat is its own, and resumes go before new programs)."""
        new = not w.resume
        place = self.ledger.resolve_place(w.place)
        if place is not FLEET:
            used = self._resident_on.get(place, 0) + (self._claims_on.get(place, 0) if new else 0)
            if used >= self._seats(place):
                return place
        if self._resident_n + (self._claims_n if new else 0) >= self._seats(FLEET):
            return FLEET
        return _SEAT_FREE

    def _seat_for(self, w: _Waiter, now: float, overdue_only: bool) -> bool:
        """Whether a seat is free for ``w`` (resident bound), after pausing resident in-tool programs where
        the seats are short to free one: only ended ones when ``overdue_only``, else ended ones first and then
        the victim rule (a paused program's turn past the resume deadline)."""
        short = self._seat_short(w)
        while short is not _SEAT_FREE:
            scope = short
            for p in self._seat_victims(scope, w, now, overdue_only):
                self._pause(p, now)
                short = self._seat_short(w)
                if short is _SEAT_FREE or short != scope:
                    break
            else:
                return False  # nobody left to pause where the seats are short
        return True

    def _seat_victims(self, scope: Any, w: _Waiter, now: float, overdue_only: bool) -> Iterator[_Program]:
        """Resident in-tool programs on ``scope`` (every place for FLEET) in the order _seat_for pauses them."""
        if overdue_only:
            yield from self._overdue_on(scope, now)  # ended programs hold their seat until paused
            return
        for p in self._victims([p for p in self._programs.values() if p.state is ProgramState.IN_TOOL
                                and p.seat is not _NO_SEAT and (scope is FLEET or p.place == scope)
                                and p.sid != w.sid], now):
            if p.state is ProgramState.IN_TOOL:
                yield p

    def _join(self, w: _Waiter) -> None:
        self._queue[w.ticket] = w
        if self.reclaim_after_s is not None:
            self._reclaim_due.append((w.enqueued_at + self.reclaim_after_s, w.ticket))
        self._waiting_on[w.place] = self._waiting_on.get(w.place, 0) + 1
        if w.resume:
            self._resuming_on[w.place] = self._resuming_on.get(w.place, 0) + 1
            self._resume_q[w.ticket] = w

    def _drop(self, w: _Waiter) -> None:
        del self._queue[w.ticket]
        if w.resume:
            del self._resume_q[w.ticket]
        for counts in (self._waiting_on, self._resuming_on) if w.resume else (self._waiting_on,):
            _decrement(counts, w.place)

    def _corrected(self, p: _Program | None, tokens: int, prompt: int) -> tuple[int, int]:
        """Scale the prompt part by what the engine reported for this program's last turn (text estimates are
        chars / ratio; the engine counts real tokens)."""
        if p is None or p.scale == 1.0 or prompt <= 0:
            return tokens, prompt
        adj = max(1, int(round(prompt * p.scale)))
        return max(0, tokens - prompt + adj), adj

    def _start_turn(self, sid: Hashable, ticket: Hashable, place: Any, tokens: int, prompt: int, blocks: tuple,
                    now: float, resumed: bool) -> None:
        p = self._programs.get(sid)
        if p is None:
            p = self._programs[sid] = _Program(sid, place, ProgramState.LIVE, now)
            if blocks and not (isinstance(sid, tuple) and sid and sid[0] == "one-turn"):
                p.group = blocks[-1]  # its whole first prompt: GRPO siblings start from the same one
                self._groups.setdefault(p.group, set()).add(sid)
        elif p.state is ProgramState.PAUSED:
            resumed = True
            self._unclaim(p)  # resident again: the seat kept for it is the one it takes
        if resumed:
            lab = self._label(p.place)
            self.resumes[lab] = self.resumes.get(lab, 0) + 1
            self._count("resume", now)
        self.ledger.unhold(sid)  # the turn's lease now holds its whole prompt, resident prefix included
        p.place = place
        p.state = ProgramState.LIVE
        p.ended = False
        p.since = now
        p.overdue_at = math.inf
        # (reservation, prompt, blocks, resident before, prefix expected cached: none after a pause)
        p.inflight[ticket] = (tokens, prompt, tuple(blocks), p.resident, 0 if resumed else p.resident)
        self._ticket_sid[ticket] = sid
        self._sync_seat(p)

    def _move(self, p: _Program, place: Any) -> None:
        size = self.ledger.holding(p.sid)
        self.ledger.unhold(p.sid)
        p.place = place
        self._sync_seat(p)  # it counts where placement moved it (which may hold N already)
        if size:
            self.ledger.hold(p.sid, place, p.blocks, size)
        if p.state is ProgramState.IN_TOOL and p.last_end is not None:
            self._push_due(p)

    def release(self, ticket: Hashable, now: float, observed: Mapping[str, Any] | None = None) -> list[Decision]:
        """The upstream attempt for ``ticket`` ended; ``observed`` is the response's meta_info (prompt_tokens,
        completion_tokens, cached_tokens) or None. Ends the turn: the program's resident KV becomes the engine's
        prompt + output (else the reservation), or it pauses now if it was marked. Returns pump(now)."""
        if ticket in self._queue:
            self.cancel(ticket, now)
            return self.pump(now)
        self._from_queue.discard(ticket)
        self.ledger.release(ticket, now)
        self._end_turn(ticket, now, observed, cancelled=False)
        return self.pump(now)

    def _end_turn(self, ticket: Hashable, now: float, observed: Mapping[str, Any] | None, cancelled: bool) -> None:
        sid = self._ticket_sid.pop(ticket, None)
        p = self._programs.get(sid) if sid is not None else None
        if p is None or ticket not in p.inflight:
            return
        tokens, prompt, blocks, before, expected_prefix = p.inflight.pop(ticket)
        if isinstance(sid, tuple) and sid and sid[0] == "one-turn":
            self._remove(p)
            return
        if cancelled:
            resident = before
            blocks = p.blocks
        else:
            resident = tokens  # no answer read: keep what was reserved (the safe side)
            m = observed if isinstance(observed, Mapping) else {}
            pt, ct = _nonneg_int(m.get("prompt_tokens")), _nonneg_int(m.get("completion_tokens"))
            cached = _nonneg_int(m.get("cached_tokens"))
            if pt is not None:
                resident = pt + (ct or 0)
                if prompt > 0:
                    p.scale = min(4.0, max(0.25, pt * p.scale / prompt))
                if cached is not None and expected_prefix > 0:
                    expected = min(expected_prefix, pt)
                    if cached < expected:  # the engine evicted part of this program's own prefix
                        self._count("prefix_miss_tokens", now, expected - cached)
            p.turns += 1
        p.blocks = blocks
        p.resident = resident
        if p.inflight:
            return
        p.since = now
        if p.ended:
            self._remove(p)
            self._count("programs_ended", now)
            return
        if not cancelled:
            p.last_end = now
        if p.marked:
            self._pause(p, now)  # idle from now on: _pause keeps its end
        else:
            self._idle_from(p, now)
            p.state = ProgramState.IN_TOOL
            self._sync_seat(p)  # a program whose only turn so far was cancelled holds no KV, hence no seat
            self.ledger.hold(p.sid, p.place, p.blocks, p.resident)
            if p.last_end is not None:
                p.overdue_at = p.last_end + self._overdue_after(p)
                self._push_due(p)
            self._relieve(p.place, now)

    def cancel(self, ticket: Hashable, now: float) -> bool:
        """The waiter for ``ticket`` left before it used its decision: removes it from the queue, or releases a
        grant racing with it (and restores the program as it was). True if something was removed. Call pump."""
        w = self._queue.get(ticket)
        if w is not None:
            self._drop(w)
            self._ticket_sid.pop(ticket, None)
            e = self._idle_waiting.pop(w.sid, None)
            if e is not None:  # due while it waited: its program ends at the next expiry unless a turn waits still
                heapq.heappush(self._idle, e)
            self._count("cancelled", now)
            return True
        if ticket in self._from_queue:
            self._from_queue.discard(ticket)
            self.ledger.release(ticket, now)
            self._end_turn(ticket, now, None, cancelled=True)
            self._count("cancelled", now)
            return True
        return False

    def consumed(self, ticket: Hashable) -> None:
        """The shell started forwarding ``ticket``'s granted request."""
        self._from_queue.discard(ticket)

    def adopt_paused(self, session_id: Hashable, place: Any, resident: int, now: float) -> bool:
        """Another kvgate replica paused ``session_id``'s program (closed its engine session) with ``resident``
        tokens of context, and its next turn comes here: make it a paused program here too, so that turn
        resumes by the resume rules (room for its whole context; ahead of new programs on its place) instead
        of starting as a new program. Returns False (nothing changed) when this replica knows the program."""
        if session_id in self._programs:
            return False
        p = _Program(session_id, self.ledger.resolve_place(place), ProgramState.PAUSED, float(now),
                     resident=max(0, int(resident)))
        self._programs[session_id] = p
        self._idle_from(p, p.since)
        return True

    def forget(self, session_id: Hashable, now: float) -> None:
        """The session ended (closed by the client or by kvgate's idle close): its program and resident KV go.
        A turn in flight keeps its lease until it ends."""
        p = self._programs.get(session_id)
        if p is None:
            return
        self._idle_waiting.pop(session_id, None)
        self.ledger.unhold(session_id)
        if p.inflight:
            p.marked = False
            p.ended = True
            return
        self._remove(p)
        self._count("programs_ended", now)

    # ---------------------------------------------------------------- pausing
    def _relieve(self, place: Any, now: float) -> None:
        """Pause in-tool programs on ``place`` (victim rule) until its working set fits its capacity; then mark
        running ones to pause at the end of their turn."""
        if self.ledger.is_degraded(now):
            return
        over = self.ledger.reserved_on(place) - self.ledger.ceiling_of(place)
        if place is FLEET:
            over = max(over, self.ledger.reserved - self.ledger.ceiling)
        if over <= 0:
            return
        on = [p for p in self._programs.values() if p.place == place]
        for p in self._victims([p for p in on if p.state is ProgramState.IN_TOOL], now):
            if over <= 0:
                return
            over -= self._pause(p, now)
        for p in self._victims([p for p in on if p.state is ProgramState.LIVE and not p.marked], now):
            if over <= 0:
                return
            p.marked = True
            self._count("marked", now)
            over -= sum(t for t, *_ in p.inflight.values())

    def _victims(self, progs: list[_Program], now: float) -> list[_Program]:
        """``progs`` in pause order: ended ones (idle past their predicted gap) first, then the victim rule."""
        if self.victim == "ahead":
            def ahead(p: _Program) -> float:
                g = self._groups.get(p.group) if p.group is not None else None
                if not g or len(g) < 2:
                    return 0.0
                return p.turns - sum(self._programs[s].turns for s in g) / len(g)
            key = lambda p: (-ahead(p), -p.turns, p.resident)  # noqa: E731
        elif self.victim == "longest-idle":
            key = lambda p: -(now - p.since)  # noqa: E731
        elif self.victim == "largest":
            key = lambda p: -p.resident  # noqa: E731
        else:
            key = lambda p: p.resident  # noqa: E731
        return sorted(progs, key=lambda p: (p.overdue_at > now, key(p)))

    def _pause(self, p: _Program, now: float) -> int:
        ended = p.overdue_at <= now
        if ended:
            self._count("pause_overdue", now)
        freed = self.ledger.unhold(p.sid)
        p.overdue_at = math.inf
        p.state = ProgramState.PAUSED
        p.marked = False
        if self.max_resident is not None:
            self._sync_seat(p)
            until = (p.last_end if p.last_end is not None else now) + self._overdue_after(p)
            if not ended and until > now and not self._one_turn(p.sid):
                self._claim(p, until)  # expected back: its seat is kept until its predicted gap has passed
        if not ended:  # an ended program's TTL still counts from its last turn (its idle entry stays current)
            p.since = now
            if not p.inflight:
                self._idle_from(p, now)
        lab = self._label(p.place)
        self.pauses[lab] = self.pauses.get(lab, 0) + 1
        self._count("pause", now)
        if isinstance(p.sid, str):
            self._actions.append(Action("close", p.sid, p.place))
        return freed

    # ---------------------------------------------------------------- the queue
    def pump(self, now: float) -> list[Decision]:
        """Decide for waiting turns at ``now``; returns decisions for those that leave. Ages first (waited >=
        max_wait_s -> BYPASS_AGED, reserving), degraded -> all BYPASS_DEGRADED, then paused programs' turns past
        the resume deadline, then every waiter in order (paused programs' turns by the resume order, then new
        programs' in arrival order): each goes where it fits (work-conserving: a waiter that fits nowhere
        does not hold back a later one that fits).

        Each refusal records the smallest charge that failed on its place; a later waiter whose charge cannot
        be smaller than every place's record is skipped without asking the ledger, so with thousands waiting
        on full engines a pump reads each waiter once and asks the ledger about as often as turns leave."""
        self._expire(now)
        out: list[Decision] = []
        if not self._queue:
            return out
        if self.ledger.is_degraded(now):
            for w in list(self._queue.values()):
                out.append(self._leave(w, Kind.BYPASS_DEGRADED, None, max(0.0, now - w.enqueued_at), now))
            return out
        while self._queue:
            w = next(iter(self._queue.values()))
            if now < w.enqueued_at + self.max_wait_s:  # the very sum next_deadline names: no float gap
                break
            waited = max(0.0, now - w.enqueued_at)
            g = self.ledger.try_acquire(w.ticket, w.tokens, now, place=w.place, blocks=w.blocks, force=True)
            out.append(self._leave(w, Kind.BYPASS_AGED, g.lease, waited, now))
            self._relieve(w.place, now)
        if self.resume_deadline_s is not None:
            stopped: set[Any] = set()
            for w in list(self._resume_q.values()):
                if now < w.enqueued_at + self.resume_deadline_s:
                    break  # arrival order: the rest waited less
                waited = max(0.0, now - w.enqueued_at)
                if w.place in stopped:
                    continue
                r = self._room_for(w, now, overdue_only=False)
                if isinstance(r, Grant):
                    self._count("resume_deadline", now)
                    out.append(self._leave(w, Kind.ADMIT, r.lease, waited, now))
                else:  # only running programs hold its place: it waits for them (aging still bounds it)
                    self._wait_reason(w, r.reason, now)
                    stopped.add(w.place)
        self._failed, self._failed_max = {}, 0
        for w in self._ordered():
            if self.max_resident is not None and not self._seat_for(w, now, overdue_only=True):
                self._wait_reason(w, BOUND_REASON, now)
                continue
            if self._hopeless(w):
                continue
            r, where = self._fit(w, now)
            if not isinstance(r, Grant) and self._reclaimable(w, now):
                r, where = self._reclaim(w, now)
            if isinstance(r, Grant):
                out.append(self._leave(w, Kind.ADMIT, r.lease, max(0.0, now - w.enqueued_at), now, where))
            else:
                self._wait_reason(w, r.reason, now)
        return out

    def _room_for(self, w: _Waiter, now: float, overdue_only: bool):
        """try_acquire for ``w``; refused for room, pause in-tool programs on its place until it fits: only
        ended ones (idle past their predicted gap) when ``overdue_only``, else ended ones first and then the
        victim rule (a paused program's turn past the resume deadline). Under the resident bound a seat comes
        first, freed the same way (refused: reason BOUND_REASON). Returns the last Grant or Refusal."""
        if self.max_resident is not None and not self._seat_for(w, now, overdue_only):
            return Refusal(w.ticket, w.tokens, BOUND_REASON)  # the coordinator's own reason, not the ledger's
        r = self.ledger.try_acquire(w.ticket, w.tokens, now, place=w.place, blocks=w.blocks)
        if isinstance(r, Grant) or r.reason != "capacity_exhausted":
            return r
        if overdue_only:
            victims: Iterator[_Program] = self._overdue_on(w.place, now)
        else:
            victims = iter(self._victims([p for p in self._programs.values() if p.state is ProgramState.IN_TOOL
                                          and (w.place is FLEET or p.place == w.place) and p.sid != w.sid], now))
        for p in victims:
            if p.state is not ProgramState.IN_TOOL:
                continue
            self._pause(p, now)
            r = self.ledger.try_acquire(w.ticket, w.tokens, now, place=w.place, blocks=w.blocks)
            if isinstance(r, Grant) or r.reason != "capacity_exhausted":
                return r
        return r

    # ---------------------------------------------------------------- where a waiting turn fits
    def _places_for(self, w: _Waiter) -> list[Any]:
        """Where ``w`` may go, its own place first: every engine (DP rank) of the snapshot when kvgate places
        the call (``movable``) and its place is known, else its place alone."""
        if not w.movable or w.place is FLEET:
            return [w.place]
        return [w.place, *(pl for pl in self.ledger.engine_places() if pl != w.place)]

    def _lower_bound(self, w: _Waiter) -> int:
        """The least ``w`` can charge on any place: its tokens less the whole blocks another holder may share
        (0 when it is larger than any engine: oversized requests are admitted alone, so never skipped)."""
        if w.tokens > self.ledger.max_tokens(FLEET):
            return 0
        return max(0, w.tokens - len(w.blocks) * self.ledger.block_tokens)

    def _hopeless(self, w: _Waiter) -> bool:
        """Within one pump: every place ``w`` may go refused a charge no larger than ``w``'s least charge."""
        failed = self._failed
        if not failed:
            return False
        lb = self._lower_bound(w)
        if lb <= 0:
            return False
        if not w.movable or w.place is FLEET:
            return w.place in failed and lb >= failed[w.place]
        # any engine: every one must have refused no more than lb (O(1): the count and the largest record)
        return len(failed) >= len(self.ledger.engine_places()) and lb >= self._failed_max

    def _fit(self, w: _Waiter, now: float) -> tuple[Grant | Refusal, Any]:
        """try_acquire for ``w`` on its own place, then (``movable``) on the other engines, those that already
        hold the most of its prompt first, then the most free; returns (the Grant and where, or the first
        Refusal and w's place). A refusal is recorded for _hopeless."""
        places = self._places_for(w)
        first: Refusal | None = None
        if len(places) > 1:
            # only the places that could take its least charge, and are not under pressure, are ranked (a
            # full fleet of 64 engines costs one comparison each, not a prefix walk each)
            lg = self.ledger
            lb, th = self._lower_bound(w), lg.pressure_threshold
            rest = [pl for pl in places[1:] if lg.free_on(pl) >= lb and lg.usage_of(pl) < th]
            rest.sort(key=lambda pl: (lg.charge(pl, w.tokens, w.blocks), -lg.free_on(pl)))
            places = [places[0], *rest]
        for pl in places:
            r = self.ledger.try_acquire(w.ticket, w.tokens, now, place=pl, blocks=w.blocks)
            if isinstance(r, Grant):
                return r, pl
            self._note_refusal(w, pl, r)
            if first is None:
                first = r
        return first, w.place

    def _note_refusal(self, w: _Waiter, place: Any, r: Refusal) -> None:
        failed = self._failed
        charge = 0 if r.reason != "capacity_exhausted" else self.ledger.charge(place, w.tokens, w.blocks)
        if charge < failed.get(place, 1 << 62):
            failed[place] = charge
            self._failed_max = max(failed.values())

    def _moved(self, w: _Waiter, where: Any, now: float) -> None:
        if where != w.place:
            self._count("moved", now)

    # ---------------------------------------------------------------- reclaiming KV held without evidence
    def _unsupported(self, p: _Program, now: float) -> bool:
        """``p`` holds KV with no evidence it will come back: in a tool call after its only answered turn, no
        gap between turns of its own seen (a one-turn job looks like this, and so does an agent in its first
        tool call: pausing the latter costs one re-prefill of one turn's context)."""
        return p.state is ProgramState.IN_TOOL and p.turns <= 1 and not p.gaps and not p.inflight

    def _reclaimable(self, w: _Waiter, now: float) -> bool:
        return self.reclaim_after_s is not None and now >= w.enqueued_at + self.reclaim_after_s

    def _reclaim(self, w: _Waiter, now: float) -> tuple[Grant | Refusal, Any]:
        """``w`` has waited reclaim_after_s with no room: on the first place it may go where pausing the
        programs that hold KV without evidence (longest idle first) could make its room, pause them one by one
        until it fits. Returns (Grant, where) or (the last Refusal, w's place)."""
        lg = self.ledger
        last: Grant | Refusal = Refusal(w.ticket, w.tokens, "capacity_exhausted")
        for pl in self._places_for(w):
            if lg.usage_of(pl) >= lg.pressure_threshold:
                continue
            cands = sorted((p for p in self._programs.values() if p.place == pl and self._unsupported(p, now)),
                           key=lambda p: p.since)
            if not cands:
                continue
            room = lg.free_on(pl) + sum(lg.holding(p.sid) for p in cands)
            if room < self._lower_bound(w):
                continue
            for p in cands:
                self._pause(p, now)
                self._count("reclaimed", now)
                last = lg.try_acquire(w.ticket, w.tokens, now, place=pl, blocks=w.blocks)
                if isinstance(last, Grant):
                    self._failed.pop(pl, None)
                    return last, pl
            self._failed.pop(pl, None)
        return last, w.place

    # ---------------------------------------------------------------- evidence: gaps between turns
    def _gap(self, p: _Program, gap: float) -> None:
        """Record one gap between ``p``'s turns (seconds) for it, its group and the fleet."""
        if gap < 0 or not self.overdue_multiple:
            return
        p.gaps.append(gap)
        if p.group is not None:
            g = self._group_gaps.get(p.group)
            if g is None:
                g = self._group_gaps[p.group] = deque(maxlen=GROUP_GAPS)
            g.append(gap)
        self._fleet_gaps.append(gap)
        self._fleet_fresh += 1
        if self._fleet_fresh >= 16 or self._fleet_bound is None and len(self._fleet_gaps) >= MIN_GAPS:
            self._fleet_fresh = 0
            self._fleet_bound = _quantile(self._fleet_gaps, self.overdue_quantile)

    def _overdue_after(self, p: _Program) -> float:
        """Seconds after its last turn ended at which ``p`` counts as ended: overdue_multiple x the larger of
        the quantile of its own gaps and of its group's (the fleet's when its group has too few;
        overdue_default_s before any gap is known), at most program_ttl_s; inf when off."""
        if not self.overdue_multiple:
            return math.inf
        own = _quantile(p.gaps, self.overdue_quantile) if len(p.gaps) >= MIN_GAPS else 0.0
        g = self._group_gaps.get(p.group) if p.group is not None else None
        if g is not None and len(g) >= MIN_GAPS:
            wide = _quantile(g, self.overdue_quantile)
        elif self._fleet_bound is not None:
            wide = self._fleet_bound
        else:
            return min(self.overdue_default_s, self.program_ttl_s)
        return min(self.overdue_multiple * max(own, wide), self.program_ttl_s)

    def _push_due(self, p: _Program) -> None:
        if p.overdue_at == math.inf:
            return
        heap = self._due.setdefault(p.place, [])
        heapq.heappush(heap, (p.overdue_at, next(self._idle_n), p.sid, p.last_end))
        if len(heap) > 2 * len(self._programs) + 64:
            heap[:] = [e for e in heap if self._due_current(e, p.place)]
            heapq.heapify(heap)

    def _due_current(self, e: tuple, place: Any) -> bool:
        p = self._programs.get(e[2])
        return (p is not None and p.state is ProgramState.IN_TOOL and not p.inflight and p.place == place
                and p.last_end == e[3] and p.overdue_at == e[0])

    def _next_due(self, place: Any) -> float | None:
        heap = self._due.get(place)
        while heap and not self._due_current(heap[0], place):
            heapq.heappop(heap)
        if not heap:
            if heap is not None:
                del self._due[place]
            return None
        return heap[0][0]

    def _overdue_on(self, place: Any, now: float) -> Iterator[_Program]:
        """Ended programs (past their overdue time at ``now``) on ``place`` (every place for FLEET), earliest
        first; each is taken off the index as it is yielded."""
        for pl in (list(self._due) if place is FLEET else [place]):
            while True:
                due = self._next_due(pl)
                if due is None or due > now:
                    break
                e = heapq.heappop(self._due[pl])
                yield self._programs[e[2]]

    def _remove(self, p: _Program) -> None:
        if self.max_resident is not None:
            p.state = ProgramState.ENDED  # leaves its seat, and any seat kept for it
            self._sync_seat(p)
            self._unclaim(p)
        del self._programs[p.sid]
        g = self._groups.get(p.group) if p.group is not None else None
        if g is not None:
            g.discard(p.sid)
            if not g:
                del self._groups[p.group]
                self._group_gaps.pop(p.group, None)

    def _ordered(self) -> Iterator[_Waiter]:
        """Paused programs' turns (resume order), then new programs' in arrival order; safe to leave from."""
        if self._resuming_on:
            res = list(self._resume_q.values())
            res.sort(key=(lambda w: (w.tokens, w.seq)) if self.resume == "smallest" else (lambda w: w.seq))
            yield from res
        for w in list(self._queue.values()):
            if not w.resume:
                yield w

    def _leave(self, w: _Waiter, kind: Kind, lease, waited: float, now: float, where: Any = None) -> Decision:
        self._drop(w)
        self._idle_waiting.pop(w.sid, None)  # its turn starts: the entry is stale
        if lease is not None:
            self._from_queue.add(w.ticket)
        if where is not None:
            self._moved(w, where, now)
            w.place = where
        self._start_turn(w.sid, w.ticket, w.place, w.tokens, w.prompt_tokens, w.blocks, now, resumed=w.resume)
        return self._record(Decision(w.ticket, kind, w.tokens, waited, True, lease, w.reason), now)

    def _idle_from(self, p: _Program, since: float) -> None:
        """``p`` has no turn in flight since ``since`` (its ``since``): it ends ``program_ttl_s`` later unless a
        turn starts (an entry whose program has moved on is stale and skipped)."""
        heapq.heappush(self._idle, (since + self.program_ttl_s, next(self._idle_n), p.sid, since))
        if len(self._idle) > 2 * len(self._programs) + 64:  # mostly stale: keep the current entries only
            self._idle = [e for e in self._idle if self._idle_current(e)]
            heapq.heapify(self._idle)

    def _idle_current(self, e: tuple[float, int, Hashable, float]) -> bool:
        p = self._programs.get(e[2])
        return p is not None and not p.inflight and p.since == e[3]

    def _expire(self, now: float) -> None:
        """End expired leases' turns, and end programs idle for program_ttl_s (not those with a turn waiting:
        theirs is looked at again when the waiter leaves). O(expired) per call, not O(programs)."""
        for t in self.ledger.expire(now):
            self._from_queue.discard(t)
            self._end_turn(t, now, None, cancelled=False)
        if self._claim_due:
            self._expire_claims(now)
        if self._due and not self.ledger.is_degraded(now):
            # No reservation outlives the evidence for it: a program idle past what its own and its group's
            # gaps predict has ended; pausing it closes its engine session, so its KV is freed for real.
            for p in self._overdue_on(FLEET, now):
                if p.state is ProgramState.IN_TOOL and not p.inflight:
                    self._pause(p, now)
        idle = self._idle
        waiting: set | None = None
        again = []
        while idle and idle[0][0] <= now:
            e = heapq.heappop(idle)
            if not self._idle_current(e):
                continue
            if waiting is None:
                waiting = {w.sid for w in self._queue.values()}
            if e[2] in waiting:
                self._idle_waiting[e[2]] = e
            elif now - e[3] >= self.program_ttl_s:
                self.forget(e[2], now)
            else:  # within a rounding error of the boundary: look again at the exact deadline
                again.append((e[3] + self.program_ttl_s + 1e-9 * max(1.0, abs(e[3])), next(self._idle_n), e[2], e[3]))
        for e in again:
            heapq.heappush(idle, e)

    def reconcile(self, snapshot: ClusterSnapshot, now: float) -> list[Decision]:
        """Install a capacity snapshot, pause where a place now overflows, and return pump(now)."""
        self.ledger.reconcile(snapshot, now)
        for place in {p.place for p in self._programs.values()}:
            self._relieve(place, now)
        return self.pump(now)

    def invalidate(self, now: float) -> list[Decision]:
        """No capacity signal: degraded at once; every waiter bypasses (returns pump(now))."""
        self.ledger.invalidate()
        return self.pump(now)

    # ---------------------------------------------------------------- figures
    @property
    def waiting(self) -> int:
        return len(self._queue)

    def waiting_tickets(self) -> list[Hashable]:
        return [w.ticket for w in sorted(self._queue.values(), key=lambda w: w.seq)]

    def is_waiting(self, ticket: Hashable) -> bool:
        return ticket in self._queue

    def state_of(self, session_id: Hashable) -> ProgramState | None:
        p = self._programs.get(session_id)
        return None if p is None else p.state

    def resident_of(self, session_id: Hashable) -> int:
        p = self._programs.get(session_id)
        return 0 if p is None else p.resident

    def next_deadline(self, now: float) -> float | None:
        """Earliest time pump() could decide without another event: a waiter's aging, staleness while someone
        waits, a lease expiry, a program's TTL, a program turning ended or a seat kept for a paused one lapsing
        while someone waits."""
        cands: list[float] = []
        if self._queue:
            # the queue is in arrival order (monotonic clock): its first waiter ages first
            cands.append(next(iter(self._queue.values())).enqueued_at + self.max_wait_s)
            stale = self.ledger.degraded_at()
            if stale is not None:
                cands.append(stale)
        exp = self.ledger.next_expiry()
        if exp is not None:
            cands.append(exp)
        idle = self._idle
        while idle and not self._idle_current(idle[0]):
            heapq.heappop(idle)
        if idle:
            cands.append(idle[0][0])
        if self.overdue_multiple:
            # a program in a tool call that turns ended is paused then (its KV freed for real)
            for place in list(self._due):
                due = self._next_due(place)
                if due is not None:
                    cands.append(due)
        rq = self._reclaim_due
        while rq and (rq[0][0] <= now or rq[0][1] not in self._queue):
            rq.popleft()  # due ones were looked at by the pump that came with their time, or left
        if rq:
            cands.append(rq[0][0])
        if self._queue and self._claims_n:
            # a new program waiting for a seat goes when the seat kept for a paused program lapses
            due = self._next_claim_end()
            if due is not None:
                cands.append(due)
        if self._resume_q and self.resume_deadline_s is not None:
            for w in self._resume_q.values():  # arrival order: those past the deadline first (pumped on events)
                due = w.enqueued_at + self.resume_deadline_s
                if due > now:
                    cands.append(due)
                    break
        return max(now, min(cands)) if cands else None

    def program_states(self, now: float | None = None) -> dict[str, dict[str, int]]:
        """{place label: {state: programs}} (one-turn requests without a session are not programs); with
        ``now``, programs in a tool call past their predicted gap count as ``ended``."""
        out: dict[str, dict[str, int]] = {}
        for p in self._programs.values():
            if isinstance(p.sid, tuple) and p.sid and p.sid[0] == "one-turn":
                continue
            d = out.setdefault(self._label(p.place), {s.value: 0 for s in ProgramState})
            state = p.state
            if state is ProgramState.IN_TOOL and now is not None and p.overdue_at <= now:
                state = ProgramState.ENDED
            d[state.value] += 1
        return out

    def seats(self, now: float) -> dict[str, dict[str, int]]:
        """The resident bound by place label: {resident: programs holding KV there, kept_for_paused: seats kept
        for paused programs expected back, limit: max_resident x the place's KV pools}; {} while it is off."""
        if self.max_resident is None:
            return {}
        out: dict[str, dict[str, int]] = {}
        for place in set(self._resident_on) | set(self._claims_on):
            out[self._label(place)] = {"resident": self._resident_on.get(place, 0),
                                       "kept_for_paused": self._claims_on.get(place, 0),
                                       "limit": self._seats(place)}
        return out

    def stats(self, now: float) -> dict[str, Any]:
        """JSON-able figures: counters, waiting (resumes / new; waiting_bound: for a seat), programs by place and
        state, pauses and resumes by place, the resident bound's seats by place, window rates and the ledger's
        figures."""
        return {
            "policy": "program",
            "counters": dict(self.counters),
            "waiting": self.waiting,
            "waiting_resume": sum(1 for w in self._queue.values() if w.resume),
            "window_s": self.window_s,
            **self.tally.window(now),
            "max_wait_s": self.max_wait_s,
            "victim": self.victim,
            "resume_order": self.resume,
            "programs": self.program_states(now),
            "overdue_multiple": self.overdue_multiple,
            "resume_deadline_s": self.resume_deadline_s,
            "max_resident": self.max_resident,
            "waiting_bound": sum(1 for w in self._queue.values() if w.reason == BOUND_REASON),
            "seats": self.seats(now),
            "pauses": dict(self.pauses),
            "resumes": dict(self.resumes),
            "ledger": self.ledger.stats(now),
        }


def _quantile(values, q: float) -> float:
    """The ``q`` quantile (0 < q <= 1) of a non-empty collection of numbers (the nearest-rank value)."""
    xs = sorted(values)
    return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]


def _decrement(counts: dict, key: Any) -> None:
    """counts[key] -= 1, the key dropped at 0 (the per-place counts hold only places with something)."""
    n = counts[key] - 1
    if n:
        counts[key] = n
    else:
        del counts[key]


def _nonneg_int(v: Any) -> int | None:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        return None
    return v
