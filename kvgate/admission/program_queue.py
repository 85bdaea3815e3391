"""The program policy's waiting turns: the queue, the pump, and where a waiting turn fits (pure).

Part of :class:`kvgate.admission.program.ProgramCoordinator` (a base class of it: the methods read the
coordinator's records). A turn that cannot start waits in kvgate, in one queue in arrival order; paused
programs' turns are also indexed by place to go first (the resume order, kvgate.admission.victims). Rules:
- a new program starts only when its place has room for its whole first turn, and not ahead of a paused
  program waiting on that place;
- a paused program's next turn waits in kvgate and resumes when its place has room for its whole context
  again (its KV is assumed gone, as in the paper);
- work-conserving: a waiting turn goes to any engine with room when kvgate places it (``movable``), its own
  engine first, and a later turn that fits is not held behind one that fits nowhere;
- aging: any waiting turn goes after ``max_wait_s`` (bypass-aged, still reserving), so nothing starves;
- pause only where it pays (``wait_bound`` "reprefill"): a turn waiting for room waits no longer than what
  re-prefilling the KV its admission would displace costs: its seconds at the engine's learned prefill rate, once
  for the program it belongs to and once for each call running there (a prefill batch stalls their decode), then goes
  (bypass-cost, over the ceiling, on the place where it displaces least; the place's in-tool programs pause
  to make the room). Waiting longer than that costs more than the eviction it avoids: the rent-or-buy rule
  (ski rental), which is never worse than twice the better of the two in hindsight. Where re-prefill is cheap
  (a small model, short contexts) turns barely wait and the policy behaves as lifecycle alone does; where a
  context takes as long to re-prefill as a tool call lasts, it holds turns as long as that pays;
- fail-open as the fifo policy: a missing or stale capacity signal lets every waiter bypass.
Pauses are bounded (``resume_deadline_s``): a paused program's turn that has waited that long resumes
ahead of everything, pausing in-tool programs on its place (ended ones first, then by the victim rule) to
make its room; when only running programs hold the place it waits for them (aging still bounds it).
"""

from __future__ import annotations

from heapq import merge
from itertools import chain, takewhile
from typing import Any, Iterable, Iterator

from .coordinator import Decision, Kind
from .ledger import Grant, Refusal
from .records import BOUND_REASON, WaitReason, _Waiter, decrement
from .working_set import FLEET

_NO_RECORD = float("inf")  # the record of a place no refusal reached yet: any charge lowers it

__all__: list[str] = []


