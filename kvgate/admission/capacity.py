"""Capacity signal: parse SGLang engine load reports into per-engine KV pools (pure, no I/O).

Rules (SGLang's GET /metrics and /v1/loads, see docs/compatibility.md):
- identical copies exported by tensor-parallel (and pipeline / MoE-EP) ranks are taken ONCE: max over
  the copies, never the sum (a sum would inflate capacity and shrink usage by the TP degree);
- data-parallel ranks (label ``dp_rank``, or one entry per rank in /v1/loads) are separate KV pools: their
  capacity and used tokens are summed for the engine, and each pool counts on its own for the pressure guard
  (``worst_usage`` is the highest single-pool usage);
- engines are summed for the cluster (:class:`ClusterSnapshot`);
- if ``token_usage`` reads 0 while ``num_used_tokens`` > 0, usage = num_used / capacity;
- implausible figures are no signal (fail-open: the engine counts as not answering): a pool larger than
  MAX_PLAUSIBLE_TOKENS, a usage above MAX_PLAUSIBLE_USAGE, or used tokens above that fraction of capacity.
  SGLang computes token_usage = used / max_total_num_tokens, so it never reads far above 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from collections.abc import Mapping
from functools import cached_property
from typing import Any, Iterable

from prometheus_client.parser import text_string_to_metric_families

__all__ = [
    "METRIC_MAX_TOTAL",
    "METRIC_NUM_USED",
    "METRIC_TOKEN_USAGE",
    "MAX_PLAUSIBLE_TOKENS",
    "MAX_PLAUSIBLE_USAGE",
    "Pool",
    "EngineCapacity",
    "ClusterSnapshot",
    "parse_engine_metrics",
    "parse_engine_loads",
    "host_pool_tokens",
    "stale_after_s",
]

METRIC_MAX_TOTAL = "sglang:max_total_num_tokens"
METRIC_NUM_USED = "sglang:num_used_tokens"
METRIC_TOKEN_USAGE = "sglang:token_usage"
METRIC_RUNNING = "sglang:num_running_reqs"
METRIC_QUEUED = "sglang:num_queue_reqs"
_WANTED = (METRIC_MAX_TOTAL, METRIC_NUM_USED, METRIC_TOKEN_USAGE)

#: No KV pool holds more tokens than this (2^40 ~ 1.1e12; today's largest pools hold ~1e7).
MAX_PLAUSIBLE_TOKENS = 1 << 40
#: token_usage above this is a broken figure, not pressure (SGLang's used / max_total cannot exceed 1).
MAX_PLAUSIBLE_USAGE = 1.5


def stale_after_s(poll_interval_s: float) -> float:
    """Staleness bound in seconds for a snapshot polled every ``poll_interval_s`` seconds.

    Returns max(3 x poll_interval_s, 5.0) (a busy engine answering one poll late must not turn admission off). Raises ValueError if the interval
    is not a positive finite number.
    """
    if not isinstance(poll_interval_s, (int, float)) or not math.isfinite(poll_interval_s) or poll_interval_s <= 0:
        raise ValueError(f"poll interval must be > 0 seconds, got {poll_interval_s!r}")
    return max(3.0 * float(poll_interval_s), 5.0)


@dataclass(frozen=True)
class Pool:
    """One KV pool (one data-parallel rank of an engine).

    capacity: max_total_num_tokens (tokens); used: num_used_tokens (tokens); usage: token_usage in [0, 1+]
    after the "0 while used > 0" fallback; host: the KV room the rank's HiCache host pool adds beyond the
    device pool (tokens, 0 without HiCache; :func:`host_pool_tokens`); requests: the rank's running plus
    waiting requests (num_running_reqs + num_waiting_reqs / num_queue_reqs; 0 when not reported), the
    compute load session placement balances.
    """

    capacity: int
    used: int
    usage: float
    host: int = 0
    requests: int = 0


@dataclass(frozen=True)
class EngineCapacity:
    """KV capacity of one engine (one worker URL): its pools, one per dp rank.

    ``capacity`` / ``used`` are summed over pools (tokens); ``worst_usage`` is the highest single-pool
    usage (the pressure guard's input); ``usage`` is the capacity-weighted mean over pools.
    Build it with :func:`parse_engine_metrics`, :func:`parse_engine_loads` or :meth:`from_pools`.
    """

    pools: tuple[Pool, ...]

    @classmethod
    def from_pools(cls, pools: Iterable[tuple[int, int, float] | Pool]) -> "EngineCapacity":
        """Build from (capacity tokens, used tokens, usage) triples; applies the usage-0 fallback."""
        return cls(tuple(_make_pool(p.capacity, p.used, p.usage) if isinstance(p, Pool) else _make_pool(*p) for p in pools))

    # Figures of an immutable snapshot, read by the ledger on every admission: computed once.
    @cached_property
    def capacity(self) -> int:
        return sum(p.capacity for p in self.pools)

    @property
    def used(self) -> int:
        return sum(p.used for p in self.pools)

    @cached_property
    def host(self) -> int:
        """HiCache host room (tokens beyond the device pools) summed over pools (0 without HiCache)."""
        return sum(p.host for p in self.pools)

    def with_host(self, host_per_pool: int | None) -> "EngineCapacity":
        """The same figures with every pool's HiCache host room set to ``host_per_pool`` tokens (SGLang sizes
        the host pool per DP rank); None or <= 0: no host room."""
        h = max(0, int(host_per_pool or 0))
        if all(p.host == h for p in self.pools):
            return self
        return EngineCapacity(tuple(Pool(p.capacity, p.used, p.usage, h, p.requests) for p in self.pools))

    @cached_property
    def worst_usage(self) -> float:
        return max((p.usage for p in self.pools), default=0.0)

    @property
    def usage(self) -> float:
        cap = self.capacity
        if cap <= 0:
            return 0.0
        return sum(p.usage * p.capacity for p in self.pools) / cap


def _make_pool(capacity: float, used: float | None, usage: float | None, requests: float | None = None) -> Pool:
    cap = int(capacity)
    reqs = max(0, int(requests)) if requests is not None else 0
    u = None if used is None else max(0, int(used))
    us = None if usage is None else max(0.0, float(usage))
    if u is None and us is None:
        u, us = 0, 0.0
    elif us is None or (us == 0.0 and u):
        us = (u / cap) if cap > 0 else 0.0
    elif u is None:
        u = int(round(us * cap))
    return Pool(capacity=cap, used=u, usage=us, requests=reqs)


def _num(v: Any) -> float | None:
    """A finite number from a metric sample or JSON value, else None (bools are not numbers)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        if isinstance(v, str):
            try:
                v = float(v)
            except ValueError:
                return None
        else:
            return None
    v = float(v)
    return v if math.isfinite(v) else None


