"""Admission coordinator: the one global FIFO around the token ledger (pure, injected ``now``).

Source: Relax's global FIFO + token ledger (decision order, queue). The async shell maps tickets to
futures; this class only decides. Flow for the shell:

    d = coord.submit(ticket, tokens, protected, now)
    if d.kind is Kind.WAIT:
        fut = futures[ticket] = loop.create_future()
        dispatch(coord.pump(now))          # retry on enqueue; may resolve fut at once
        try:
            d = await fut                  # Decision for this ticket (ADMIT or a BYPASS_*)
        except asyncio.CancelledError:     # client gone while waiting
            if coord.cancel(ticket, now()):  # removes the waiter or releases a racing grant
                dispatch(coord.pump(now()))
            raise
    try:
        forward upstream ...
    finally:
        dispatch(coord.release(ticket, now()))   # idempotent; no-op for bypasses

where dispatch(decisions) resolves futures[d.ticket] with d. A timer should call pump at
coord.next_deadline(now) (aging, staleness, lease TTL); the poller calls dispatch(coord.reconcile(snapshot, now))
after each poll round, or dispatch(coord.invalidate(now)) when it has no signal at all.
"""

from __future__ import annotations

import enum
import itertools
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Hashable

from .capacity import ClusterSnapshot
from .ledger import Grant, Lease, Ledger, check_tokens

__all__ = ["Kind", "Decision", "DecisionTally", "AdmissionCoordinator", "ADMISSION_OFF", "held_kind"]


def _url(place: Any) -> Any:
    """The engine URL of a place (URL or (URL, dp_rank)); None for the fleet."""
    return place[0] if isinstance(place, tuple) else place


def held_kind(lease: Lease) -> "Kind":
    """The decision kind a held lease was granted under (idempotent resubmits answer the same)."""
    return Kind.BYPASS_PROTECTED if lease.forced else Kind.ADMIT

#: X-Kvgate-Admission value for requests admission did not touch (feature off or out of scope).
ADMISSION_OFF = "off"


class Kind(str, enum.Enum):
    """Decision kinds; the value is the X-Kvgate-Admission header value (WAIT is never sent)."""

    ADMIT = "admit"
    WAIT = "wait"
    BYPASS_PROTECTED = "bypass-protected"
    BYPASS_DEGRADED = "bypass-degraded"
    BYPASS_AGED = "bypass-aged"
    BYPASS_COST = "bypass-cost"  # waited as long as re-prefilling what its admission displaces would take

    @property
    def is_bypass(self) -> bool:
        return self.value.startswith("bypass-")

    @property
    def bypass_reason(self) -> str | None:
        """'protected' | 'degraded' | 'aged' | 'cost' for bypasses, else None (Prometheus label)."""
        return self.value.removeprefix("bypass-") if self.is_bypass else None


@dataclass(slots=True)
class Decision:
    """The coordinator's answer for one ticket.

    kind: Kind; tokens: the reservation asked for; waited_s: seconds spent in the FIFO (0 if never queued);
    queued: whether it went through the FIFO; lease: the ledger lease for ADMIT, else None;
    reason: the ledger refusal reason that made it wait (WAIT, or a waiter's final decision), else None.
    """

    ticket: Hashable
    kind: Kind
    tokens: int
    waited_s: float = 0.0
    queued: bool = False
    lease: Lease | None = None
    reason: str | None = None

    @property
    def header(self) -> str:
        """X-Kvgate-Admission value."""
        return self.kind._value_  # the member's own attribute: Enum.value is a descriptor call per read

    @property
    def queue_ms(self) -> int:
        """X-Kvgate-Queue-Ms value (milliseconds, rounded)."""
        return int(round(self.waited_s * 1000.0))


