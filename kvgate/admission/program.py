"""Program-aware admission: per-engine working sets of whole programs, pause and resume (pure, injected ``now``).

A program is one session (its session_id): a chain of turns with tool calls in between. Its resident KV
between turns is its last prompt + output (the engine's own prompt_tokens + completion_tokens once a turn
has answered). For every place (an engine, one of its data-parallel ranks, or the whole fleet when
kvgate does not know where a session goes) the working set is the resident KV of its live programs plus
the in-flight reservations, counted in the ledger (shared prompt prefixes once) against the place's
capacity (max_total_num_tokens x headroom).

Rules (ThunderAgent's program scheduler: the ThunderAgent paper, arXiv 2602.13692, section 4, adapted to a
proxy that can only hold requests and close engine sessions):
- a continuing turn of a live program is never held: it reserves its increment (its prompt minus the
  prefix it already holds, plus its decode budget) and goes at once;
- a new program starts only when its place has room for its whole first turn, and not ahead of a paused
  program waiting on that place; a paused program's next turn waits and resumes when its place has room for
  its whole context again; aging bounds every wait (the queue: kvgate.admission.program_queue);
- when a place's working set exceeds its capacity, programs that are in a tool call are paused until it fits
  (their engine session closed), running ones marked to pause at the end of their turn (the pauses:
  kvgate.admission.program_pause; in what order: kvgate.admission.victims);
- fail-open as the fifo policy: protected work bypasses (reserving), a missing or stale capacity signal
  lets everything bypass and pauses nothing.

A program's state comes from evidence, not only from the TTL: live (a turn in flight), in a tool call, paused
(held by kvgate), and ended: in a tool call idle far past what its own gaps between turns and its group's
predict (kvgate.admission.turn_gaps), the first to pause. The TTL (``program_ttl_s``) stays as the backstop; a
program whose session closed (the client, or kvgate's idle close) leaves the working set at once
(:meth:`ProgramCoordinator.forget`). The resident bound (``max_resident``, off by default) caps the programs
holding KV per KV pool (kvgate.admission.seats).

The shell calls submit / pump / release / cancel / reconcile / invalidate like the fifo coordinator, and
after each call executes ``take_actions()`` (close the engine session of each paused program).
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Mapping
from typing import Any, Hashable

from .capacity import ClusterSnapshot
from .coordinator import Decision, DecisionTally, Kind
from .deadlines import Deadlines
from .ledger import Grant, Ledger, check_tokens
from .pause_gate import STOP_RATIO, PauseGate
from .prefill_rate import WAIT_BOUNDS, PrefillRate
from .program_figures import _Figures
from .program_pause import _Pausing
from .program_queue import _WaitingTurns
from .records import (BOUND_REASON, NO_SEAT, Action, ProgramState, WaitReason, _Program, _Waiter, nonneg_int,
                      one_turn)
from .seats import SEAT_FREE, Seats
from .turn_gaps import TurnGaps
from .victims import RESUME_ORDERS, VICTIM_RULES, Groups, ResumeOrder, VictimRule, resume_key
from .working_set import FLEET

__all__ = ["ProgramCoordinator", "ProgramState", "Action", "VICTIM_RULES", "RESUME_ORDERS", "BOUND_REASON",
           "VictimRule", "ResumeOrder", "WaitReason", "WAIT_BOUNDS"]

_NO_SEAT = NO_SEAT  # its former name (tests read a program's seat against it)


class ProgramCoordinator(_WaitingTurns, _Pausing, _Figures):
    """Program-level admission in front of a :class:`Ledger` (the rules: the module doc and the modules it names).

    Args: ledger; max_wait_s (>= 0): aging bound, seconds; window_s: window for rates (default the ledger's);
    victim: one of VICTIM_RULES; resume: one of RESUME_ORDERS; program_ttl_s (> 0): a program idle this long
    between turns (or paused without a waiting turn) is treated as ended. overdue_multiple (>= 0; 0: off):
    a program in a tool call idle longer than this x the ``overdue_quantile`` (0, 1] of its own and its
    group's gaps between turns (the fleet's when they have too few; ``overdue_default_s`` (> 0) before any
    gap is known) counts as ended, the first to pause. resume_deadline_s (None or 0: off; else > 0): a paused
    program's turn waiting this long makes its own room (kvgate.admission.program_queue), seconds. max_resident (None:
    off; else an int >= 1): at most this many programs resident per KV pool, new programs waiting for a seat
    (kvgate.admission.seats). reclaim_after_s (None: off; else >= 0): a turn that has waited this long
    (the capacity poll interval) with no room anywhere it may go pauses programs that hold KV without evidence
    they will come back (one answered turn, no gap between turns seen), longest idle first. wait_bound: one
    of WAIT_BOUNDS: "reprefill" (a turn that waits for room waits no longer than re-prefilling the KV its
    admission would displace takes, at the prefill rate learned from the answers (kvgate.admission.prefill_rate),
    then goes as bypass-cost; max_wait_s still bounds it) or "aging" (max_wait_s alone). pause_start_ratio (>= 0;
    0, the default here: always; kvgate serves with pause_gate.START_RATIO), pause_stop_ratio (<= it),
    pause_window_s (> 0; None: window_s), pause_min_span_s (>= 0) and pause_foresee_cycles (>= 0; 0: off): when
    holding and pausing may pay (kvgate.admission.pause_gate: the re-prefill ratio measured from the answers, and
    its foresight); otherwise every turn goes at once, as with lifecycle alone. Raises ValueError on bad values.
    """

    def __init__(self, ledger: Ledger, max_wait_s: float = 30.0, *, window_s: float | None = None,
                 victim: str = "ahead", resume: str = "fifo", program_ttl_s: float = 600.0,
                 overdue_multiple: float = 3.0, overdue_quantile: float = 0.9, overdue_default_s: float = 60.0,
                 resume_deadline_s: float | None = None, max_resident: int | None = None,
                 reclaim_after_s: float | None = 2.0, wait_bound: str = "aging",
                 pause_start_ratio: float = 0.0, pause_stop_ratio: float = STOP_RATIO,
                 pause_window_s: float | None = None, pause_min_span_s: float = 5.0,
                 pause_foresee_cycles: float = 0.0) -> None:
        if isinstance(max_wait_s, bool) or not isinstance(max_wait_s, (int, float)) or not max_wait_s >= 0:
            raise ValueError(f"max_wait_s must be >= 0, got {max_wait_s!r}")
        if wait_bound not in WAIT_BOUNDS:
            raise ValueError(f"wait_bound must be one of {WAIT_BOUNDS}, got {wait_bound!r}")
        if victim not in VICTIM_RULES:
            raise ValueError(f"victim must be one of {VICTIM_RULES}, got {victim!r}")
        if resume not in RESUME_ORDERS:
            raise ValueError(f"resume must be one of {RESUME_ORDERS}, got {resume!r}")
        if not (isinstance(program_ttl_s, (int, float)) and program_ttl_s > 0):
            raise ValueError(f"program_ttl_s must be > 0, got {program_ttl_s!r}")
        self.ledger = ledger
        self.max_wait_s = float(max_wait_s)
        self.window_s = float(window_s) if window_s is not None else ledger.window_s
        self.victim = VictimRule(victim)
        self.resume = ResumeOrder(resume)
        self._resume_key = resume_key(self.resume)
        self.program_ttl_s = float(program_ttl_s)
        if not (isinstance(overdue_multiple, (int, float)) and math.isfinite(overdue_multiple) and overdue_multiple >= 0):
            raise ValueError(f"overdue_multiple must be >= 0, got {overdue_multiple!r}")
        if not (isinstance(overdue_quantile, (int, float)) and 0 < overdue_quantile <= 1):
            raise ValueError(f"overdue_quantile must be in (0, 1], got {overdue_quantile!r}")
        if not (isinstance(overdue_default_s, (int, float)) and overdue_default_s > 0):
            raise ValueError(f"overdue_default_s must be > 0, got {overdue_default_s!r}")
        if resume_deadline_s is not None and not (isinstance(resume_deadline_s, (int, float)) and resume_deadline_s >= 0):
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
        self._failed_max = 0  # the largest of those records (kept as they come; read again after a reclaim drops some)
        self._failed_dropped = False
        self._freed = False  # within one pump: a reclaim paused programs
        self._unsup: dict[Any, list] | None = None  # within one pump: KV held without evidence, by place
        self._reclaim_due: deque = deque()  # (enqueued_at + reclaim_after_s, ticket) per waiter, in arrival order
        self.reclaim_after_s = None if reclaim_after_s is None else float(reclaim_after_s)
        self._programs: dict[Hashable, _Program] = {}
        # the same programs by place, each place's in no particular order (their n gives _programs' order): a
        # place that overflows reads its own programs, not all of them (_relieve runs on every turn's end)
        self._on: dict[Any, dict[Hashable, _Program]] = {}
        self._joined = itertools.count()
        self._groups = Groups()  # group -> its programs, and their turns done (for the "ahead" victim rule)
        self._n = itertools.count()  # the n of every deadline entry (ties keep push order)
        self._bound = Seats(max_resident, ledger, self._programs, self._n)  # the resident bound's books
        self._gaps = TurnGaps(self.overdue_multiple, self.overdue_quantile, self.overdue_default_s,
                              self.program_ttl_s)
        # per place: when its in-tool programs turn ended, (overdue_at, n, sid, last_end) (program_pause.py); and
        # the same entries in one heap for the whole fleet (the eager pause and next_deadline read its top only)
        self._due: dict[Any, Deadlines] = {}
        self._due_all = Deadlines(self._due_current_anywhere, self._programs.__len__, self._n)
        # Idle programs' TTL deadlines: (since + program_ttl_s, n, sid, since), current while its program is idle
        # (no turn in flight) with that ``since``. Expiry and the next deadline read the top instead of scanning
        # every program on every request.
        self._ttl = Deadlines(self._idle_current, self._programs.__len__, self._n)
        self.wait_bound = wait_bound
        self.prefill = PrefillRate()  # seconds per prefilled token, learned from the answers
        # whether pausing can pay: what re-prefilling evicted KV costs the calls (validates the ratios)
        self.gate = PauseGate(pause_start_ratio, pause_stop_ratio if pause_start_ratio else 0.0,
                              window_s=self.window_s if pause_window_s is None else pause_window_s,
                              min_span_s=pause_min_span_s, foresee_cycles=pause_foresee_cycles)
        # waiters bounded by the re-prefill their admission would cause: (cost_due, n, ticket, cost_due)
        self._cost_due = Deadlines(self._cost_current, self._queue_len, self._n)
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
            "resume_deadline", "wait_resident_bound", "moved", "reclaimed", "bypass_cost", "admit_gate_closed",
            "transfer_refill_tokens"),
            self.window_s)
        self.counters = self.tally.counters  # the same dict: lifetime counters

    # the books under their former names (read by tests and tools)
    _idle = property(lambda self: self._ttl.heap)
    _resident_on = property(lambda self: self._bound.resident_on)
    _resident_n = property(lambda self: self._bound.resident_n)
    _claims_on = property(lambda self: self._bound.claims_on)
    _claims_n = property(lambda self: self._bound.claims_n)

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
            self._gap_seen(p, now - p.last_end, now)  # its tool call (or the client's think time) took this long
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
        self.gate.started(now)
        continuing = p is not None and p.state is not ProgramState.PAUSED and not (
            p.seat is NO_SEAT and p.state is ProgramState.IN_TOOL and self.max_resident is not None)
        if continuing or not self._pausing(now):
            # a continuing turn of a live program: never held (its KV is resident; holding it would thrash).
            # Under the resident bound, a program whose only turn was cancelled holds no KV and no seat: its
            # next turn waits for a seat like a new program's. Where pausing cannot pay (the gate is closed)
            # every turn goes at once, as with lifecycle alone.
            if not continuing:
                self._count("admit_gate_closed", now)
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
        if self.max_resident is not None and self._bound.short(w) is not SEAT_FREE:
            self._bound_reason(w, now)  # the pump that follows pauses ended programs to free a seat
        else:
            # Work-conserving: it waits only when no engine it may go to has room now (earlier waiters that
            # fit nowhere do not hold it back; aging bounds theirs).
            r, where = self._fit(w, now)
            if isinstance(r, Grant):
                self._moved(w, where, now)
                self._start_turn(sid, ticket, where, tokens, prompt, blocks, now, resumed=resume)
                return self._record(Decision(ticket, Kind.ADMIT, tokens, 0.0, False, r.lease), now)
            w.reason = WaitReason.of(r.reason)
        self._join(w)
        return self._record(Decision(ticket, Kind.WAIT, tokens, 0.0, True, None, w.reason), now)

    # ---------------------------------------------------------------- the resident bound
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
            p = self._join_program(_Program(sid, place, ProgramState.LIVE, now))
            if blocks and not one_turn(sid):
                p.group = blocks[-1]  # its whole first prompt: GRPO siblings start from the same one
                self._groups.join(p.group, sid, p.turns)
        elif p.state is ProgramState.PAUSED:
            resumed = True
            self._bound.unclaim(p)  # resident again: the seat kept for it is the one it takes
        if resumed:
            lab = self._label(p.place)
            self.resumes[lab] = self.resumes.get(lab, 0) + 1
            self._count("resume", now)
        self.ledger.unhold(sid)  # the turn's lease now holds its whole prompt, resident prefix included
        self._relocate(p, place)
        p.state = ProgramState.LIVE
        p.ended = False
        p.since = now
        p.overdue_at = math.inf
        # (reservation, prompt, blocks, resident before, prefix expected cached: none after a pause)
        p.inflight[ticket] = (tokens, prompt, tuple(blocks), p.resident, 0 if resumed else p.resident, now)
        self._ticket_sid[ticket] = sid
        self._bound.sync(p)

    def _move(self, p: _Program, place: Any) -> None:
        size = self.ledger.holding(p.sid)
        self.ledger.unhold(p.sid)
        self._relocate(p, place)
        self._bound.sync(p)  # it counts where placement moved it (which may hold N already)
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
        tokens, prompt, blocks, before, expected_prefix, started = p.inflight.pop(ticket)
        if not cancelled and isinstance(observed, Mapping):
            self.prefill.observe_answer(p.place, now - started, observed)
            self.gate.cycle.turn(now - started)
        if one_turn(sid):
            self._remove(p)
            return
        if cancelled:
            resident = before
            blocks = p.blocks
        else:
            resident = tokens  # no answer read: keep what was reserved (the safe side)
            m = observed if isinstance(observed, Mapping) else {}
            pt, ct = nonneg_int(m.get("prompt_tokens")), nonneg_int(m.get("completion_tokens"))
            cached = nonneg_int(m.get("cached_tokens"))
            if pt is not None:
                resident = pt + (ct or 0)
                if cached is not None and before > cached:  # it re-prefilled KV it had held: the gate's evidence
                    miss = min(before, pt) - cached
                    if miss > 0 and self.ledger.transfer_refilled(p.place):  # no pause saves a prefill there
                        self._count("transfer_refill_tokens", now, miss)
                    elif miss > 0:
                        self.gate.observe(now, miss, self.prefill.seconds(p.place, miss))
                if prompt > 0:
                    p.scale = min(4.0, max(0.25, pt * p.scale / prompt))
                if cached is not None and expected_prefix > 0:
                    expected = min(expected_prefix, pt)
                    if cached < expected:  # the engine evicted part of this program's own prefix
                        self._count("prefix_miss_tokens", now, expected - cached)
            p.turns += 1
            self._groups.turned(p.group)
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
        if p.marked and self._pausing(now):
            self._pause(p, now)  # idle from now on: _pause keeps its end
        else:
            p.marked = False
            self._idle_from(p, now)
            p.state = ProgramState.IN_TOOL
            self._bound.sync(p)  # a program whose only turn so far was cancelled holds no KV, hence no seat
            self.ledger.hold(p.sid, p.place, p.blocks, p.resident)
            if p.last_end is not None:
                p.overdue_at = p.last_end + self._gaps.overdue_after(p)
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
                self._ttl.push_entry(e)
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
        p = self._join_program(_Program(session_id, self.ledger.resolve_place(place), ProgramState.PAUSED,
                                        float(now), resident=max(0, int(resident))))
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

    def _remove(self, p: _Program) -> None:
        if self.max_resident is not None:
            p.state = ProgramState.ENDED  # leaves its seat, and any seat kept for it
            self._bound.sync(p)
            self._bound.unclaim(p)
        del self._programs[p.sid]
        self._unplace(p)
        if p.group is not None and self._groups.leave(p.group, p.sid, p.turns):
            self._gaps.forget_group(p.group)

    def _join_program(self, p: _Program) -> _Program:
        p.n = next(self._joined)
        self._programs[p.sid] = self._on.setdefault(p.place, {})[p.sid] = p
        return p

    def _unplace(self, p: _Program) -> None:
        here = self._on.get(p.place)
        if here is not None and here.pop(p.sid, None) is not None and not here:
            del self._on[p.place]

    def _relocate(self, p: _Program, place: Any) -> None:
        """Set ``p``'s place, keeping the index of programs by place."""
        self._unplace(p)
        p.place = place
        self._on.setdefault(place, {})[p.sid] = p

    def _idle_from(self, p: _Program, since: float) -> None:
        """``p`` has no turn in flight since ``since`` (its ``since``): it ends ``program_ttl_s`` later unless a
        turn starts (an entry whose program has moved on is stale and skipped)."""
        self._ttl.push(since + self.program_ttl_s, p.sid, since)

    def _idle_current(self, e: tuple[float, int, Hashable, float]) -> bool:
        p = self._programs.get(e[2])
        return p is not None and not p.inflight and p.since == e[3]

    def _expire(self, now: float) -> None:
        """End expired leases' turns, and end programs idle for program_ttl_s (not those with a turn waiting:
        theirs is looked at again when the waiter leaves). O(expired) per call, not O(programs)."""
        for t in self.ledger.expire(now):
            self._from_queue.discard(t)
            self._end_turn(t, now, None, cancelled=False)
        if self._bound.claim_due.heap:
            self._bound.expire_claims(now)
        due = self._due_all.heap
        if due and due[0][0] <= now and not self.ledger.is_degraded(now):
            # No reservation outlives the evidence for it: a program idle past what its gaps predict has ended.
            # Pausing closes its engine session (its KV freed for real); with the gate closed, _unreserve.
            end = self._pause if self._pausing(now) else self._unreserve
            for e in self._due_all.pop_due(now):
                end(self._programs[e[2]], now)
        ttl = self._ttl
        if not ttl.heap or ttl.heap[0][0] > now:
            return  # nothing due (most calls): no generator made
        waiting: set | None = None
        again = []
        for e in ttl.pop_due(now):
            if waiting is None:
                waiting = {w.sid for w in self._queue.values()}
            if e[2] in waiting:
                self._idle_waiting[e[2]] = e
            elif now - e[3] >= self.program_ttl_s:
                self.forget(e[2], now)
            else:  # within a rounding error of the boundary: look again at the exact deadline
                again.append((e[3] + self.program_ttl_s + 1e-9 * max(1.0, abs(e[3])), ttl.next_n(), e[2], e[3]))
        for e in again:
            ttl.push_entry(e)

    def reconcile(self, snapshot: ClusterSnapshot, now: float) -> list[Decision]:
        """Install a capacity snapshot, update the pause gate, pause where a place overflows; returns pump(now)."""
        self.ledger.reconcile(snapshot, now)
        for place in dict.fromkeys(p.place for p in self._programs.values()):  # in a reproducible order
            self._relieve(place, now)
        self._pausing(now)  # each poll, with programs or none (it closes on the ratio while all is idle)
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
            due = self._cost_due.first()
            if due is not None:
                cands.append(due)
            stale = self.ledger.degraded_at()
            if stale is not None:
                cands.append(stale)
        exp = self.ledger.next_expiry()
        if exp is not None:
            cands.append(exp)
        ends = self._ttl.first()
        if ends is not None:
            cands.append(ends)
        if self.overdue_multiple and not self.ledger.is_degraded(now):
            # a program in a tool call that turns ended is paused then (its KV freed for real; not while the
            # capacity signal is missing: the next snapshot's reconcile pumps, and a due time already past
            # would wake the timer at once, again and again)
            due = self._due_all.first()
            if due is not None:
                cands.append(due)
        rq = self._reclaim_due
        while rq and (rq[0][0] <= now or rq[0][1] not in self._queue):
            rq.popleft()  # due ones were looked at by the pump that came with their time, or left
        if rq:
            cands.append(rq[0][0])
        if self._queue and self._bound.claims_n:
            # a new program waiting for a seat goes when the seat kept for a paused program lapses
            due = self._bound.next_claim_end()
            if due is not None:
                cands.append(due)
        if self._resume_q and self.resume_deadline_s is not None:
            for w in self._resume_q.values():  # arrival order: those past the deadline first (pumped on events)
                due = w.enqueued_at + self.resume_deadline_s
                if due > now:
                    cands.append(due)
                    break
        return max(now, min(cands)) if cands else None