def _pools_from_ranks(ranks: Mapping[str, dict[str, float]]) -> EngineCapacity | None:
    pools = []
    for key in sorted(ranks, key=_rank_sort_key):
        vals = ranks[key]
        cap = vals.get("cap")
        if cap is None or cap <= 0:
            continue
        if not _plausible(cap, vals.get("used"), vals.get("usage")):
            return None  # one broken pool makes the whole engine's report untrustworthy
        reqs = None
        if "running" in vals or "waiting" in vals:
            reqs = vals.get("running", 0.0) + vals.get("waiting", 0.0)
        pools.append(_make_pool(cap, vals.get("used"), vals.get("usage"), reqs))
    return EngineCapacity(tuple(pools)) if pools else None


def _plausible(cap: float, used: float | None, usage: float | None) -> bool:
    if cap > MAX_PLAUSIBLE_TOKENS:
        return False
    if usage is not None and usage > MAX_PLAUSIBLE_USAGE:
        return False
    if used is not None and used > cap * MAX_PLAUSIBLE_USAGE:
        return False
    return True


def _rank_sort_key(k: str) -> tuple[int, str]:
    try:
        return (int(k), k)
    except ValueError:
        return (1 << 30, k)


def _merge_max(d: dict[str, float], name: str, value: float) -> None:
    # Identical TP/PP/EP copies: take once via max (never sum).
    prev = d.get(name)
    d[name] = value if prev is None else max(prev, value)


