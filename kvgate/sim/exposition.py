"""Prometheus text for the simulated engine, with SGLang's ``sglang:`` names and labels.

Follows SGLang
srt/metrics/collector.py: prometheus_client multiprocess format (no ``_created`` series,
labels sorted by name, ``le`` included), scheduler labels model_name, engine_type="unified",
tp_rank, pp_rank, moe_ep_rank, plus dp_rank when dp_size > 1. The text is built directly
(pure function of the snapshots) so label order and float formatting are exact.
"""

from __future__ import annotations

import bisect
import math
import os
from dataclasses import dataclass, field
from typing import Iterable, Optional

# SGLang collector.py bucket bounds (seconds)
TTFT_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0, 10.0, 20.0, 40.0, 60.0,
                80.0, 100.0, 200.0, 400.0)
E2E_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0, 10.0, 20.0, 40.0, 60.0,
               80.0, 100.0, 200.0, 400.0, 800.0)


def fmt(v: float) -> str:
    """prometheus_client floatToGoString: 1 -> "1.0", inf -> "+Inf"."""
    v = float(v)
    if v == math.inf:
        return "+Inf"
    if v == -math.inf:
        return "-Inf"
    if math.isnan(v):
        return "NaN"
    return repr(v)


class Histogram:
    """Cumulative-bucket histogram (seconds). ``observe(x)``; ``buckets()`` -> [(le, count)]."""

    def __init__(self, bounds: Iterable[float]):
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, x: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, x)] += 1
        self.sum += x
        self.count += 1

    def buckets(self) -> list[tuple[float, int]]:
        out, acc = [], 0
        for b, c in zip(self.bounds + (math.inf,), self.counts):
            acc += c
            out.append((b, acc))
        return out


@dataclass
class RankSnapshot:
    """Values of one DP rank (tokens, requests, seconds)."""

    dp_rank: int
    max_total_num_tokens: int
    num_used_tokens: int
    available: int
    evictable: int
    num_running_reqs: int
    num_queue_reqs: int
    cache_hit_rate: float
    num_retracted_reqs: int
    new_token_ratio: float
    retracted_total: int
    evicted_total: int
    prompt_tokens_total: int
    generation_tokens_total: int
    cached_tokens_total: int
    num_requests_total: int
    aborted_total: int
    # HiCache (0 / False without it)
    hicache: bool = False
    host_total_tokens: int = 0
    host_used_tokens: int = 0
    load_back_tokens_total: int = 0
    backup_tokens_total: int = 0
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS))

    @property
    def token_usage(self) -> float:
        """num_used / max_total rounded to 2 decimals (SGLang scheduler_metrics_mixin)."""
        return round(self.num_used_tokens / self.max_total_num_tokens, 2)


def snapshot(scheduler, dp_rank: int, ttft: Optional[Histogram] = None,
             e2e: Optional[Histogram] = None) -> RankSnapshot:
    """Build a :class:`RankSnapshot` from a ``kvgate.sim.scheduler.Scheduler``."""
    c = scheduler.cache
    s = RankSnapshot(
        dp_rank=dp_rank, max_total_num_tokens=c.max_total, num_used_tokens=c.num_used,
        available=c.available, evictable=c.evictable,
        num_running_reqs=len(scheduler.running), num_queue_reqs=scheduler.num_queue(),
        cache_hit_rate=scheduler.cache_hit_rate(), num_retracted_reqs=scheduler.last_retracted,
        new_token_ratio=scheduler.new_token_ratio, retracted_total=scheduler.retracted_total,
        evicted_total=c.evicted_total, prompt_tokens_total=scheduler.prompt_tokens_total,
        generation_tokens_total=scheduler.generation_tokens_total,
        cached_tokens_total=scheduler.cached_tokens_total,
        num_requests_total=scheduler.num_requests_total, aborted_total=scheduler.aborted_total,
        hicache=c.host is not None, host_total_tokens=c.host.max_total if c.host else 0,
        host_used_tokens=c.host.tree_tokens if c.host else 0,
        load_back_tokens_total=scheduler.load_back_tokens, backup_tokens_total=c.backup_tokens_total)
    if ttft is not None:
        s.ttft = ttft
    if e2e is not None:
        s.e2e = e2e
    return s


def _labels(d: dict) -> str:
    return "{" + ",".join(f'{k}="{d[k]}"' for k in sorted(d)) + "}"