class DecisionTally:
    """Lifetime counters of admission decisions and a rolling window over the last ``window_s`` seconds (pure,
    injected ``now``). Shared by the FIFO and the program coordinators, whose stats report the same figures.

    ``counters`` maps a name to its lifetime count; the window keeps (now, name) per counted event and
    (now, waited_s) per waiter that left the queue by admit or bypass. They are kept in flat arrays (9 and
    16 bytes an event, no Python object each): a burst of 10,000 waiters leaves no small objects scattered
    among the freed connections' memory, which would keep the allocator from giving it back. Events older
    than the window are dropped as new ones come, so the window stays bounded even when nobody reads it.
    """

    def __init__(self, names: tuple[str, ...], window_s: float) -> None:
        self.counters: dict[str, int] = {k: 0 for k in names}
        self.window_s = window_s
        self._names = tuple(self.counters)
        if len(self._names) > 255:
            raise ValueError("at most 255 counter names")
        self._code = {k: i for i, k in enumerate(self._names)}
        self._ev_t = array("d")  # event times (s), in the order counted
        self._ev_k = array("B")  # event names, as indexes into _names
        self._ev_head = 0  # events before this index are out of the window
        self._w_t = array("d")  # waiter exit times (s)
        self._w_s = array("d")  # their waits (s)
        self._w_head = 0

    def count(self, name: str, now: float, by: int = 1) -> None:
        """Add ``by`` to counter ``name`` and one event to the window."""
        self.counters[name] += by
        self._ev_t.append(now)
        self._ev_k.append(self._code[name])
        if len(self._ev_t) & 1023 == 0:  # now and then: drop what left the window (amortised O(1))
            self._trim(now - self.window_s)

    def record(self, d: Decision, now: float) -> Decision:
        """Count one decision (admit, wait or bypass by reason) and, for a waiter leaving, its wait; returns ``d``."""
        if d.kind is Kind.ADMIT:
            self.count("admit", now)
        elif d.kind is Kind.WAIT:
            self.count("wait", now)
        else:
            self.counters["bypass"] += 1
            self.count("bypass_" + (d.kind.bypass_reason or ""), now)
        if d.queued and d.kind is not Kind.WAIT:
            self._w_t.append(now)
            self._w_s.append(d.waited_s)
        return d

    def _trim(self, horizon: float) -> None:
        t, i = self._ev_t, self._ev_head
        while i < len(t) and t[i] < horizon:
            i += 1
        if i > 4096 and i * 2 > len(t):  # compact: one memmove
            del t[:i], self._ev_k[:i]
            i = 0
        self._ev_head = i
        t, i = self._w_t, self._w_head
        while i < len(t) and t[i] < horizon:
            i += 1
        if i > 4096 and i * 2 > len(t):
            del t[:i], self._w_s[:i]
            i = 0
        self._w_head = i

    def window(self, now: float) -> dict[str, Any]:
        """Window figures: counts per name, defer_rate = wait/(admit+wait+bypass) and degraded_rate =
        bypass_degraded/(admit+wait+bypass) (0 when empty), and a wait-seconds summary (count, mean, p50, max)."""
        self._trim(now - self.window_s)
        kinds = self._ev_k[self._ev_head:].tobytes()
        win = {k: kinds.count(bytes((i,))) for i, k in enumerate(self._names)}
        win["bypass"] += sum(n for k, n in win.items() if k.startswith("bypass_"))
        denom = win["admit"] + win["wait"] + win["bypass"]
        waits = sorted(self._w_s[self._w_head:])
        return {
            "window": win,
            "defer_rate": (win["wait"] / denom) if denom else 0.0,
            "degraded_rate": (win["bypass_degraded"] / denom) if denom else 0.0,
            "wait_s": {
                "count": len(waits),
                "mean": (sum(waits) / len(waits)) if waits else 0.0,
                "p50": waits[len(waits) // 2] if waits else 0.0,
                "max": waits[-1] if waits else 0.0,
            },
        }


@dataclass(slots=True)
class _Waiter:
    ticket: Hashable
    tokens: int
    enqueued_at: float
    reason: str | None
    place: Any = None
    blocks: tuple = ()
    seq: int = 0


class AdmissionCoordinator:
    """One global FIFO in front of a :class:`Ledger`.

    Args: ledger; max_wait_s (>= 0): the head bypasses (aged) once it waited that long; window_s: rolling
    window (seconds) for defer_rate / degraded_rate and the wait-time summary in stats() (default: the
    ledger's window_s); backfill: let a waiter that fits pass a head that does not (below). Raises
    ValueError for a negative max_wait_s.

    Decision order per request: protected -> BYPASS_PROTECTED; ledger degraded -> BYPASS_DEGRADED;
    an earlier waiter exists or the ledger refuses -> WAIT; otherwise ADMIT with a lease. In pump():
    degraded -> every waiter BYPASS_DEGRADED in order; head fits -> ADMIT; head waited >= max_wait_s ->
    BYPASS_AGED; else stop (strict FIFO: a later waiter never goes while an earlier one waits).
    Bypasses still reserve (a forced lease: they never wait, but the work after them sees their tokens),
    except BYPASS_DEGRADED (there is no ledger to count against); release them like admits.

    Backfill (off = today's strict FIFO): a later waiter that fits may go ahead of a head that does not,
    only while the tokens of everything granted since the head started waiting, plus the waiter, plus the
    head, stay within the head's ceiling. So whatever passes the head only uses room the head could not use
    anyway: once the leases older than the head end, the head fits (no starvation by a stream of small
    requests; aging still bounds its wait).
    """

    def __init__(self, ledger: Ledger, max_wait_s: float = 30.0, *, window_s: float | None = None,
                 backfill: bool = False) -> None:
        if isinstance(max_wait_s, bool) or not isinstance(max_wait_s, (int, float)) or not max_wait_s >= 0:
            raise ValueError(f"max_wait_s must be >= 0, got {max_wait_s!r}")
        self.ledger = ledger
        self.backfill = bool(backfill)
        self.max_wait_s = float(max_wait_s)
        self.window_s = float(window_s) if window_s is not None else ledger.window_s
        if self.window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s!r}")
        self._queue: OrderedDict[Hashable, _Waiter] = OrderedDict()
        self._from_queue: set[Hashable] = set()  # tickets granted by pump, lease still held
        self._seq = itertools.count(1)  # orders enqueues and grants (equal clock readings happen)
        self._granted_seq: dict[Hashable, int] = {}  # ticket -> seq of its grant, while its lease lives
        self.tally = DecisionTally(("admit", "wait", "bypass", "bypass_protected", "bypass_degraded", "bypass_aged",
                                    "cancelled", "backfilled"), self.window_s)
        self.counters = self.tally.counters  # the same dict: lifetime counters, read by the gate and /kvgate/stats

    # ---------------------------------------------------------------- bookkeeping
    def _count(self, name: str, now: float) -> None:
        self.tally.count(name, now)

    def _record(self, d: Decision, now: float) -> Decision:
        if d.lease is not None:
            self._granted_seq[d.ticket] = next(self._seq)
        return self.tally.record(d, now)

    def submit(self, ticket: Hashable, tokens: int, protected: bool, now: float, *, place: Any = None,
               blocks: tuple = (), session_id: Hashable | None = None, prompt_tokens: int | None = None,
               movable: bool = False) -> Decision:
        """Decide for a new in-scope request of ``tokens`` reservation at ``now``.

        ``place``: the engine (URL or (URL, dp_rank)) it will go to, None = unknown (fleet-wide rule);
        ``blocks``: its prompt's prefix block hashes (see Ledger.try_acquire). ``session_id``,
        ``prompt_tokens`` and ``movable`` are read by the program policy only (same call for both policies).
        Returns ADMIT (lease held: release it when the upstream attempt ends), WAIT (enqueued at the FIFO
        tail: a later pump() returns this ticket's final Decision), BYPASS_PROTECTED (forward at once; holds
        a forced lease unless degraded: release it too) or BYPASS_DEGRADED (forward at once, nothing held).
        After a WAIT, register the waiter and call pump(now) (retry on enqueue). Idempotent: a ticket already
        waiting gets WAIT again, one already holding a lease gets ADMIT with that lease; neither is counted
        twice. Raises ValueError for negative or non-int tokens.
        """
        if type(tokens) is not int or tokens < 0:  # one check for the usual int; then the precise rule
            check_tokens(tokens)
        if ticket in self._queue:
            w = self._queue[ticket]
            return Decision(ticket, Kind.WAIT, w.tokens, now - w.enqueued_at, True, None, w.reason)
        held = self.ledger.lease(ticket)
        if held is not None:
            return Decision(ticket, held_kind(held), held.tokens, 0.0, False, held)
        self._expire(now)
        if protected:
            lease = None
            if not self.ledger.is_degraded(now):
                lease = self.ledger.try_acquire(ticket, tokens, now, place=place, blocks=blocks, force=True).lease
            return self._record(Decision(ticket, Kind.BYPASS_PROTECTED, tokens, lease=lease), now)
        if self.ledger.is_degraded(now):
            return self._record(Decision(ticket, Kind.BYPASS_DEGRADED, tokens), now)
        if self._queue:
            reason = "fifo"
            if self.backfill:
                head = next(iter(self._queue.values()))
                r = self._backfill(head, ticket, tokens, place, blocks, now)
                if isinstance(r, Grant):
                    self._count("backfilled", now)
                    return self._record(Decision(ticket, Kind.ADMIT, tokens, 0.0, False, r.lease), now)
        else:
            r = self.ledger.try_acquire(ticket, tokens, now, place=place, blocks=blocks)
            if isinstance(r, Grant):
                return self._record(Decision(ticket, Kind.ADMIT, tokens, 0.0, False, r.lease), now)
            reason = r.reason
        self._queue[ticket] = _Waiter(ticket, tokens, float(now), reason, place, tuple(blocks), next(self._seq))
        return self._record(Decision(ticket, Kind.WAIT, tokens, 0.0, True, None, reason), now)

    def _backfill(self, head: _Waiter, ticket: Hashable, tokens: int, place: Any, blocks: tuple,
                  now: float) -> Grant | None:
        """Grant ``ticket`` ahead of ``head`` if it fits and leaves the head its room (see the class doc)."""
        led = self.ledger
        hp = led.resolve_place(head.place)
        wp = led.resolve_place(place)
        if hp is not None and wp is not None and _url(hp) != _url(wp):
            passed_ok = True  # different engines: it takes none of the head's engine room
        else:
            ceiling = led.ceiling_of(hp)
            passed = sum(lease.charged for lease in led.leases()
                          if self._granted_seq.get(lease.ticket, 0) > head.seq
                          and (hp is None or _url(lease.place) == _url(hp)))
            passed_ok = passed + tokens + min(head.tokens, led.max_tokens(hp)) <= ceiling
        if not passed_ok:
            return None
        r = led.try_acquire(ticket, tokens, now, place=place, blocks=blocks)
        return r if isinstance(r, Grant) else None

    def _expire(self, now: float) -> None:
        for t in self.ledger.expire(now):
            self._granted_seq.pop(t, None)
            self._from_queue.discard(t)

    def pump(self, now: float) -> list[Decision]:
        """Retry the FIFO head(s) at ``now``; returns decisions for waiters that leave, in FIFO order.

        First reclaims expired leases. Degraded ledger -> every waiter BYPASS_DEGRADED. Otherwise, per head:
        ledger grants -> ADMIT; else waited >= max_wait_s -> BYPASS_AGED (with a forced lease); else stop,
        and with backfill on, grant the later waiters that may pass the head. Call it after an
        enqueue, a release, a cancel, a reconcile and at next_deadline(). The shell must deliver every
        returned decision to its ticket's waiter (or cancel() the ticket if the waiter is gone).
        """
        self._expire(now)
        out: list[Decision] = []
        degraded = self.ledger.is_degraded(now)
        while self._queue:
            ticket, w = next(iter(self._queue.items()))
            waited = max(0.0, now - w.enqueued_at)
            if degraded:
                d = Decision(ticket, Kind.BYPASS_DEGRADED, w.tokens, waited, True, None, w.reason)
            else:
                r = self.ledger.try_acquire(ticket, w.tokens, now, place=w.place, blocks=w.blocks)
                if isinstance(r, Grant):
                    self._from_queue.add(ticket)
                    d = Decision(ticket, Kind.ADMIT, w.tokens, waited, True, r.lease, w.reason)
                elif waited >= self.max_wait_s:
                    g = self.ledger.try_acquire(ticket, w.tokens, now, place=w.place, blocks=w.blocks, force=True)
                    self._from_queue.add(ticket)
                    d = Decision(ticket, Kind.BYPASS_AGED, w.tokens, waited, True, g.lease, r.reason)
                else:
                    w.reason = r.reason
                    if self.backfill:
                        out.extend(self._pump_backfill(w, now))
                    break
            del self._queue[ticket]
            out.append(self._record(d, now))
        return out

    def _pump_backfill(self, head: _Waiter, now: float) -> list[Decision]:
        out = []
        for ticket, w in list(self._queue.items())[1:]:
            r = self._backfill(head, ticket, w.tokens, w.place, w.blocks, now)
            if r is None:
                continue
            del self._queue[ticket]
            self._from_queue.add(ticket)
            self._count("backfilled", now)
            out.append(self._record(Decision(ticket, Kind.ADMIT, w.tokens, max(0.0, now - w.enqueued_at), True,
                                             r.lease, w.reason), now))
        return out

    def release(self, ticket: Hashable, now: float, observed: Any = None) -> list[Decision]:
        """The upstream attempt for ``ticket`` ended (relayed, error or client gone): free its lease.

        Idempotent (no lease -> nothing freed). A ticket still waiting is cancelled instead. Returns
        pump(now) so freed room goes to the FIFO head at once ([] when nobody waits).
        """
        if ticket in self._queue:
            self.cancel(ticket, now)
        else:
            self._from_queue.discard(ticket)
            self._granted_seq.pop(ticket, None)
            self.ledger.release(ticket, now)
        # Nobody waits: nothing to grant (a stranded lease is reclaimed by the next submit or the timer's pump).
        return self.pump(now) if self._queue else []

    def cancel(self, ticket: Hashable, now: float) -> bool:
        """The waiter for ``ticket`` is gone before it used its decision (client disconnected while waiting).

        Atomically removes it from the FIFO; if pump already granted it a lease that the shell had not
        consumed yet, that lease is released. Returns True if a waiter or a racing grant was removed (counted
        as cancelled), False otherwise (idempotent). Call pump(now) afterwards: the head may have changed.
        Do not call it for a request that was already forwarded: use release().
        """
        if self._queue.pop(ticket, None) is not None:
            self._count("cancelled", now)
            return True
        if ticket in self._from_queue:
            self._from_queue.discard(ticket)
            self._granted_seq.pop(ticket, None)
            self.ledger.release(ticket, now)
            self._count("cancelled", now)
            return True
        return False

    def take_actions(self) -> list:
        """The fifo policy never pauses anything: always []."""
        return []

    def forget(self, session_id: Hashable, now: float) -> None:
        """Sessions are not tracked by the fifo policy: nothing to do."""

    def consumed(self, ticket: Hashable) -> None:
        """Optional: the shell started forwarding ``ticket``'s granted request; a later cancel() no longer counts it."""
        self._from_queue.discard(ticket)

    def reconcile(self, snapshot: ClusterSnapshot, now: float) -> list[Decision]:
        """Install a capacity snapshot in the ledger (see Ledger.reconcile) and return pump(now)."""
        self.ledger.reconcile(snapshot, now)
        return self.pump(now)

    def invalidate(self, now: float) -> list[Decision]:
        """The capacity signal is gone (no router address, router unreachable, every scrape failed): drop the
        snapshot so the ledger is degraded at once, and return pump(now) (every waiter BYPASS_DEGRADED)."""
        self.ledger.invalidate()
        return self.pump(now)

    # ---------------------------------------------------------------- figures
    @property
    def waiting(self) -> int:
        """Number of requests in the FIFO (the waiting gauge)."""
        return len(self._queue)

    def waiting_tickets(self) -> list[Hashable]:
        """Tickets in FIFO order (head first)."""
        return list(self._queue)

    def is_waiting(self, ticket: Hashable) -> bool:
        return ticket in self._queue

    def next_deadline(self, now: float) -> float | None:
        """Earliest monotonic time (s) at which pump() could decide without another event: the head's aging
        time, the snapshot's staleness time (only while someone waits), or the earliest lease expiry.
        None if nothing is pending. The shell's timer sleeps until then (clamped to >= now)."""
        cands: list[float] = []
        if self._queue:
            head = next(iter(self._queue.values()))
            cands.append(head.enqueued_at + self.max_wait_s)
            stale = self.ledger.degraded_at()
            if stale is not None:
                cands.append(stale)
        exp = self.ledger.next_expiry()
        if exp is not None:
            cands.append(exp)
        return max(now, min(cands)) if cands else None

    def stats(self, now: float) -> dict[str, Any]:
        """JSON-able figures: lifetime counters, waiting, window counts, defer_rate and degraded_rate over the
        last window_s (wait/(admit+wait+bypass) and bypass_degraded/(admit+wait+bypass), 0 when empty),
        wait-seconds summary of waiters that left in the window, and all ledger figures under "ledger"."""
        return {
            "counters": dict(self.counters),
            "waiting": self.waiting,
            "window_s": self.window_s,
            **self.tally.window(now),
            "max_wait_s": self.max_wait_s,
            "ledger": self.ledger.stats(now),
        }