class _WaitingTurns:
    """The queue half of ProgramCoordinator (see the module doc); no state of its own."""

    # True: a waiting turn's blocks are walked on every engine it is tried on, not only on those that hold its
    # prompt's start, and on those in full, not by a binary search of its held prefix (chain hashes: the plain
    # computation the shortcuts must match, in tests)
    _walk_every_place = False

    def pump(self, now: float) -> list[Decision]:
        """Decide for waiting turns at ``now``; returns decisions for those that leave. Ages first (waited >=
        max_wait_s -> BYPASS_AGED, reserving), degraded -> all BYPASS_DEGRADED, then paused programs' turns past
        the resume deadline, then every waiter in order (paused programs' turns by the resume order, then new
        programs' in arrival order): each goes where it fits (work-conserving: a waiter that fits nowhere
        does not hold back a later one that fits); last, those still waiting whose wait has cost what their
        admission would (BYPASS_COST, ``wait_bound`` "reprefill").

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
        if not self._pausing(now):  # holding cannot pay (kvgate.admission.pause_gate): all go, as lifecycle alone
            for w in list(self._queue.values()):
                g = self.ledger.try_acquire(w.ticket, w.tokens, now, place=w.place, blocks=w.blocks, force=True)
                self._count("admit_gate_closed", now)
                out.append(self._leave(w, Kind.ADMIT, g.lease, max(0.0, now - w.enqueued_at), now))
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
        while True:  # again while a reclaim made room that the turn reclaiming could not use
            self._failed, self._failed_max, self._unsup, self._freed = {}, 0, None, False
            self._failed_dropped = False
            for w in self._ordered():
                if self.max_resident is not None and not self._seat_for(w, now, overdue_only=True):
                    self._wait_reason(w, BOUND_REASON, now)
                    continue
                reclaimable = self._reclaimable(w, now)
                if self._hopeless(w):  # no room anywhere it may go, as things stand: only a reclaim can make some
                    if not reclaimable:
                        continue
                    r, where = Refusal(w.ticket, w.tokens, WaitReason.CAPACITY_EXHAUSTED), w.place
                else:
                    r, where = self._fit(w, now)
                if not isinstance(r, Grant) and reclaimable:
                    r, where = self._reclaim(w, now)
                if isinstance(r, Grant):
                    out.append(self._leave(w, Kind.ADMIT, r.lease, max(0.0, now - w.enqueued_at), now, where))
                else:
                    self._wait_reason(w, r.reason, now)
            if not self._freed:
                break
        cost = self._cost_due.heap
        if cost and cost[0][0] <= now:  # those still here found no room: their wait has cost enough
            out.extend(self._cost_paid(now))
        return out

    # ---------------------------------------------------------------- the wait's cost bound
    def _queue_len(self) -> int:
        return len(self._queue)

    def _cost_current(self, e: tuple) -> bool:
        w = self._queue.get(e[2])
        return w is not None and w.cost_due == e[0]

    def _least_displacing(self, w: _Waiter) -> tuple[Any, int]:
        """(the place ``w`` may go where admitting it now displaces the fewest tokens, that many tokens): its
        charge beyond the ledger's free room there, or beyond the engine's measured free KV if that is less."""
        lg = self.ledger
        best, least = w.place, None
        for pl in self._places_for(w):
            charge = self._charge_on(w, pl)
            free = lg.free_on(pl)
            if pl is not FLEET:
                free = min(free, int(lg.max_tokens(pl) * (1.0 - lg.usage_of(pl))))
            d = max(0, charge - max(0, free))  # over the ceiling already: it displaces its own charge
            if least is None or d < least:
                best, least = pl, d
                if d == 0:
                    break
        return best, least or 0

    def _bound_cost(self, w: _Waiter) -> None:
        """Set ``w``'s cost bound at its arrival: its wait may cost what re-prefilling the KV its admission
        displaces would (never past the aging bound). Unknown while no prefill rate has been learned."""
        if self.wait_bound != "reprefill" or w.reason not in (WaitReason.CAPACITY_EXHAUSTED,
                                                               WaitReason.PRESSURE_GUARD):
            return
        place, displaced = self._least_displacing(w)
        s = self.prefill.seconds(place, displaced)
        if s is None:
            return
        # SGLang runs a prefill batch instead of a decode step: re-prefilling the displaced KV delays every
        # call running on that engine as well as the program it belongs to
        s *= 1 + self.ledger.leases_on(place)
        if s >= self.max_wait_s:
            return
        w.cost_due = w.enqueued_at + s
        self._cost_due.push(w.cost_due, w.ticket, w.cost_due)

    def _cost_paid(self, now: float) -> list[Decision]:
        """Waiters whose wait has cost what their admission would: each goes over the ceiling where it
        displaces least (bypass-cost, reserving), and that place's in-tool programs pause to make the room."""
        out = []
        for e in list(self._cost_due.pop_due(now)):
            w = self._queue.get(e[2])
            if w is None or w.cost_due != e[0]:
                continue  # left while an earlier one went
            where, _ = self._least_displacing(w)
            g = self.ledger.try_acquire(w.ticket, w.tokens, now, place=where, blocks=w.blocks, force=True)
            out.append(self._leave(w, Kind.BYPASS_COST, g.lease, max(0.0, now - w.enqueued_at), now, where))
            self._relieve(where, now)
        return out

    def _wait_reason(self, w: _Waiter, reason: str, now: float) -> None:
        if reason == BOUND_REASON:
            self._bound_reason(w, now)
        else:
            w.reason = WaitReason.of(reason)

    def _bound_reason(self, w: _Waiter, now: float) -> None:
        w.reason = BOUND_REASON
        if not w.bound:
            w.bound = True
            self._count("wait_resident_bound", now)

    def _join(self, w: _Waiter) -> None:
        self._queue[w.ticket] = w
        self._bound_cost(w)
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
            decrement(counts, w.place)

    def _ordered(self) -> Iterator[_Waiter]:
        """Paused programs' turns (resume order), then new programs' in arrival order; safe to leave from."""
        if self._resuming_on:
            res = list(self._resume_q.values())
            res.sort(key=self._resume_key)
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

    def _no_room(self, w: _Waiter) -> bool:
        """Whether no engine a movable ``w`` may go to has room for it now, read without asking them: its whole
        turn is more than any engine's free room, and on each engine that holds its prompt's start its charge
        there is more than that engine's free room (chain hashes: elsewhere it charges the whole turn). An
        engine refuses a charge over its free room (Ledger.try_acquire: not oversized, as no charge of it is
        over an engine's ceiling), so asking them would admit it nowhere: _fit refuses it at once (the reason its
        own engine would give), instead of asking every engine again on every pump while the fleet stays full."""
        if not w.movable or w.place is FLEET or not w.blocks:
            return False
        lg = self.ledger
        rank = lg.free_rank()
        if w.tokens > rank.smallest_ceiling:
            return False  # it might go alone over an empty engine's ceiling (oversized)
        if w.whole < 0:
            bt = lg.block_tokens
            bl = w.blocks[: w.tokens // bt]
            w.whole = lg.cost_alone(bl, w.tokens - len(bl) * bt)
        order = rank.order()
        if not order or -order[0][0] >= w.whole:
            return False  # some engine has room for its whole turn
        chained, pressed = not self._walk_every_place, rank.pressed
        for pl in lg.places_holding(w.blocks[0]):
            if pl in rank and pl not in pressed and lg.charge(pl, w.tokens, w.blocks, chained) <= lg.free_on(pl):
                return False
        return True

    def _fit(self, w: _Waiter, now: float) -> tuple[Grant | Refusal, Any]:
        """try_acquire for ``w`` on its own place, then (``movable``) on the other engines, those that already
        hold the most of its prompt first, then the most free; returns (the Grant and where, or the first
        Refusal and w's place). A refusal is recorded for _hopeless.

        A pass in which every engine refused over its own room is remembered (``w.refused``): the next pass asks
        again only the engines whose holdings changed since (its own place too: unchanged, it refuses the same
        charge) (_refused_again)."""
        lg = self.ledger
        if self._no_room(w):  # refused everywhere, known without asking (not counted: nothing was asked)
            usage = lg.usage_of(w.place)
            return Refusal(w.ticket, w.tokens, WaitReason.PRESSURE_GUARD if usage >= lg.pressure_threshold
                           else WaitReason.CAPACITY_EXHAUSTED), w.place
        changed = self._since_pass(w, now) if w.refused is not None else None  # read once for both below
        r = self._own_refused_again(w, changed) if changed is not None else None
        if r is None:
            r = lg.try_acquire(w.ticket, w.tokens, now, place=w.place, blocks=w.blocks)
            if isinstance(r, Grant):
                return r, w.place
        if changed is not None and self._refused_again(w, changed, r):
            self._note_refusal(w, w.place, r)
            return r, w.place
        self._note_refusal(w, w.place, r)
        if not w.movable or w.place is FLEET:
            return r, w.place
        # the others are ranked only now: a refusal changes no holding, so the order is the one it had before
        own_room: dict[Any, int] = {}
        near = lg.places_holding(w.blocks[0]) if w.blocks else set()
        g, where, refused = lg.first_fit(w.ticket, w.tokens, now, self._others(w, near), w.blocks, own_room,
                                         None if self._walk_every_place else near)
        if refused:
            self._note_refusals(w, refused)
        w.refused = None
        if g is not None:
            return g, where
        if len(own_room) == len(refused):  # every one over its own room: only a change there can undo it
            own = lg.refusal_charge(w.place, w.tokens, w.blocks)  # its own place's too, when it is (else -1)
            w.refused = (lg.free_rank(), lg.holdings_version(), own_room, max(own_room.values(), default=0),
                         own if own == r.charge else -1)
        return r, w.place

    def _since_pass(self, w: _Waiter, now: float) -> set | None:
        """The places whose holdings changed since ``w``'s remembered pass (``w.refused``); None, the pass
        forgotten, when it no longer holds (another snapshot, degraded, or older than the changes kept)."""
        lg = self.ledger
        changed = None if w.refused[0] is not lg.free_rank() or lg.is_degraded(now) else \
            lg.changed_since(w.refused[1])
        if changed is None:
            w.refused = None
        return changed

    def _own_refused_again(self, w: _Waiter, changed: set) -> Refusal | None:
        """The refusal of ``w`` on its own place, counted, when its remembered pass (``w.refused``) says that place
        refused it over its own room alone and the place's holdings did not change since (``changed``: the
        places that did, _since_pass; it would refuse the same charge: that refusal depends on nothing else);
        else None (ask the ledger)."""
        own_charge = w.refused[4]
        if own_charge < 0 or w.place in changed:
            return None
        return self.ledger.refused_again(w.ticket, w.tokens, w.place, own_charge)

    def _refused_again(self, w: _Waiter, changed: set, own_refusal: Refusal) -> bool:
        """Whether the other engines refuse ``w`` as in its remembered pass (``w.refused``), asking only those
        whose holdings changed since (``changed``, _since_pass); if so, counts and records their refusals as
        first_fit and _note_refusals would have (the same engines, charges and counts: an engine whose holdings
        did not change has the same free room, so it is among those _others names, and refuses, as it did) and
        remembers the pass anew, with ``own_refusal`` (its own place's, in this pass).
        False (nothing counted, the pass forgotten) when a changed engine may grant or refuses otherwise: then
        _fit asks them all."""
        lg = self.ledger
        rank, _, charges, top, own_charge = w.refused
        if changed:
            lb, own, pressed = self._lower_bound(w), w.place, rank.pressed
            near = None if self._walk_every_place or not w.blocks else lg.places_holding(w.blocks[0])
            for pl in changed:
                if pl == own or pl not in rank or pl in pressed:
                    continue  # never among the others _fit asks
                if lg.free_on(pl) < lb:  # _others stops before it
                    charges.pop(pl, None)
                    continue
                c = lg.refusal_charge(pl, w.tokens, w.blocks, near is None or pl in near)
                if c < 0:
                    w.refused = None
                    return False
                charges[pl] = c
            top = max(charges.values(), default=0)
        if charges:
            lg.count_refused("capacity_exhausted", len(charges))
            if not self._failed:  # the first record of this pump (most often): the pass's records as they are
                self._failed, self._failed_max, self._failed_dropped = dict(charges), top, False
            else:
                self._note_charges(charges.items())
        if w.place in changed:  # its own place's refusal was read again: remembered if over that place's room alone
            c = lg.refusal_charge(w.place, w.tokens, w.blocks)
            own_charge = c if c == own_refusal.charge else -1
        w.refused = (rank, lg.holdings_version(), charges, top, own_charge)
        return True

    def _others(self, w: _Waiter, near: set | None = None) -> Iterator[Any]:
        """The engines other than ``w``'s own in the order _fit tries them: by (its charge there, most free
        room, the snapshot's order), only those that could take its least charge and are not under pressure.

        Read off the engines kept ordered by free room (kvgate.admission.free_rank), from the most free until
        one cannot take the least charge (neither can any after it). Its charge is the whole turn wherever its
        prompt's first block is not held (chain hashes: nothing of it is held there), so those keep the free
        order; the few engines that hold its start are costed (the walk of its blocks) and merged in. Lazily:
        first_fit stops at the first that grants (most often the first), so the rest is not read; consume it
        before the holdings change (the order is the ledger's own list, updated in place). ``near``: the places
        that hold its prompt's start (Ledger.places_holding), when the caller has them already."""
        lg = self.ledger
        rank = lg.free_rank()
        order = rank.order()  # first: it brings the engines' free room up to date
        lb, tokens, own, pressed = self._lower_bound(w), w.tokens, w.place, rank.pressed
        if near is None:  # the places that hold its prompt's start
            near = lg.places_holding(w.blocks[0]) if w.blocks else set()
        costed = []
        for pl in near:
            if pl != own and pl in rank and pl not in pressed:
                key = rank.key(pl)
                if -key[0] >= lb:
                    costed.append((lg.charge(pl, tokens, w.blocks, not self._walk_every_place), *key))
        rest = (e for e in takewhile(lambda e: -e[0] >= lb, order)
                if e[2] != own and e[2] not in pressed and e[2] not in near)
        if not costed:
            return (e[2] for e in rest)
        costed.sort()
        # the rest charge the whole turn, in their (free room, index) order: a costed engine charging less goes
        # before them all (most often every costed one), one charging the whole turn merges in by that order, one
        # charging more (a removal's blocks freed there) goes after them; heapq.merge over every engine cost
        # ~1 us a refusal
        lead = [c[-1] for c in costed if c[0] < tokens]
        if len(lead) == len(costed):
            return chain(lead, (e[2] for e in rest))
        tie = [c[1:] for c in costed if c[0] == tokens]
        return chain(lead, (e[2] for e in merge(tie, rest)), (c[-1] for c in costed if c[0] > tokens))

    def _charge_on(self, w: _Waiter, place: Any) -> int:
        """What ``w`` would add on ``place``: the walk of its prompt's blocks only where the prompt's start is
        held (elsewhere it is the whole turn, the same on every engine)."""
        lg = self.ledger
        return lg.charge(place, w.tokens, w.blocks) if lg.shares_start(place, w.blocks) else w.tokens

    def _note_refusal(self, w: _Waiter, place: Any, r: Refusal) -> None:
        self._note_refusals(w, ((place, r),))

    def _note_refusals(self, w: _Waiter, refused: Iterable[tuple[Any, Refusal]]) -> None:
        """Record each (place, Refusal) for _hopeless: the smallest charge refused on each place, and the
        largest of those records (one loop for a pass of refusals: a waiting turn is refused by dozens)."""
        charge = self.ledger.charge
        self._note_charges((place, 0 if r.reason != WaitReason.CAPACITY_EXHAUSTED else  # what it would have
                            r.charge if r.charge >= 0 else charge(place, w.tokens, w.blocks))  # added there
                           for place, r in refused)

    def _note_charges(self, charges: Iterable[tuple[Any, int]]) -> None:
        """_note_refusals of (place, the charge refused there) pairs. The largest record is read again from
        all of them once at the end, when a reclaim dropped records or the largest was lowered (not at each:
        dozens of places often share the largest charge, the whole turn)."""
        failed, top, again, wrote = self._failed, self._failed_max, self._failed_dropped, False
        get = failed.get
        # those that lower (or make) a record, picked in one comprehension: after the first waiter of a pump has
        # recorded every place, most of the next one's dozens of refusals change none
        for place, charge in [(pl, c) for pl, c in charges if c < get(pl, _NO_RECORD)]:
            old = get(place)
            if old is None:
                failed[place], wrote = charge, True
                if charge > top:
                    top = charge
            elif charge < old:
                failed[place], wrote = charge, True
                if old == top:
                    again = True
        if wrote:
            self._failed_max, self._failed_dropped = max(failed.values()) if again else top, False

    def _moved(self, w: _Waiter, where: Any, now: float) -> None:
        if where != w.place:
            self._count("moved", now)