def render(ranks: list[RankSnapshot], model_name: str = "kvgate-sim", tp_copies: int = 1,
           dp_size: int = 1, pid: Optional[int] = None, engine_type: str = "unified") -> str:
    """Prometheus exposition text. ``tp_copies`` emits identical series for tp_rank 0..k-1
    (--enable-metrics-for-all-schedulers); ``dp_size > 1`` adds a dp_rank label per rank; ``engine_type`` is
    unified, or prefill / decode for a PD worker (SGLang's scheduler metrics label)."""
    pid = os.getpid() if pid is None else pid
    series: list[tuple[RankSnapshot, dict]] = []
    for snap in ranks:
        for tp in range(max(tp_copies, 1)):
            lab = {"model_name": model_name, "engine_type": engine_type, "tp_rank": str(tp),
                   "pp_rank": "0", "moe_ep_rank": "0"}
            if dp_size > 1:
                lab["dp_rank"] = str(snap.dp_rank)
            series.append((snap, lab))

    out: list[str] = []

    def family(name: str, typ: str, help_: str, getter, extra: Optional[dict] = None,
               suffix: str = ""):
        out.append(f"# HELP {name}{suffix} {help_}")
        out.append(f"# TYPE {name}{suffix} {typ}")
        for snap, lab in series:
            lab2 = dict(lab, **(extra or {}))
            out.append(f"{name}{suffix}{'_total' if typ == 'counter' else ''}"
                       f"{_labels(lab2)} {fmt(getter(snap))}")

    g = "gauge"
    family("sglang:max_total_num_tokens", g, "Maximum total number of tokens",
           lambda s: s.max_total_num_tokens)
    family("sglang:num_used_tokens", g, "The number of used tokens", lambda s: s.num_used_tokens)
    family("sglang:token_usage", g, "The token usage", lambda s: s.token_usage)
    family("sglang:full_token_usage", g, "The token usage of full attention layers",
           lambda s: s.token_usage)
    family("sglang:kv_available_tokens", g, "Free KV tokens", lambda s: s.available)
    family("sglang:kv_evictable_tokens", g, "Evictable (cached, unlocked) KV tokens",
           lambda s: s.evictable)
    family("sglang:kv_used_tokens", g, "Used KV tokens", lambda s: s.num_used_tokens)
    family("sglang:num_running_reqs", g, "The number of running requests",
           lambda s: s.num_running_reqs)
    family("sglang:num_queue_reqs", g, "The number of requests in the waiting queue",
           lambda s: s.num_queue_reqs)
    family("sglang:cache_hit_rate", g, "The prefix cache hit rate", lambda s: s.cache_hit_rate)
    family("sglang:new_token_ratio", g, "The new token ratio", lambda s: s.new_token_ratio)
    family("sglang:num_retracted_reqs", g, "The number of retracted requests",
           lambda s: s.num_retracted_reqs, extra={"pid": str(pid)})
    c = "counter"
    family("sglang:num_retracted_requests", c, "Number of retracted requests",
           lambda s: s.retracted_total)
    family("sglang:evicted_tokens", c, "Number of evicted tokens", lambda s: s.evicted_total,
           extra={"cache_type": "device"})
    family("sglang:prompt_tokens", c, "Number of prefill tokens processed",
           lambda s: s.prompt_tokens_total)
    family("sglang:generation_tokens", c, "Number of generation tokens processed",
           lambda s: s.generation_tokens_total)
    family("sglang:cached_tokens", c, "Number of cached prompt tokens",
           lambda s: s.cached_tokens_total)
    family("sglang:num_requests", c, "Number of requests processed",
           lambda s: s.num_requests_total)
    family("sglang:num_aborted_requests", c, "Number of requests aborted",
           lambda s: s.aborted_total)
    if any(snap.hicache for snap in ranks):
        # observability/metrics_collector.py (0.5.23): host pool gauges, load-back / backup counters (pool="kv")
        family("sglang:hicache_host_used_tokens", g, "The number of used tokens in the HiCache host pool",
               lambda s: s.host_used_tokens)
        family("sglang:hicache_host_total_tokens", g, "The total number of tokens in the HiCache host pool",
               lambda s: s.host_total_tokens)
        family("sglang:load_back_tokens", c, "The number of tokens loaded back from local host memory",
               lambda s: s.load_back_tokens_total, extra={"pool": "kv"})
        family("sglang:hicache_backup_tokens", c, "The number of tokens backed up from GPU to local host",
               lambda s: s.backup_tokens_total, extra={"pool": "kv"})
    for name, attr, help_ in (
            ("sglang:time_to_first_token_seconds", "ttft", "Histogram of time to first token"),
            ("sglang:e2e_request_latency_seconds", "e2e", "Histogram of end-to-end latency")):
        out.append(f"# HELP {name} {help_}")
        out.append(f"# TYPE {name} histogram")
        for snap, lab in series:
            h: Histogram = getattr(snap, attr)
            for le, cnt in h.buckets():
                out.append(f"{name}_bucket{_labels(dict(lab, le=fmt(le)))} {fmt(cnt)}")
            out.append(f"{name}_count{_labels(lab)} {fmt(h.count)}")
            out.append(f"{name}_sum{_labels(lab)} {fmt(h.sum)}")
    return "\n".join(out) + "\n"


def render_loads_prometheus(loads: list[dict]) -> str:
    """/v1/loads?format=prometheus: one gauge per numeric load field, labelled by dp_rank."""
    out = []
    keys = [k for k in (loads[0] if loads else {}) if k != "dp_rank"
            and isinstance(loads[0][k], (int, float)) and not isinstance(loads[0][k], bool)]
    for k in keys:
        out.append(f"# TYPE sglang:load_{k} gauge")
        for ld in loads:
            out.append(f'sglang:load_{k}{{dp_rank="{ld["dp_rank"]}"}} {fmt(ld[k])}')
    return "\n".join(out) + "\n"
