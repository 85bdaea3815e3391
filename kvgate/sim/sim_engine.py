"""Async shell around the pure core: one engine = ``dp_size`` ranks, each a RadixCache +
Scheduler driven by an asyncio task that sleeps for the simulated GPU time of every batch.

The loop never changes results: it calls ``schedule()`` / ``commit()`` one batch at a time;
short batches only accumulate a time debt that is slept once it exceeds ``SLEEP_QUANTUM_S``
(several decode steps per wake-up, identical counters and outputs).
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from dataclasses import dataclass, field
from typing import Optional

from kvgate.sim.exposition import (E2E_BUCKETS, TTFT_BUCKETS, Histogram, render, snapshot)
from kvgate.sim.host import contended_seconds, open_board
from kvgate.sim.radix import RadixCache
from kvgate.sim.scheduler import Event, Request, Scheduler, SchedulerConfig

SLEEP_QUANTUM_S = 0.001

# What a request still in flight when the engine stops (SIGTERM) ends with; also the refusal after it.
SHUTDOWN_MESSAGE = "The server is shutting down."


class EngineStopped(RuntimeError):
    """Raised by :meth:`SimEngine.submit` once the engine is stopping (the HTTP edge answers 503)."""


@dataclass
class EngineOptions:
    """Engine-wide options (see kvgate/sim/args.py for the flags)."""

    max_total_num_tokens: int = 200000
    session_semantics: str = "0.5.17"          # "0.5.17" | "0.5.15"
    enable_session_radix_cache: bool = True
    radix_eviction_policy: str = "lru"
    dp_size: int = 1
    tp_copies: int = 1
    disable_metrics: bool = False
    model_name: str = "kvgate-sim"
    # HiCache (server_args.py): host tier of hicache_size GB when > 0, else hicache_ratio x the device pool
    # (mem_cache/pool_host/base.py HostKVCache.__init__)
    enable_hierarchical_cache: bool = False
    hicache_ratio: float = 2.0
    hicache_size: float = 0.0
    hicache_write_policy: str = "write_through"
    # engines that share a host's cores (kvgate/sim/host.py): the board directory every engine of the host is
    # given, and the extra fraction of a prefill / decode batch's time each other engine computing adds
    host_board: Optional[str] = None
    host_contention_prefill: float = 0.0
    host_contention_decode: float = 0.0
    # prefill/decode disaggregation (SGLang's --disaggregation-mode null|prefill|decode): a prefill worker serves
    # its bootstrap rendezvous on disaggregation_bootstrap_port; a decode worker waits there for the prefill of
    # each request's bootstrap_room, then for the KV transfer (transfer_us_per_token per token its own radix
    # cache lacks, simulated time), at most bootstrap_timeout_s wall seconds for the prefill (kvgate/sim/disagg.py)
    disaggregation_mode: str = "null"
    disaggregation_bootstrap_port: int = 8998
    disaggregation_transfer_us_per_token: float = 5.0
    disaggregation_bootstrap_timeout_s: float = 300.0
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def host_pool_tokens(self) -> int:
        """Host-tier size per DP rank (tokens); 0 without HiCache."""
        if not self.enable_hierarchical_cache:
            return 0
        if self.hicache_size > 0:
            return int(self.hicache_size * 1e9 // self.scheduler.kv_bytes_per_token)
        return int(self.max_total_num_tokens * self.hicache_ratio)

    @property
    def session_mode(self) -> str:
        return self.session_semantics if self.enable_session_radix_cache else "off"


class RequestHandle:
    """Caller side of one submitted request: ``await next_event()`` until ``finished``."""

    def __init__(self, req: Request, dp_rank: int):
        self.req = req
        self.dp_rank = dp_rank
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self.done = asyncio.get_running_loop().create_future()

    async def next_event(self) -> Event:
        return await self.queue.get()

    async def wait(self) -> Request:
        """Wait for the end; returns the finished request."""
        return await asyncio.shield(self.done)


class Rank:
    """One DP rank: pure core + its asyncio driver state."""

    def __init__(self, idx: int, opts: EngineOptions, clock):
        self.idx = idx
        self.cache = RadixCache(opts.max_total_num_tokens, opts.session_mode,
                                opts.radix_eviction_policy)
        if opts.enable_hierarchical_cache:
            self.cache.attach_host(opts.host_pool_tokens(), opts.hicache_write_policy)
        self.sched = Scheduler(self.cache, opts.scheduler, clock=clock)
        self.ttft = Histogram(TTFT_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self.wake = asyncio.Event()
        self.pending_aborts: list[tuple[Optional[str], str]] = []
        self.busy = False  # a batch is in flight (between schedule and commit)
        self.task: Optional[asyncio.Task] = None
        self.board = open_board(opts.host_board)
        # what sharing the host cost: batches that started while another engine computed, and the simulated
        # seconds they took beyond their time alone
        self.contended_batches = 0
        self.contention_seconds = 0.0


class SimEngine:
    """The simulated engine. Raises ``SessionConfigError`` from the constructor on an invalid
    session/eviction combination (like SGLang at startup)."""

    def __init__(self, opts: EngineOptions):
        self.opts = opts
        asyncio.get_running_loop()  # must be constructed inside a running loop
        self.clock = time.monotonic
        self.ranks = [Rank(i, opts, self.clock) for i in range(max(opts.dp_size, 1))]
        self.handles: dict[str, RequestHandle] = {}
        self._rr = itertools.count()
        self.closes_received = 0
        # GET /v1/loads and GET /metrics answered: how often pollers (kvgate's capacity poller) read it
        self.capacity_reads = 0
        self.legacy_sessions: dict[str, dict] = {}
        self.weight_version = "default"
        # PD: bootstrap rooms this prefill worker finished / this decode worker received, and the tokens of KV
        # the decode worker received by transfer (kvgate/sim/disagg.py)
        self.pd_rooms = 0
        self.pd_transferred_tokens = 0
        self._stopped = False

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        for r in self.ranks:
            r.task = asyncio.get_running_loop().create_task(self._loop(r))

    async def stop(self) -> None:
        """Stop every rank and end each unfinished request with an abort (HTTP status 503, SHUTDOWN_MESSAGE),
        delivered as a finished event, so a stream or a waiting caller ends instead of waiting forever; later
        submits raise EngineStopped. Idempotent."""
        self._stopped = True
        for r in self.ranks:
            r.wake.set()
            if r.task:
                r.task.cancel()
        for r in self.ranks:
            if r.task:
                try:
                    await r.task
                except (asyncio.CancelledError, Exception):
                    pass
            if r.board:
                r.board.close()
        for h in list(self.handles.values()):
            req = h.req
            if not req.finished:
                # The ranks are gone, so nothing else will ever finish it; the scheduler's own abort is not used
                # because a rank cancelled mid-batch may hold a half-applied batch.
                req.finish_reason = {"type": "abort", "message": SHUTDOWN_MESSAGE, "status_code": 503}
                req.state = "finished"
                req.finish_time = self.clock()
                h.queue.put_nowait(Event(req, [], True))
            if not h.done.done():
                h.done.set_result(req)
        self.handles.clear()

    # ------------------------------------------------------------------ requests
    def submit(self, req: Request, dp_rank: Optional[int] = None) -> RequestHandle:
        """Queue ``req`` on ``dp_rank`` (round robin when None). Raises ValueError (bad request), EngineStopped
        after :meth:`stop`."""
        if self._stopped:
            raise EngineStopped(SHUTDOWN_MESSAGE)
        if not req.rid:
            req.rid = uuid.uuid4().hex
        if req.rid in self.handles:
            raise ValueError(f"Duplicate request id {req.rid}")
        if dp_rank is None:
            dp_rank = next(self._rr) % len(self.ranks)
        if not 0 <= dp_rank < len(self.ranks):
            raise ValueError(f"routed_dp_rank {dp_rank} out of range [0, {len(self.ranks)})")
        rank = self.ranks[dp_rank]
        rank.sched.add_request(req)  # may raise ValueError
        h = RequestHandle(req, dp_rank)
        self.handles[req.rid] = h
        rank.wake.set()
        return h

    def abort(self, rid: Optional[str], abort_all: bool = False,
              message: str = "Abort request") -> None:
        """Abort one rid (or all); applied by each rank between batches."""
        for r in self.ranks:
            if abort_all or (rid in r.sched.requests):
                r.pending_aborts.append((None if abort_all else rid, message))
                r.wake.set()
                if not r.busy:
                    self._apply_aborts(r)
                    self._dispatch(r)

    def close_session(self, session_id: str) -> None:
        """Broadcast /close_session to every rank."""
        self.closes_received += 1
        self.legacy_sessions.pop(session_id, None)
        for r in self.ranks:
            r.cache.close_session(session_id)

    def flush_cache(self) -> bool:
        """Drop every rank's radix tree; refused (False) while requests are pending."""
        if any(not r.sched.is_idle() for r in self.ranks):
            return False
        for r in self.ranks:
            r.cache.reset()
        return True

    # ------------------------------------------------------------------ loop
    def _apply_aborts(self, rank: Rank) -> None:
        pend, rank.pending_aborts = rank.pending_aborts, []
        for rid, msg in pend:
            if rid is None:
                rank.sched.abort_all()
            else:
                rank.sched.abort(rid, msg)

    def _dispatch(self, rank: Rank) -> None:
        for ev in rank.sched.pop_events():
            h = self.handles.get(ev.req.rid)
            if ev.finished:
                req = ev.req
                if req.first_token_time is not None:
                    rank.ttft.observe(req.first_token_time - req.arrival_time)
                if req.finish_time is not None:
                    rank.e2e.observe(req.finish_time - req.arrival_time)
                self.handles.pop(req.rid, None)
            if h is None:
                continue
            h.queue.put_nowait(ev)
            if ev.finished and not h.done.done():
                h.done.set_result(ev.req)

    async def _loop(self, rank: Rank) -> None:
        loop = asyncio.get_running_loop()
        target = loop.time()
        since_yield = 0
        while not self._stopped:
            self._apply_aborts(rank)
            batch = rank.sched.schedule()
            self._dispatch(rank)
            if batch is None:
                rank.wake.clear()
                if rank.pending_aborts:
                    continue
                await rank.wake.wait()
                target = loop.time()
                continue
            rank.busy = True
            now = loop.time()
            duration = batch.duration_s
            if rank.board:
                duration = self._contended(rank, batch, duration)
            target = max(target, now - 0.05) + duration
            if rank.board:
                # the board's clock is time.monotonic(); the loop's (uvloop's) may differ by an offset
                rank.board.busy_until(time.monotonic() + (target - now))
            if target - now >= SLEEP_QUANTUM_S:
                await asyncio.sleep(target - now)
                since_yield = 0
            else:
                since_yield += 1
                if since_yield >= 64:
                    since_yield = 0
                    await asyncio.sleep(0)
            rank.sched.commit(batch)
            rank.busy = False
            self._dispatch(rank)

    def _contended(self, rank: Rank, batch, duration: float) -> float:
        """``duration`` (wall seconds) stretched for the other engines computing on this host right now."""
        slowdown = (self.opts.host_contention_prefill if batch.kind == "prefill"
                    else self.opts.host_contention_decode)
        if slowdown <= 0:  # it still writes its own busy time, for engines on the board that do slow down
            return duration
        others = rank.board.others_busy(time.monotonic())
        if not others:
            return duration
        out = contended_seconds(duration, others, slowdown)
        rank.contended_batches += 1
        rank.contention_seconds += (out - duration) * self.opts.scheduler.speed
        return out

    # ------------------------------------------------------------------ observability
    def loads(self) -> list[dict]:
        """/v1/loads entries, one per dp rank."""
        out = []
        for r in self.ranks:
            c, s = r.cache, r.sched
            out.append({
                "dp_rank": r.idx, "num_running_reqs": len(s.running),
                "num_waiting_reqs": s.num_queue(), "num_total_reqs": len(s.running) + s.num_queue(),
                "num_used_tokens": c.num_used, "max_total_num_tokens": c.max_total,
                "token_usage": round(c.num_used / c.max_total, 2),
                "kv_available_tokens": c.available, "kv_evictable_tokens": c.evictable,
                "cache_hit_rate": s.cache_hit_rate(), "new_token_ratio": s.new_token_ratio,
            })
        return out

    def metrics_text(self) -> str:
        snaps = [snapshot(r.sched, r.idx, r.ttft, r.e2e) for r in self.ranks]
        engine_type = "unified" if self.opts.disaggregation_mode == "null" else self.opts.disaggregation_mode
        return render(snaps, self.opts.model_name, self.opts.tp_copies, len(self.ranks), engine_type=engine_type)

    def stats(self) -> dict:
        """/sim/stats JSON (see report): totals plus per dp rank counters and KV state."""
        ranks = []
        for r in self.ranks:
            c, s = r.cache, r.sched
            ranks.append({
                "dp_rank": r.idx,
                "cached_tokens": s.cached_tokens_total,
                "prompt_tokens": s.prompt_tokens_total,
                "generation_tokens": s.generation_tokens_total,
                "evicted_tokens": c.evicted_total,
                "session_freed_tokens": c.session_freed_total,
                "retractions": s.retracted_total,
                "aborted": s.aborted_total,
                "num_requests": s.num_requests_total,
                "sessions": dict(s.sessions_seen),
                "closes_received": c.closes_received,
                "max_total_num_tokens": c.max_total,
                "used": c.num_used, "available": c.available, "evictable": c.evictable,
                "running": len(s.running), "waiting": s.num_queue(),
                "new_token_ratio": s.new_token_ratio,
                "clipped_max_new_tokens": s.clipped_total,
                "host_hit_tokens": s.host_hit_tokens,
                "load_back_tokens": s.load_back_tokens,
                "load_back_seconds": s.load_back_seconds,
                "hicache_backup_tokens": c.backup_tokens_total,
                # device-to-host copy time of those backups at the same PCIe bandwidth; it overlaps compute
                "hicache_backup_seconds": c.backup_tokens_total * s.cfg.kv_bytes_per_token
                / s.cfg.hicache_h2d_bytes_per_s,
                "hicache_host_used_tokens": c.host.tree_tokens if c.host else 0,
                "hicache_host_total_tokens": c.host.max_total if c.host else 0,
                "session_state": c.session_states(),
                "host_contended_batches": r.contended_batches,
                "host_contention_seconds": round(r.contention_seconds, 3),
            })
        sessions: dict[str, int] = {}
        for rk in ranks:
            for k, v in rk["sessions"].items():
                sessions[k] = sessions.get(k, 0) + v
        keys = ("cached_tokens", "prompt_tokens", "generation_tokens", "evicted_tokens",
                "session_freed_tokens", "retractions", "aborted", "num_requests", "used",
                "available", "evictable", "running", "waiting", "max_total_num_tokens",
                "clipped_max_new_tokens", "host_hit_tokens", "load_back_tokens", "hicache_backup_tokens",
                "hicache_host_used_tokens", "hicache_host_total_tokens", "load_back_seconds",
                "hicache_backup_seconds", "host_contended_batches", "host_contention_seconds")
        totals = {k: sum(rk[k] for rk in ranks) for k in keys}
        # per session id: tokens it references in any rank's cache, and whether every rank that knows
        # it has it closed (tombstoned)
        session_state: dict[str, dict] = {}
        for rk in ranks:
            for sid, st in rk["session_state"].items():
                cur = session_state.setdefault(sid, {"ref_tokens": 0, "closed": True})
                cur["ref_tokens"] += st["ref_tokens"]
                cur["closed"] = cur["closed"] and st["closed"]
        totals["closes_received"] = self.closes_received
        return {"session_semantics": self.opts.session_semantics,
                "disaggregation_mode": self.opts.disaggregation_mode, "pd_rooms": self.pd_rooms,
                "pd_transferred_tokens": self.pd_transferred_tokens,
                "enable_session_radix_cache": self.opts.enable_session_radix_cache,
                "radix_eviction_policy": self.opts.radix_eviction_policy,
                "dp_size": len(self.ranks), "sessions": sessions, "session_state": session_state,
                "enable_hierarchical_cache": self.opts.enable_hierarchical_cache,
                "closes_received": self.closes_received, "totals": totals, "ranks": ranks}