def parse_engine_metrics(text: str) -> EngineCapacity | None:
    """Parse an engine's GET /metrics Prometheus text into an :class:`EngineCapacity`.

    Reads gauges sglang:max_total_num_tokens, sglang:num_used_tokens, sglang:token_usage (tokens, tokens,
    fraction). Series are grouped by ``dp_rank`` (absent -> one pool "0"); within a pool every other label
    (tp_rank, pp_rank, moe_ep_rank, engine_type, model_name, ...) is collapsed with max, so identical
    TP-rank copies count once. Returns None when the text does not parse or no pool has a positive
    max_total_num_tokens (missing signal -> caller treats the engine as unhealthy). Never raises.
    Source: SGLang's scheduler gauges (python/sglang/srt/observability/metrics_collector.py, 0.5.23), one
    series per scheduler labelled tp_rank and dp_rank: TP ranks of one DP rank report the same pool (max),
    DP ranks own separate pools.
    """
    if not isinstance(text, str) or not text:
        return None
    ranks: dict[str, dict[str, float]] = {}
    short = {METRIC_MAX_TOTAL: "cap", METRIC_NUM_USED: "used", METRIC_TOKEN_USAGE: "usage",
             METRIC_RUNNING: "running", METRIC_QUEUED: "waiting"}
    try:
        for fam in text_string_to_metric_families(text):
            if fam.name not in short:
                continue
            for s in fam.samples:
                if s.name != fam.name:  # e.g. _created or other suffixed samples
                    continue
                v = _num(s.value)
                if v is None:
                    continue
                rank = str(s.labels.get("dp_rank", "0"))
                _merge_max(ranks.setdefault(rank, {}), short[fam.name], v)
    except Exception:  # malformed exposition text: no signal
        return None
    return _pools_from_ranks(ranks)


def parse_engine_loads(obj: Any) -> EngineCapacity | None:
    """Parse an engine's GET /v1/loads JSON ({"loads": [one entry per dp rank, ...]}).

    Each entry may carry num_used_tokens, max_total_num_tokens, token_usage and dp_rank (missing dp_rank ->
    its list index). Entries repeating a dp_rank are collapsed with max (TP copies); distinct ranks are
    separate pools. Missing or non-numeric keys are tolerated; an entry without a positive
    max_total_num_tokens is skipped. Returns None if no usable entry. Never raises.
    Source: SGLang's GET /v1/loads (python/sglang/srt/entrypoints/v1_loads.py, 0.5.23).
    """
    if not isinstance(obj, Mapping):
        return None
    loads = obj.get("loads")
    if isinstance(loads, Mapping):
        loads = [loads]
    if not isinstance(loads, list):
        return None
    ranks: dict[str, dict[str, float]] = {}
    for i, entry in enumerate(loads):
        if not isinstance(entry, Mapping):
            continue
        dp = entry.get("dp_rank", i)
        rank = str(int(dp)) if isinstance(dp, (int, float)) and not isinstance(dp, bool) and math.isfinite(dp) else str(dp)
        d = ranks.setdefault(rank, {})
        for key, name in (("max_total_num_tokens", "cap"), ("num_used_tokens", "used"), ("token_usage", "usage"),
                          ("num_running_reqs", "running"), ("num_waiting_reqs", "waiting"),
                          ("num_queue_reqs", "waiting")):
            v = _num(entry.get(key))
            if v is not None:
                _merge_max(d, name, v)
    return _pools_from_ranks(ranks)


#: SGLang's KV memory figures: memory_usage["kvcache"] is in GiB (mem_usage / 1024^3,
#: srt/mem_cache/memory_pool.py); --hicache-size is in GB of 10^9 bytes (srt/mem_cache/memory_pool_host.py).
_GIB = 1024 ** 3


