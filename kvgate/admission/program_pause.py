"""The program policy's pauses: whom to pause, when, and how a waiting turn makes its room (pure).

Part of :class:`kvgate.admission.program.ProgramCoordinator` (a base class of it: the methods read the
coordinator's records). When a place's working set exceeds its capacity, programs in a tool call (no request in
flight) are paused until it fits, in the victim rule's order (kvgate.admission.victims), ended programs first:
their resident KV stops counting, and the shell closes their engine session so SGLang evicts that KV first
(0.5.17+: closing drops the session's references; the next request re-opens it and is tagged again). If only
running programs are left, they are marked and pause at the end of their turn: kvgate never interrupts a
running decode. A waiting turn pauses ended programs on its place to make its room (and, under the resident
bound, its seat: kvgate.admission.seats); past ``resume_deadline_s`` a paused program's turn pauses in-tool
programs by the victim rule too. A turn that has waited ``reclaim_after_s`` with no room anywhere it may go
pauses the programs that hold KV without evidence they will come back (one answered turn, no gap between turns
seen), longest idle first.

Ended programs are indexed per place by the time they turn ended (kvgate.admission.deadlines), so finding
them reads only what is due.
"""

from __future__ import annotations

import math
from functools import partial
from heapq import heappop
from operator import attrgetter
from typing import Any, Iterator

from .deadlines import Deadlines
from .ledger import Grant, Refusal
from .records import BOUND_REASON, NO_SEAT, Action, ProgramState, WaitReason, _Program, _Waiter, one_turn
from .seats import SEAT_FREE
from .victims import victim_heap, victim_order
from .working_set import FLEET

__all__: list[str] = []

_JOINED = attrgetter("n")


