"""Token ledger: bounds the KV tokens committed to the fleet (pure: no asyncio, no I/O, injected ``now``).

Source: Relax's global FIFO + token ledger:
- ceiling = sum over healthy engines of max_total_num_tokens x headroom;
- refusals: pressure_guard (the worst engine pool's token_usage >= pressure_threshold) is checked before
  capacity_exhausted (reserved + tokens > ceiling);
- a request larger than the whole ceiling is admitted when nothing else is reserved;
- a reservation never counts more than the largest engine's max_total_num_tokens (no engine could ever hold
  more: a request with a huge ``n`` must not block the fleet);
- a prompt prefix held by several live leases on one place is counted once (working_set.Holdings);
- per-engine ceilings: a lease placed on a known engine (or one data-parallel rank of it) must also fit
  that engine's own max_total_num_tokens x headroom, and the pressure guard reads that engine's usage; a
  lease whose engine is unknown falls back to the fleet-wide rule;
- forced leases (bypasses: protected, aged) are always granted and still count, so later work waits;
- leases are idempotent per ticket; TTL reclaim of stranded leases; usage windows; an epoch that increments
  when the set of healthy engines changes; a missing or stale snapshot makes the ledger degraded.
All times are monotonic seconds supplied by the caller.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any, Hashable, Iterable, Literal

from .capacity import MAX_PLAUSIBLE_TOKENS, ClusterSnapshot
from .free_rank import FreeRank
from .ledger_figures import _LedgerFigures
from .working_set import DEFAULT_BLOCK_TOKENS, FLEET, Holdings

#: Places remembered per snapshot (engines and their DP ranks; a bound for callers that pass odd ones).
MAX_REMEMBERED_PLACES = 4096

__all__ = ["Grant", "Refusal", "Lease", "Ledger", "REFUSAL_REASONS", "check_tokens"]

RefusalReason = Literal["pressure_guard", "capacity_exhausted", "degraded"]
#: Reasons a ledger refuses. "degraded" is only returned if a caller acquires while degraded (the
#: coordinator bypasses before that).
REFUSAL_REASONS: tuple[str, ...] = ("pressure_guard", "capacity_exhausted", "degraded")


# The values made on every request (Lease, Grant, Refusal here; Decision, Reservation) are slotted, not frozen:
# a frozen dataclass's __init__ sets each field through object.__setattr__ (a Lease: 1.9 us, slotted 0.3 us).
# Nothing changes them once made.
@dataclass(slots=True)
class Lease:
    """A held reservation: ``tokens`` for ``ticket`` granted at ``granted_at``, reclaimed at ``expires_at`` (s).

    place: the engine URL, (engine URL, dp_rank), or None for the fleet; charged: tokens it added to the
    ledger when granted (less than ``tokens`` when its prefix blocks were already held); forced: a bypass."""

    ticket: Hashable
    tokens: int
    granted_at: float
    expires_at: float
    epoch: int
    oversized: bool = False
    place: Any = None
    charged: int = 0
    forced: bool = False
    blocks: tuple = ()


@dataclass(slots=True)
class Grant:
    """try_acquire succeeded: ``lease`` is held. ``new`` is False when the ticket already held it (retry)."""

    lease: Lease
    new: bool = True

    @property
    def ticket(self) -> Hashable:
        return self.lease.ticket

    @property
    def tokens(self) -> int:
        return self.lease.tokens

    def __bool__(self) -> bool:
        return True


@dataclass(slots=True)
class Refusal:
    """try_acquire refused ``tokens`` for ``ticket``; ``reason`` in REFUSAL_REASONS; ``charge``: for
    "capacity_exhausted", the tokens it would have added on the place (``charge()``), else -1."""

    ticket: Hashable
    tokens: int
    reason: RefusalReason
    charge: int = field(default=-1, compare=False)

    def __bool__(self) -> bool:
        return False


def check_tokens(tokens: Any) -> None:
    """Raise ValueError unless ``tokens`` is an int >= 0 (not a bool): a reservation's size."""
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
        raise ValueError(f"tokens must be an int >= 0, got {tokens!r}")


