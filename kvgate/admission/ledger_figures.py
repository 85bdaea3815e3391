"""The token ledger's figures: ceiling, reserved and the like, the usage window and /kvgate/stats (pure: read-only, injected ``now``).

Part of :class:`kvgate.admission.ledger.Ledger` (a base class of it: the methods read the ledger's records).
"""

from __future__ import annotations

from typing import Any

from .working_set import FLEET

__all__: list[str] = []


class _LedgerFigures:
    """The figures half of Ledger; no state of its own."""

    @property
    def ceiling(self) -> int:
        """The fleet's ceiling: floor(healthy engines' max_total_num_tokens x headroom), tokens."""
        return self._ceiling

    @property
    def reserved(self) -> int:
        """Tokens held by leases and resident KV on every place (shared prefixes once per place)."""
        return self._hold.grand_total()

    @property
    def available_tokens(self) -> int:
        """ceiling - reserved, at least 0 (tokens)."""
        return max(0, self._ceiling - self.reserved)

    @property
    def reserved_utilization(self) -> float:
        """reserved / ceiling (0 when the ceiling is 0; can exceed 1 after an oversized grant)."""
        return self.reserved / self._ceiling if self._ceiling > 0 else 0.0

    @property
    def lease_count(self) -> int:
        """Live leases."""
        return len(self._leases)

    @property
    def lease_expired_total(self) -> int:
        """Leases reclaimed by expire() since start."""
        return self._lease_expired_total

    @property
    def epoch(self) -> int:
        """Increments whenever the set of healthy engines changes."""
        return self._epoch

    def charge(self, place: Any, tokens: int, blocks: tuple = (), chained: bool = False) -> int:
        """What a reservation of ``tokens`` with prefix ``blocks`` would add on ``place`` now (tokens): the
        blocks not yet held there plus its tail, clamped to the place's engine as try_acquire does. ``chained``:
        ``blocks`` are chain hashes (kvgate's): the place's held prefix of them is found without a walk of them
        all (working_set.Holdings.cost_chained)."""
        place = self.resolve_place(place)
        tokens = min(int(tokens), self.max_tokens(place))
        bt = self._hold.block_tokens
        blocks = tuple(blocks)[: tokens // bt] if blocks else ()
        return (self._hold.cost_chained if chained else self._hold.cost)(place, blocks, tokens - len(blocks) * bt)

    def shares_start(self, place: Any, blocks: tuple) -> bool:
        """Whether ``place`` holds the first block of a prompt with prefix ``blocks`` (chain hashes: a place that
        holds none of its start holds none of the rest either), in O(1)."""
        return bool(blocks) and self._hold.has_block(self.resolve_place(place), blocks[0])

    def cost_alone(self, blocks: tuple, tail: int) -> int:
        """What (``blocks``, ``tail``) would add on a place that holds none of ``blocks``: every distinct block and
        the tail (tokens)."""
        return self._hold.cost_alone(blocks, tail)

    def refusal_charge(self, place: Any, tokens: int, blocks: tuple = (), start_held: bool = True) -> int:
        """What a reservation of ``tokens`` (not forced) with prefix ``blocks`` would add on engine ``place`` if
        the place refuses it over its own room alone (capacity_exhausted: usage under the pressure threshold, the
        charge no larger than the place's ceiling and above its free room; first_fit's inline refusal), else
        -1 (it may grant, or refuse for a reason the rest of the fleet enters). Counts nothing. ``start_held``
        False: ``place`` holds no holding that starts with ``blocks[0]`` (places_holding), so none of chain-hashed
        ``blocks``: its charge is read without a walk of them (as first_fit's ``start_held``)."""
        place = self.resolve_place(place)
        clamp, usage, ceiling = self._figures_of(place)
        hold = self._hold
        t, bt = min(tokens, clamp), hold.block_tokens
        bl = blocks[: t // bt]
        tail = t - len(bl) * bt
        cost = hold.cost(place, bl, tail) if start_held else hold.cost_alone(bl, tail)
        return cost if usage < self.pressure_threshold and cost <= ceiling < hold.total(place) + cost else -1

    def holdings_version(self) -> int:
        """Changes to the holdings so far (working_set.Holdings.version): an earlier value for changed_since."""
        return self._hold.version

    def changed_since(self, version: int) -> set | None:
        """The places whose holdings changed since ``holdings_version()`` was ``version`` (None: too long ago)."""
        return self._hold.changed_since(version)

    def usage_window(self, now: float) -> tuple[float, float] | None:
        """(mean of cluster mean_usage, max of worst pool usage) over snapshots taken in [now - window_s, now].

        None when no snapshot falls in the window.
        """
        self._prune(now)
        if not self._usage:
            return None
        return (sum(u[1] for u in self._usage) / len(self._usage), max(u[2] for u in self._usage))

    def stats(self, now: float) -> dict[str, Any]:
        """JSON-able figures for /kvgate/stats and the Prometheus gauges (tokens, fractions, seconds)."""
        win = self.usage_window(now)
        s = self._snapshot
        return {
            "ceiling": self._ceiling,
            "reserved": self.reserved,
            "available_tokens": self.available_tokens,
            "reserved_utilization": round(self.reserved_utilization, 6),
            "lease_count": self.lease_count,
            "lease_expired": self._lease_expired_total,
            "granted": self._granted_total,
            "oversized_granted": self._oversized_total,
            "forced_granted": self._forced_total,
            "engines": {str(url): {"ceiling": self.ceiling_of(url), "reserved": self.reserved_on(url),
                                   "host_cache_tokens": self._host_of(url)}
                        for url in sorted(s.engines)} if s is not None else {},
            # the HiCache host room the ceilings count (0 unless count_host)
            "host_cache_tokens": self._host_of(FLEET),
            "reserved_unplaced": self._hold.total(FLEET),
            "refused": dict(self._refused_total),
            "epoch": self._epoch,
            "degraded": self.is_degraded(now),
            "snapshot_age_s": None if s is None else round(now - s.taken_at, 3),
            "kv_token_usage_mean": None if win is None else round(win[0], 6),
            "kv_token_usage_max": None if win is None else round(win[1], 6),
            "worst_usage": None if s is None else round(s.worst_usage, 6),
            "healthy_engines": [] if s is None else sorted(s.engines),
            "headroom": self.headroom,
            "pressure_threshold": self.pressure_threshold,
            "stale_after_s": self.stale_after_s,
            "lease_ttl_s": self.lease_ttl_s,
            "window_s": self.window_s,
        }