class _Pausing:
    """The pausing half of ProgramCoordinator (see the module doc); no state of its own."""

    def _push_due(self, p: _Program) -> None:
        """Index ``p`` (in a tool call) by the time it turns ended, on its place."""
        if p.overdue_at == math.inf:
            return
        d = self._due.get(p.place)
        if d is None:
            d = self._due[p.place] = Deadlines(partial(self._due_current, p.place), self._programs.__len__, self._n)
        d.push(p.overdue_at, p.sid, p.last_end)
        self._due_all.push(p.overdue_at, p.sid, p.last_end)

    def _gap_seen(self, p: _Program, gap: float, now: float) -> None:
        """``p``'s next turn came ``gap`` seconds after its last one ended, at ``now``: its own, its group's and
        the fleet's gaps, and the pause gate's cycle, learn it. When these are the fleet's first gaps, the other
        programs in a tool call whose end was set from ``overdue_default_s`` get the fleet's bound instead (where
        it comes sooner), those ended by it at once: two one-turn jobs that ended a second apart, on either side
        of the fleet's first gaps, used to end 60 s and ~7 s after their turns."""
        if self._gaps.record(p, gap):
            due_now = False
            for q in self._programs.values():
                if q is not p and q.state is ProgramState.IN_TOOL and not q.inflight and q.last_end is not None:
                    due = q.last_end + self._gaps.overdue_after(q)
                    if due < q.overdue_at:
                        q.overdue_at = due
                        self._push_due(q)
                        due_now = due_now or due <= now
            if due_now:
                self._expire(now)
        self.gate.cycle.gap(gap)

    def _due_current_anywhere(self, e: tuple) -> bool:
        """Whether a fleet-wide due entry still holds: its program is in the tool call that set it, wherever."""
        p = self._programs.get(e[2])
        return (p is not None and p.state is ProgramState.IN_TOOL and not p.inflight and p.last_end == e[3]
                and p.overdue_at == e[0])

    def _due_current(self, place: Any, e: tuple) -> bool:
        p = self._programs.get(e[2])
        return (p is not None and p.state is ProgramState.IN_TOOL and not p.inflight and p.place == place
                and p.last_end == e[3] and p.overdue_at == e[0])

    def _next_due(self, place: Any) -> float | None:
        d = self._due.get(place)
        if d is None:
            return None
        heap = d.heap
        if heap and self._due_current(place, heap[0]):
            return heap[0][0]  # the usual case, read without a call per place (next_deadline reads every place)
        due = d.first()
        if due is None:
            del self._due[place]
        return due

    def _overdue_on(self, place: Any, now: float) -> Iterator[_Program]:
        """Ended programs (past their overdue time at ``now``) on ``place`` (every place for FLEET), earliest
        first; each is taken off the index as it is yielded."""
        for pl in (list(self._due) if place is FLEET else [place]):
            while True:
                due = self._next_due(pl)
                if due is None or due > now:
                    break
                e = self._due[pl].pop()
                yield self._programs[e[2]]

    # ---------------------------------------------------------------- pausing
    def _pausing(self, now: float) -> bool:
        """Whether holding and pausing may pay now (kvgate.admission.pause_gate); else every turn goes at once.

        While the gate is open and turns wait on engines (the places in ``_waiting_on``), foresight reads each such
        pool as it reads an outgrown one (admitted, its waiting turns would outgrow it): the re-prefill ratio is
        low then because those turns are held, and closing on it would send them all at once, the thrash the gate
        was opened against. Where a ceiling prefills in fewer than foresee_cycles program cycles the reading does
        not hold the gate, and it closes on the ratio as before. (A turn waiting for a seat under the resident
        bound waits on its place too: held all the same.)"""
        gate = self.gate
        if gate.is_open and gate.foresee_cycles and self._waiting_on and gate.foresight_lapsed(now):
            for place in self._waiting_on:  # read only when the gate could close: one that pays will do
                if self._foresee(place, now) >= gate.foresee_cycles:
                    break
        return gate.update(now, len(self.ledger.engine_places()))

    def _foresee(self, place: Any, now: float) -> float:
        """Foresight's reading on ``place``, taken by the gate: program cycles its engine takes to prefill a whole
        ceiling at its learned rate; 0 (none taken) for the fleet or an engine no longer in the snapshot, on a
        decode worker, whose misses come back by KV transfer, or before the rate and the cycle are learned."""
        place = self.ledger.resolve_place(place)
        if place is FLEET or self.ledger.transfer_refilled(place):
            return 0.0
        rate, cycle = self.prefill.per_token_s(place), self.gate.cycle.seconds()
        if rate is None or cycle is None:
            return 0.0
        reading = self.ledger.ceiling_of(place) * rate / cycle
        self.gate.foresee(now, reading)
        return reading

    def _relieve(self, place: Any, now: float) -> None:
        """Pause in-tool programs on ``place`` (victim rule) until its working set fits its capacity; then mark
        running ones to pause at the end of their turn."""
        over = self._overflow(place, now)
        if over <= 0:
            return
        here = self._on.get(place) or {}
        heap = victim_heap([p for p in here.values() if p.state is ProgramState.IN_TOOL], self.victim, now,
                           self._groups)
        while heap:  # the victim rule's order, taken only as far as it is needed (most often one or two)
            if over <= 0:
                return
            over -= self._pause(heappop(heap)[-1], now)
        if over <= 0:
            return
        on = sorted(here.values(), key=_JOINED)  # in _programs' order, as the victim rule's ties
        for p in self._victims([p for p in on if p.state is ProgramState.LIVE and not p.marked], now):
            if over <= 0:
                return
            p.marked = True
            self._count("marked", now)
            over -= sum(t for t, *_ in p.inflight.values())

    def _overflow(self, place: Any, now: float) -> int:
        """Tokens ``place``'s working set holds beyond its ceiling (the fleet's too for FLEET); 0 while nothing may
        pause (degraded, or the pause gate closed)."""
        if self.ledger.is_degraded(now):
            return 0
        over = self.ledger.reserved_on(place) - self.ledger.ceiling_of(place)
        if over > 0:
            # The working set outgrows this pool now: the gate foresees what re-prefilling a pool's worth each
            # cycle would cost, before the evictions that would measure it
            self._foresee(place, now)
        if not self._pausing(now):
            return 0
        if place is FLEET:
            over = max(over, self.ledger.reserved - self.ledger.ceiling)
        return over

    def _victims(self, progs: list[_Program], now: float) -> list[_Program]:
        """``progs`` in pause order: ended ones (idle past their predicted gap) first, then the victim rule."""
        return victim_order(progs, self.victim, now, self._groups, self._programs)

    def _pause(self, p: _Program, now: float) -> int:
        ended = p.overdue_at <= now
        if ended:
            self._count("pause_overdue", now)
        freed = self.ledger.unhold(p.sid)
        p.overdue_at = math.inf
        p.state = ProgramState.PAUSED
        p.marked = False
        if self.max_resident is not None:
            self._bound.sync(p)
            until = (p.last_end if p.last_end is not None else now) + self._gaps.overdue_after(p)
            if not ended and until > now and not one_turn(p.sid):
                self._bound.claim(p, until)  # expected back: its seat is kept until its predicted gap has passed
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

    def _unreserve(self, p: _Program, now: float) -> int:
        """``p`` has ended (idle past what its gaps predict) while pausing is off: its reservation goes, so no
        working set, foresight reading or waiting turn counts it any more; its engine session stays open, as
        with lifecycle alone (the engine evicts an open session's KV after every closed one's, the longest
        idle first). It is still an ended program: the first to pause should the gate open, and its next turn
        continues it, reserving its whole prompt. Session placement stops counting it too (an "ended" action).
        Returns the tokens freed."""
        if isinstance(p.sid, str):
            self._actions.append(Action("ended", p.sid, p.place))
        return self.ledger.unhold(p.sid)

    def _seat_for(self, w: _Waiter, now: float, overdue_only: bool) -> bool:
        """Whether a seat is free for ``w`` (resident bound), after pausing resident in-tool programs where
        the seats are short to free one: only ended ones when ``overdue_only``, else ended ones first and then
        the victim rule (a paused program's turn past the resume deadline)."""
        short = self._bound.short(w)
        while short is not SEAT_FREE:
            scope = short
            for p in self._seat_victims(scope, w, now, overdue_only):
                self._pause(p, now)
                short = self._bound.short(w)
                if short is SEAT_FREE or short != scope:
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
                                and p.seat is not NO_SEAT and (scope is FLEET or p.place == scope)
                                and p.sid != w.sid], now):
            if p.state is ProgramState.IN_TOOL:
                yield p

    def _room_for(self, w: _Waiter, now: float, overdue_only: bool):
        """try_acquire for ``w``; refused for room, pause in-tool programs on its place until it fits: only
        ended ones (idle past their predicted gap) when ``overdue_only``, else ended ones first and then the
        victim rule (a paused program's turn past the resume deadline). Under the resident bound a seat comes
        first, freed the same way (refused: reason BOUND_REASON). Returns the last Grant or Refusal."""
        if self.max_resident is not None and not self._seat_for(w, now, overdue_only):
            return Refusal(w.ticket, w.tokens, BOUND_REASON)  # the coordinator's own reason, not the ledger's
        r = self.ledger.try_acquire(w.ticket, w.tokens, now, place=w.place, blocks=w.blocks)
        if isinstance(r, Grant) or r.reason != WaitReason.CAPACITY_EXHAUSTED:
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
            if isinstance(r, Grant) or r.reason != WaitReason.CAPACITY_EXHAUSTED:
                return r
        return r

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
        last: Grant | Refusal = Refusal(w.ticket, w.tokens, WaitReason.CAPACITY_EXHAUSTED)
        if self._unsup is None:  # once per pump: such programs by place, longest idle first
            self._unsup = {}
            for p in sorted((p for p in self._programs.values() if self._unsupported(p, now)), key=lambda p: p.since):
                self._unsup.setdefault(p.place, []).append(p)
        for pl in self._places_for(w):
            if lg.usage_of(pl) >= lg.pressure_threshold:
                continue
            cands = [p for p in self._unsup.get(pl, ()) if self._unsupported(p, now) and p.place == pl]
            if not cands:
                continue
            room = lg.free_on(pl) + sum(lg.holding(p.sid) for p in cands)
            need = lg.charge(pl, w.tokens, w.blocks)
            if need > lg.ceiling_of(pl):  # larger than the place: it goes alone, so only an empty place will do
                if lg.reserved_on(pl) > sum(lg.holding(p.sid) for p in cands):
                    continue
            elif room < need:
                continue
            for p in cands:
                self._pause(p, now)
                self._count("reclaimed", now)
                self._freed = True  # room made: waiters refused earlier in this pump may fit now
                last = lg.try_acquire(w.ticket, w.tokens, now, place=pl, blocks=w.blocks)
                if isinstance(last, Grant):
                    self._failed.pop(pl, None)
                    self._failed_dropped = True
                    return last, pl
            self._failed.pop(pl, None)
            self._failed_dropped = True
        return last, w.place