def _check_fraction(name: str, v: float) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0.0 < v <= 1.0):
        raise ValueError(f"{name} must be in (0, 1], got {v!r}")
    return float(v)


def _check_positive(name: str, v: float) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise ValueError(f"{name} must be > 0, got {v!r}")
    return float(v)


class Ledger(_LedgerFigures):
    """The token ledger.

    Args (all validated, ValueError otherwise):
      headroom: fraction (0, 1] of fleet max_total_num_tokens admission may reserve (default 0.90).
      pressure_threshold: fraction (0, 1]; refuse while any pool's token_usage >= it (default 0.92).
      stale_after_s: a snapshot this old (seconds, age >= bound) is stale -> degraded; use
        capacity.stale_after_s(poll_interval_s) = max(3 x interval, 5 s) (default 6.0 for a 2 s poll).
      lease_ttl_s: a lease not released within this many seconds is reclaimed by expire() (default 900).
      window_s: length of the usage window for usage_window() (default 60).
      count_host: the ceilings also count the room each engine's HiCache host pool adds (the program policy:
        a program between turns may sit in host memory, which SGLang loads back instead of recomputing). A single
        reservation is still clamped to the device pool (max_tokens) and the pressure guard reads device usage.

    Read-only figures: snapshot; is_degraded(now); and in kvgate.admission.ledger_figures: ceiling, reserved,
    available_tokens, reserved_utilization, lease_count, lease_expired_total, epoch, charge, shares_start,
    refusal_charge, usage_window(now), stats(now).
    """

    def __init__(
        self,
        headroom: float = 0.90,
        pressure_threshold: float = 0.92,
        stale_after_s: float = 6.0,
        lease_ttl_s: float = 900.0,
        window_s: float = 60.0,
        block_tokens: int = DEFAULT_BLOCK_TOKENS,
        count_host: bool = False,
    ) -> None:
        self.count_host = bool(count_host)
        self.headroom = _check_fraction("headroom", headroom)
        self.pressure_threshold = _check_fraction("pressure_threshold", pressure_threshold)
        self.stale_after_s = _check_positive("stale_after_s", stale_after_s)
        self.lease_ttl_s = _check_positive("lease_ttl_s", lease_ttl_s)
        self.window_s = _check_positive("window_s", window_s)
        self._snapshot: ClusterSnapshot | None = None
        self._forget_places()
        self._fleet_max = 1
        self._healthy: frozenset[str] | None = None
        self._ceiling = 0
        self._epoch = 0
        self._leases: dict[Hashable, Lease] = {}
        self._lease_n: dict[Any, int] = {}  # place -> leases granted there
        # A lower bound on every lease's expires_at: expire() scans the leases only once it is reached, so
        # admitting a request does not walk every lease in flight.
        self._expiry_floor = math.inf
        self._hold = Holdings(block_tokens)
        self._lease_expired_total = 0
        self._granted_total = 0
        self._oversized_total = 0
        self._forced_total = 0
        self._refused_total = {r: 0 for r in REFUSAL_REASONS}
        self._usage: deque[tuple[float, float, float]] = deque()  # (t, mean_usage, worst_usage)

    # ---------------------------------------------------------------- capacity
    def reconcile(self, snapshot: ClusterSnapshot, now: float) -> bool:
        """Install a new capacity snapshot; returns True if the epoch changed.

        Sets ceiling = floor(sum of healthy engines' max_total_num_tokens (plus their HiCache host room when
        ``count_host``) x headroom) (tokens), increments
        the epoch when the healthy engine set differs from the previous snapshot's, and records
        (mean_usage, worst_usage) into the usage window at ``snapshot.taken_at``. A snapshot older than the
        installed one is ignored (returns False). Leases are kept across epochs.
        """
        if self._snapshot is not None and snapshot.taken_at < self._snapshot.taken_at:
            return False
        self._snapshot = snapshot
        self._forget_places()
        room = snapshot.capacity + snapshot.host if self.count_host else snapshot.capacity
        self._ceiling = int(math.floor(room * self.headroom))
        # the largest engine's capacity, read by every fleet-wide reservation (max_tokens): once per snapshot
        self._fleet_max = max((e.capacity for e in snapshot.engines.values()), default=0) or 1
        changed = snapshot.healthy != self._healthy
        if changed:
            self._epoch += 1
            self._healthy = snapshot.healthy
        if snapshot.engines:
            self._usage.append((snapshot.taken_at, snapshot.mean_usage, snapshot.worst_usage))
        self._prune(now)
        return changed

    def invalidate(self) -> None:
        """Drop the snapshot (e.g. router unreachable): the ledger is degraded until the next reconcile."""
        self._snapshot = None
        self._ceiling = 0
        self._forget_places()

    def _forget_places(self) -> None:
        # places resolved and ceilings computed against the snapshot just replaced
        self._resolved: dict[Any, Any] = {}
        # (max_tokens, usage_of, ceiling_of) per resolved place: bounded by the places resolve_place keeps
        self._figures: dict[Any, tuple[int, float, int]] = {}
        self._fleet_pools: int | None = None  # pools_of(FLEET), counted once per snapshot
        self._engine_places: list[Any] | None = None  # engine_places(), listed once per snapshot
        self._rank: FreeRank | None = None  # free_rank(), sorted once per snapshot

    def transfer_refilled(self, place: Any) -> bool:
        """Whether ``place`` is on a PD fleet's decode worker (ClusterSnapshot.decode_workers): a prefix missing
        from its radix cache comes back by a KV transfer while the prefill worker prefills the prompt anyway."""
        snap = self._snapshot
        return snap is not None and place is not FLEET and bool(snap.decode_workers) and \
            (place[0] if isinstance(place, tuple) else place) in snap.decode_workers

    @property
    def snapshot(self) -> ClusterSnapshot | None:
        return self._snapshot

    def is_degraded(self, now: float) -> bool:
        """True if there is no snapshot, it has no healthy engine, or its age >= stale_after_s."""
        s = self._snapshot
        return s is None or not s.engines or self._ceiling <= 0 or (now - s.taken_at) >= self.stale_after_s

    def degraded_at(self) -> float | None:
        """Monotonic time at which the current snapshot turns stale (None if already without a snapshot)."""
        s = self._snapshot
        return None if s is None else s.taken_at + self.stale_after_s

    # ---------------------------------------------------------------- leases
    def try_acquire(self, ticket: Hashable, tokens: int, now: float, *, place: Any = FLEET,
                    blocks: tuple = (), force: bool = False) -> Grant | Refusal:
        """Reserve ``tokens`` (int >= 0) for ``ticket`` at ``now``; returns Grant or Refusal.

        ``place``: engine URL or (URL, dp_rank) the request goes to, None (or an engine not in the snapshot)
        = unknown: the fleet-wide rule. ``blocks``: the prompt's prefix block hashes (reservation.Reservation):
        blocks already held on the place are not charged again. ``tokens`` is clamped to the place's engine
        capacity (the largest engine's when unknown). ``force``: a bypass; granted whatever the figures say
        (still refused when degraded: there is nothing to count against).
        Idempotent: a ticket that already holds a lease gets its existing lease back (Grant.new False) and is
        never charged twice, whatever ``tokens`` says. Order of checks: degraded -> Refusal("degraded");
        pool usage >= pressure_threshold -> Refusal("pressure_guard"); reserved + charge > ceiling (the
        fleet's, and the engine's own when known) -> Refusal("capacity_exhausted") unless the charge is larger
        than that ceiling and nothing is reserved there (oversized request admitted alone). Raises ValueError
        for negative or non-int tokens.
        """
        if type(tokens) is not int or tokens < 0:  # one check for the usual int; then the precise rule
            check_tokens(tokens)
        held = self._leases.get(ticket)
        if held is not None:
            return Grant(held, new=False)
        if self.is_degraded(now):
            return self._refuse(ticket, tokens, "degraded")
        place = self.resolve_place(place)
        clamp, usage, place_ceiling = self._figures_of(place)
        hold = self._hold
        bt = hold.block_tokens
        tokens = min(tokens, clamp)
        blocks = tuple(blocks)[: tokens // bt] if blocks else ()
        tail = tokens - len(blocks) * bt
        cost = hold.cost(place, blocks, tail)
        oversized = False
        if not force:
            verdict = self._verdict(place, cost, usage, place_ceiling, hold.grand_total())
            if verdict is not None:
                if verdict != "oversized":
                    return self._refuse(ticket, tokens, verdict, cost)
                oversized = True
        return self._grant(ticket, tokens, now, place, blocks, tail, cost, oversized, force)

    def _grant(self, ticket: Hashable, tokens: int, now: float, place: Any, blocks: tuple, tail: int, cost: int,
               oversized: bool, force: bool) -> Grant:
        """try_acquire's grant, its figures read: hold (blocks, tail) on resolved ``place``, which adds ``cost``."""
        self._hold.add(ticket, place, blocks, tail)
        expires = now + self.lease_ttl_s
        lease = Lease(ticket, tokens, float(now), float(expires), self._epoch, oversized, place, cost, force, blocks)
        if expires < self._expiry_floor:
            self._expiry_floor = expires
        self._leases[ticket] = lease
        self._lease_n[place] = self._lease_n.get(place, 0) + 1
        self._granted_total += 1
        self._oversized_total += oversized  # a bool counts 1 or 0
        self._forced_total += bool(force)
        return Grant(lease, True)

    def first_fit(self, ticket: Hashable, tokens: int, now: float, places: Iterable[Any], blocks: tuple = (),
                  own_room: dict | None = None, start_held: set | None = None
                  ) -> tuple[Grant | None, Any, list[tuple[Any, Refusal]]]:
        """try_acquire (not forced) on each of ``places`` in order until one grants: the same checks, counts
        and outcome as calling it place by place, at a fraction of the cost of each refusal. Returns (the
        Grant or None, the place that granted or None, [(place, Refusal)] for each place that refused first).
        ``own_room``: filled with {place: charge} for each refusal over the place's own room alone (see
        refusal_charge: a refusal nothing but a change on that place can undo). ``start_held``: the places
        that hold ``blocks[0]`` (places_holding); elsewhere the charge is the whole turn, read without a walk
        of its blocks (chain hashes, as kvgate's are: a place that holds none of a prompt's start holds none of it).

        A turn that fits nowhere is refused by every engine it may go to, on every pump while it waits (63 on
        a fleet of 64); the refusals change nothing, so the figures every place shares are read once."""
        refused: list[tuple[Any, Refusal]] = []
        if type(tokens) is not int or tokens < 0 or ticket in self._leases or self.is_degraded(now):
            for pl in places:  # the rare cases, each exactly as try_acquire treats it
                r = self.try_acquire(ticket, tokens, now, place=pl, blocks=blocks)
                if isinstance(r, Grant):
                    return r, pl, refused
                refused.append((pl, r))
            return None, None, refused
        hold, resolved, th, counts = self._hold, self._resolved, self.pressure_threshold, self._refused_total
        bt, reserved = hold.block_tokens, hold.grand_total()
        blocks = tuple(blocks) if blocks else ()
        last = None  # (clamp, tokens, blocks, tail, charge where none held) of the previous place: shared by a size
        for pl in places:
            try:
                place = resolved[pl]
            except (KeyError, TypeError):  # not resolved yet, or not hashable: as try_acquire resolves it
                place = self.resolve_place(pl)
            clamp, usage, place_ceiling = self._figures_of(place)
            if last is None or last[0] != clamp:
                t = min(tokens, clamp)
                bl = blocks[: t // bt]
                tail = t - len(bl) * bt
                last = (clamp, t, bl, tail, None if start_held is None else hold.cost_alone(bl, tail))
            _, t, bl, tail, alone = last
            cost = alone if start_held is not None and place not in start_held else hold.cost(place, bl, tail)
            if usage < th and cost <= place_ceiling < hold.total(place) + cost:
                # over the place's own room and no larger than the place (never admitted alone): _verdict's
                # capacity_exhausted, read inline (most places a waiting turn is tried on end here)
                counts["capacity_exhausted"] += 1
                refused.append((pl, Refusal(ticket, t, "capacity_exhausted", cost)))
                if own_room is not None:
                    own_room[pl] = cost
                continue
            verdict = self._verdict(place, cost, usage, place_ceiling, reserved)
            if verdict is None or verdict == "oversized":  # try_acquire's grant, without reading it all again
                return self._grant(ticket, t, now, place, bl, tail, cost, verdict is not None, False), pl, refused
            refused.append((pl, self._refuse(ticket, t, verdict, cost)))
        return None, None, refused

    def _verdict(self, place: Any, cost: int, usage: float, place_ceiling: int, reserved: int) -> str | None:
        """The rule of a reservation that is not forced, adding ``cost`` tokens on resolved ``place`` (its
        ``usage`` and ``place_ceiling``) with ``reserved`` held fleet-wide: None (it fits), "oversized" (it does
        not, but it is larger than the place and goes alone) or the RefusalReason."""
        if usage >= self.pressure_threshold:
            return "pressure_guard"
        fits = reserved + cost <= self._ceiling
        if place is not FLEET:
            fits = fits and self._hold.total(place) + cost <= place_ceiling
        if fits:
            return None
        alone = reserved == 0 if place is FLEET else self._hold.total(place) == 0 and \
            (reserved == 0 or reserved + cost <= self._ceiling)
        return "oversized" if cost > place_ceiling and alone else "capacity_exhausted"

    def _figures_of(self, place: Any) -> tuple[int, float, int]:
        """(max_tokens, usage_of, ceiling_of) of a resolved place, remembered until the snapshot changes:
        every admission reads all three."""
        try:
            return self._figures[place]
        except KeyError:
            if place is FLEET:
                ceiling = self._ceiling
            else:
                ceiling = int(math.floor((self._figure(place, "capacity") + self._host_of(place)) * self.headroom))
            return self._figures.setdefault(place, (self.max_tokens(place), self.usage_of(place), ceiling))

    # ---------------------------------------------------------------- places
    def resolve_place(self, place: Any) -> Any:
        """The place a lease is counted on: ``place`` if its engine is in the snapshot, else FLEET (None).

        (url, rank) keeps the rank only when the engine has that many pools. Remembered until the snapshot
        changes (a request asks several times)."""
        try:
            return self._resolved[place]
        except KeyError:
            pass
        except TypeError:  # not hashable: resolved each time
            return self._resolve(place)
        r = self._resolve(place)
        if len(self._resolved) < MAX_REMEMBERED_PLACES:
            self._resolved[place] = r
        return r

    def _resolve(self, place: Any) -> Any:
        s = self._snapshot
        if place is None or s is None:
            return FLEET
        url, rank = (place if isinstance(place, tuple) else (place, None))
        eng = s.engines.get(url)
        if eng is None:
            return FLEET
        if isinstance(rank, int) and not isinstance(rank, bool) and 0 <= rank < len(eng.pools) and len(eng.pools) > 1:
            return (url, rank)
        return url

    def _figure(self, place: Any, name: str) -> int:
        """``name`` ("capacity" or "host", tokens) of ``place``: the fleet's, an engine's or one DP pool's; 0
        without a snapshot or for an engine not in it."""
        s = self._snapshot
        if s is None:
            return 0
        if place is FLEET:
            return getattr(s, name)
        url, rank = (place if isinstance(place, tuple) else (place, None))
        eng = s.engines.get(url)
        if eng is None:
            return 0
        return getattr(eng.pools[rank] if rank is not None else eng, name)

    def _host_of(self, place: Any) -> int:
        """The HiCache host room the ceiling of ``place`` counts (tokens; 0 unless ``count_host``)."""
        return self._figure(place, "host") if self.count_host else 0

    def ceiling_of(self, place: Any) -> int:
        """floor(max_total_num_tokens (+ the HiCache host room when ``count_host``) x headroom) of ``place``
        (the fleet's ceiling for FLEET / unknown)."""
        place = self.resolve_place(place)
        return self._ceiling if place is FLEET else self._figures_of(place)[2]

    def pools_of(self, place: Any) -> int:
        """KV pools at ``place``: 1 for one data-parallel rank, an engine's pool count (its DP ranks), every
        healthy engine's pools together for FLEET / unknown; 0 without a snapshot."""
        s = self._snapshot
        if s is None:
            return 0
        place = self.resolve_place(place)
        if place is FLEET:
            if self._fleet_pools is None:
                self._fleet_pools = sum(len(e.pools) for e in s.engines.values())
            return self._fleet_pools
        return 1 if isinstance(place, tuple) else len(s.engines[place].pools)

    def max_tokens(self, place: Any) -> int:
        """The most one reservation can count on ``place``: that engine's (or pool's) max_total_num_tokens;
        the largest engine's for FLEET. At least 1."""
        place = self.resolve_place(place)
        s = self._snapshot
        if s is None or not s.engines:
            return MAX_PLAUSIBLE_TOKENS  # no figures: nothing to clamp to (and nothing is checked)
        if place is FLEET:
            return self._fleet_max
        return max(1, self._figure(place, "capacity"))

    def usage_of(self, place: Any) -> float:
        """The pressure guard's input: the worst pool usage of the place's engine (the fleet's for FLEET)."""
        s = self._snapshot
        if s is None:
            return 0.0
        place = self.resolve_place(place)
        if place is FLEET:
            return s.worst_usage
        url, rank = (place if isinstance(place, tuple) else (place, None))
        eng = s.engines[url]
        return eng.pools[rank].usage if rank is not None else eng.worst_usage

    @property
    def block_tokens(self) -> int:
        """Tokens per prefix block (shared blocks are counted once per place)."""
        return self._hold.block_tokens

    def engine_places(self) -> list[Any]:
        """Every KV pool of the snapshot as a place: an engine's URL, or (URL, dp_rank) for each rank of an
        engine with several; in the snapshot's order. Empty without a snapshot. Remembered per snapshot."""
        if self._engine_places is None:
            s = self._snapshot
            out: list[Any] = []
            if s is not None:
                for url, eng in s.engines.items():
                    out.extend([(url, r) for r in range(len(eng.pools))] if len(eng.pools) > 1 else [url])
            self._engine_places = out
        return self._engine_places

    def free_rank(self) -> FreeRank:
        """The engine places by free room (``order()``: (-free tokens, index in engine_places(), place), most
        free first) and those under pressure (``pressed``): sorted once per snapshot, then kept up to date."""
        if self._rank is None:
            th = self.pressure_threshold
            self._rank = FreeRank(self._hold, [(pl, self.ceiling_of(pl), self.usage_of(pl) >= th)
                                               for pl in self.engine_places()])
        return self._rank

    def places_holding(self, block: int) -> set[Any]:
        """The places where some lease or resident KV holds prefix ``block``, a prompt's first block (chain
        hashes: where that prompt's start is held), read off an index of first blocks."""
        return self._hold.places_starting_with(block)

    def free_on(self, place: Any) -> int:
        """Tokens ``place`` could still take under its own ceiling (may be negative when over it)."""
        place = self.resolve_place(place)
        return self.ceiling_of(place) - self._hold.total(place)

    def reserved_on(self, place: Any) -> int:
        """Tokens reserved on ``place`` by leases counted there."""
        return self._hold.total(self.resolve_place(place))

    def count_refused(self, reason: RefusalReason, n: int) -> None:
        """Count ``n`` refusals for ``reason`` known without asking place by place (refusal_charge)."""
        self._refused_total[reason] += n

    def refused_again(self, ticket: Hashable, tokens: int, place: Any, charge: int) -> Refusal:
        """try_acquire's refusal of ``tokens`` for ``ticket`` on engine ``place``, known without reading it again:
        the place refused ``charge`` over its own room alone (refusal_charge) and neither its holdings nor the
        snapshot changed since (the caller knows). Counted as try_acquire counts it."""
        return self._refuse(ticket, min(tokens, self._figures_of(self.resolve_place(place))[0]), "capacity_exhausted",
                            charge)

    def _refuse(self, ticket: Hashable, tokens: int, reason: RefusalReason, cost: int = -1) -> Refusal:
        self._refused_total[reason] += 1
        return Refusal(ticket, tokens, reason, cost if reason == "capacity_exhausted" else -1)

    # ---------------------------------------------------------------- resident KV (program policy)
    def hold(self, key: Hashable, place: Any, blocks: tuple, tokens: int) -> int:
        """Count ``tokens`` of resident KV (a program between turns) under ``key`` on ``place``; no check,
        no lease, no TTL. Replaces what ``key`` held. Returns the tokens added (shared blocks counted once)."""
        place = self.resolve_place(place)
        bt = self._hold.block_tokens
        tokens = max(0, min(int(tokens), self.max_tokens(place)))
        blocks = tuple(blocks)[: tokens // bt]
        return self._hold.add(("resident", key), place, blocks, tokens - len(blocks) * bt)

    def unhold(self, key: Hashable) -> int:
        """Stop counting ``key``'s resident KV; returns the tokens freed (0 if none: idempotent)."""
        return self._hold.remove(("resident", key))

    def holding(self, key: Hashable) -> int:
        """``key``'s resident tokens as if alone (0 if none)."""
        return self._hold.size_of(("resident", key))

    def holding_place(self, key: Hashable) -> Any:
        """The place ``key``'s resident KV is counted on, or None when it holds none."""
        return self._hold.place_of(("resident", key))

    def leases(self) -> list[Lease]:
        """The live leases, in grant order."""
        return list(self._leases.values())

    def holds(self, ticket: Hashable) -> bool:
        """True if ``ticket`` currently holds a lease."""
        return ticket in self._leases

    def lease(self, ticket: Hashable) -> Lease | None:
        """The lease held by ``ticket``, or None."""
        return self._leases.get(ticket)

    def release(self, ticket: Hashable, now: float) -> int:
        """End ``ticket``'s lease; returns the tokens freed (0 if it held none: idempotent). A prefix block
        other leases still hold stays counted, so the freed figure can be below the lease's tokens."""
        lease = self._leases.pop(ticket, None)
        if lease is None:
            return 0
        n = self._lease_n.get(lease.place, 0) - 1
        if n > 0:
            self._lease_n[lease.place] = n
        else:
            self._lease_n.pop(lease.place, None)
        return self._hold.remove(ticket)

    def leases_on(self, place: Any) -> int:
        """Calls holding a lease on ``place`` now (granted there, not yet released), O(1)."""
        return self._lease_n.get(self.resolve_place(place), 0)

    def renew(self, ticket: Hashable, now: float) -> bool:
        """Push ``ticket``'s lease expiry to now + lease_ttl_s (long streams); False if it holds none."""
        lease = self._leases.get(ticket)
        if lease is None:
            return False
        self._leases[ticket] = replace(lease, expires_at=float(now) + self.lease_ttl_s)
        return True

    def expire(self, now: float) -> list[Hashable]:
        """Reclaim leases whose expires_at <= now (stranded: the shell never released them).

        Returns the reclaimed tickets in grant order; each counts in lease_expired_total.
        """
        if now < self._expiry_floor:
            return []
        gone = [t for t, lease in self._leases.items() if lease.expires_at <= now]
        for t in gone:
            self.release(t, now)
        self._expiry_floor = min((lease.expires_at for lease in self._leases.values()), default=math.inf)
        self._lease_expired_total += len(gone)
        return gone

    def next_expiry(self) -> float | None:
        """When expire() may next reclaim a lease (seconds): a lower bound on every lease's expires_at, exact
        after expire() ran; None without leases. O(1): the admission timer asks on every release."""
        return self._expiry_floor if self._leases else None

    def _prune(self, now: float) -> None:
        horizon = now - self.window_s
        while self._usage and self._usage[0][0] < horizon:
            self._usage.popleft()