#: HiCache write policies whose host pool keeps a copy of what the device pool holds (srt/mem_cache/
#: hiradix_cache.py: write_through backs every inserted node up at once, write_through_selective the nodes hit
#: often enough); write_back writes a node to host only when the device evicts it.
INCLUSIVE_WRITE_POLICIES = ("write_through", "write_through_selective")


def host_pool_tokens(server_info: Any) -> int | None:
    """The KV room one DP rank's HiCache host pool adds beyond its device pool, in tokens, from an engine's
    GET /server_info; 0 when the engine runs without HiCache; None when the answer does not say (not a
    mapping, or figures missing).

    Host pool size, SGLang's rule (srt/mem_cache/memory_pool_host.py, HostKVCache): with ``--hicache-size``
    S > 0, S x 10^9 // (KV bytes per token) tokens, else ``--hicache-ratio`` (default 2.0) x the device pool
    (max_total_num_tokens). KV bytes per token come from ``internal_states[].memory_usage``: kvcache GiB /
    token_capacity. Room it adds: under write_through (the default, and write_through_selective) the host
    pool holds a copy of the device's KV, so it adds host - device (nothing when it is the smaller); under
    write_back it holds only what the device evicted, so it adds the whole host pool. Never raises.
    """
    if not isinstance(server_info, Mapping):
        return None
    enabled = server_info.get("enable_hierarchical_cache")
    if enabled is None:
        return None
    if enabled is not True:
        return 0
    device = _num(server_info.get("max_total_num_tokens"))
    states = server_info.get("internal_states")
    usage = states[0].get("memory_usage") if isinstance(states, list) and states and isinstance(states[0], Mapping) \
        else None
    if isinstance(usage, Mapping):
        device = _num(usage.get("token_capacity")) or device
    size_gb = _num(server_info.get("hicache_size")) or 0.0
    if size_gb > 0:
        kv_gib = _num(usage.get("kvcache")) if isinstance(usage, Mapping) else None
        if not kv_gib or not device or kv_gib <= 0 or device <= 0:
            return None  # the host pool is set in GB, and the KV bytes per token are not reported
        tokens = size_gb * 1e9 / (kv_gib * _GIB / device)
    else:
        ratio = _num(server_info.get("hicache_ratio"))
        if not device or device <= 0:
            return None
        tokens = (2.0 if ratio is None else ratio) * device
    if not 0 <= tokens <= MAX_PLAUSIBLE_TOKENS:
        return None
    if server_info.get("hicache_write_policy", "write_through") in INCLUSIVE_WRITE_POLICIES:
        return max(0, int(tokens) - int(device or 0))
    return int(tokens)


@dataclass(frozen=True)
class ClusterSnapshot:
    """Capacity of the whole fleet at monotonic time ``taken_at`` (seconds).

    ``engines`` maps engine URL -> EngineCapacity for every engine whose poll succeeded (the healthy set);
    engines whose poll failed are listed in ``unhealthy``. Figures: ``capacity`` and ``used`` summed over
    healthy engines (tokens), ``worst_usage`` the highest single-pool usage in the fleet, ``mean_usage`` the
    capacity-weighted mean usage. Engines are summed. ``decode_workers``: the engines that are a PD fleet's
    decode workers. A prefix missing from a decode worker's radix cache comes back by a KV transfer from the
    prefill worker, which prefills the prompt whatever the decode worker holds (SGLang
    disaggregation/decode.py asks the prefill worker only for what the decode radix cache lacks); a regular
    engine recomputes it.
    """

    taken_at: float
    engines: Mapping[str, EngineCapacity] = field(default_factory=dict)
    unhealthy: frozenset[str] = frozenset()
    decode_workers: frozenset[str] = frozenset()

    @classmethod
    def build(cls, results: Mapping[str, EngineCapacity | None], now: float,
              decode_workers: Iterable[str] = ()) -> "ClusterSnapshot":
        """Build from {engine_url: EngineCapacity or None (poll failed)} polled at ``now`` (seconds), of
        which ``decode_workers`` are a PD fleet's decode workers. An engine with implausible figures counts
        as unhealthy (no signal)."""
        healthy = {url: cap for url, cap in results.items() if cap is not None and cap.capacity > 0
                   and all(_plausible(p.capacity, p.used, p.usage) for p in cap.pools)}
        return cls(taken_at=float(now), engines=healthy, unhealthy=frozenset(u for u in results if u not in healthy),
                   decode_workers=frozenset(u for u in decode_workers if u in results))

    @property
    def healthy(self) -> frozenset[str]:
        return frozenset(self.engines)

    @cached_property
    def capacity(self) -> int:
        return sum(e.capacity for e in self.engines.values())

    @property
    def used(self) -> int:
        return sum(e.used for e in self.engines.values())

    @cached_property
    def worst_usage(self) -> float:
        return max((e.worst_usage for e in self.engines.values()), default=0.0)

    @cached_property
    def host(self) -> int:
        """HiCache host room (tokens beyond the device pools) of the healthy engines (0 without HiCache)."""
        return sum(e.host for e in self.engines.values())

    @property
    def mean_usage(self) -> float:
        cap = self.capacity
        if cap <= 0:
            return 0.0
        return sum(e.usage * e.capacity for e in self.engines.values()) / cap

    def to_wire(self) -> dict[str, Any]:
        """Everything but the time, JSON-able, for replicas that share one poller's snapshot:
        {"engines": {url: [[capacity, used, usage, host, requests] per pool]}, "unhealthy": [url, ...],
        "decode_workers": [url, ...]}."""
        return {"engines": {url: [[p.capacity, p.used, p.usage, p.host, p.requests] for p in e.pools]
                            for url, e in self.engines.items()},
                "unhealthy": sorted(self.unhealthy), "decode_workers": sorted(self.decode_workers)}

    @classmethod
    def from_wire(cls, obj: Any, taken_at: float) -> "ClusterSnapshot | None":
        """The snapshot :meth:`to_wire` wrote, taken at monotonic ``taken_at`` (seconds) on this process's
        clock. None when ``obj`` is not such a mapping (the reader then polls the engines itself)."""
        try:
            engines = {str(url): EngineCapacity(tuple(_wire_pool(*p) for p in pools))
                       for url, pools in obj["engines"].items()}
            unhealthy = [str(u) for u in obj["unhealthy"]]
            decode = [str(u) for u in obj.get("decode_workers", ())]  # (a replica of an earlier version: none)
        except (KeyError, TypeError, ValueError, AttributeError):
            return None
        return cls.build({**{u: None for u in unhealthy}, **engines}, taken_at, decode)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able summary (for /kvgate/stats)."""
        return {
            "taken_at": self.taken_at,
            "capacity_tokens": self.capacity,
            "used_tokens": self.used,
            "host_cache_tokens": self.host,
            "worst_usage": round(self.worst_usage, 4),
            "mean_usage": round(self.mean_usage, 4),
            "healthy_engines": sorted(self.engines),
            "unhealthy_engines": sorted(self.unhealthy),
            "engines": {
                url: {
                    "capacity_tokens": e.capacity,
                    "used_tokens": e.used,
                    "host_cache_tokens": e.host,
                    "worst_usage": round(e.worst_usage, 4),
                    "pools": [[p.capacity, p.used, round(p.usage, 4)] for p in e.pools],
                }
                for url, e in sorted(self.engines.items())
            },
        }


def _wire_pool(capacity: Any, used: Any, usage: Any, host: Any = 0, requests: Any = 0) -> Pool:
    # A replica of an earlier version writes three or four figures per pool (no host pool, no requests).
    p = _make_pool(float(capacity), float(used), float(usage))
    return Pool(p.capacity, p.used, p.usage, max(0, int(host)), max(0, int(requests)))
