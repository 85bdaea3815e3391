"""The capacity poller: reads each engine's KV figures and hands a snapshot to the admission gate (I/O edge).

Every ``admission_poll_interval_s`` it asks each engine the directory knows for GET /v1/loads (always
mounted in recent SGLang) and falls back to GET /metrics (needs --enable-metrics). Parsing and the
TP/DP aggregation rules are pure (kvgate.admission.capacity). No engine known -> the gate is invalidated
(degraded at once). An unreachable router or a round where every scrape fails brings no new snapshot:
the last one goes stale after max(3 x interval, 5 s) and the ledger is degraded from then on (a busy
engine that answers one poll late does not flip admission off).

Replicas sharing state (``state_backend: redis``, ``shared``): one replica polls the engines for all of
them, under a lease in Redis it renews every round, and publishes its snapshot; the others read it.
A replica polls on its own when Redis is unreachable, when the published snapshot is older than two
intervals (the polling replica died or stalls: its lease expires after three) or when it names other
engines than this replica's directory lists.

HiCache host pools: when the gate counts them (the program policy, ``admission_host_cache``), each engine's
GET /server_info (fallback /get_server_info) is read once, when the engine first appears, and the room its
host pool adds (kvgate.admission.capacity.host_pool_tokens) is attached to that engine's figures in every
snapshot. An engine whose answer does not say is asked again after HOST_RETRY_S; until then it counts without
a host pool.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Callable

import aiohttp
import orjson

from kvgate.common.aio import cancel_tasks
from kvgate.admission.capacity import (METRIC_MAX_TOTAL, METRIC_NUM_USED, METRIC_TOKEN_USAGE, ClusterSnapshot,
                                       EngineCapacity, host_pool_tokens, parse_engine_loads, parse_engine_metrics,
                                       stale_after_s)
from kvgate.admission.gate import AdmissionGate
from kvgate.fleet.directory import EngineDirectory

log = logging.getLogger("kvgate.admission.poller")

_GAUGES = (METRIC_MAX_TOTAL, METRIC_NUM_USED, METRIC_TOKEN_USAGE)
_KEPT_LINES = tuple(x.encode() for x in (*_GAUGES, *(f"# {kind} {name}" for kind in ("HELP", "TYPE")
                                                    for name in _GAUGES)))
#: Seconds before an engine whose /server_info did not give its HiCache figures is asked again.
HOST_RETRY_S = 60.0
_LINE_MAX = 1 << 16  # a longer line is no gauge sample kvgate reads: skipped, not buffered
_YIELD_EVERY = 1 << 20


async def _gauge_lines(content: aiohttp.StreamReader) -> bytes:
    """The lines of an engine's /metrics that parse_engine_metrics reads (the three gauges' samples, HELP
    and TYPE), read as they stream in: a 20 MB exposition of histograms is never held whole, and the event
    loop every client shares is given back every megabyte."""
    kept: list[bytes] = []
    tail = b""
    skipping = False  # inside an over-long line
    since_yield = 0
    while chunk := await content.readany():
        lines = chunk.split(b"\n")
        if len(lines) == 1:
            if not skipping:
                tail += chunk
                if len(tail) > _LINE_MAX:
                    tail, skipping = b"", True
        else:
            first = b"" if skipping else tail + lines[0]
            kept.extend(ln for ln in (first, *lines[1:-1]) if ln.startswith(_KEPT_LINES))
            tail, skipping = lines[-1], False
        since_yield += len(chunk)
        if since_yield >= _YIELD_EVERY:
            since_yield = 0
            await asyncio.sleep(0)
    if not skipping and tail.startswith(_KEPT_LINES):
        kept.append(tail)
    return b"\n".join(kept) + b"\n"


def _parse_metrics_bytes(raw: bytes) -> EngineCapacity | None:
    """parse_engine_metrics over the kept lines' bytes; None when they are not UTF-8 or carry no capacity."""
    try:
        return parse_engine_metrics(raw.decode("utf-8"))
    except UnicodeDecodeError:
        return None


class CapacityPoller:
    """Polls engines for KV capacity and feeds ``gate`` (None: no admission) and every ``listeners`` callback
    (called with each new ClusterSnapshot; session placement reads it). interval_s: seconds between rounds."""

    def __init__(self, gate: AdmissionGate | None, directory: EngineDirectory, interval_s: float,
                 source: str = "auto", clock: Callable[[], float] = time.monotonic):
        self.gate = gate
        self.listeners: list[Callable[[ClusterSnapshot], None]] = []
        self.source = source
        self.directory = directory
        self.interval_s = interval_s
        self.clock = clock
        self.rounds = 0
        self.last_sources: dict[str, str] = {}
        self.round_done = asyncio.Event()
        self._degraded: bool | None = None
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task | None = None
        # kvgate.shared.redis_state.SharedState when replicas share one poll (see the module doc)
        self.shared = None
        # rounds by how this replica got its snapshot: polled for every replica (led), read what another
        # replica polled (read), polled for itself alone (own: no Redis, or no usable shared snapshot)
        self.shared_rounds = {"led": 0, "read": 0, "own": 0}
        self._leading = False
        # engine URL -> the room its HiCache host pool adds per DP rank (tokens; 0 = none), read once per engine
        self.host_tokens: dict[str, int] = {}
        self._host_retry: dict[str, float] = {}  # engine URL -> when to ask again (its answer did not say)
        self.count_host = gate is not None and getattr(gate.ledger, "count_host", False)

    async def start(self) -> None:
        timeout = aiohttp.ClientTimeout(total=scrape_timeout_s(self.interval_s))
        self._session = aiohttp.ClientSession(timeout=timeout, headers=getattr(self.directory, "engine_headers", None))
        self._task = asyncio.create_task(self._run(), name="kvgate-capacity-poller")

    async def stop(self) -> None:
        await cancel_tasks(self._task)
        if self._session is not None:
            await self._session.close()

    async def scrape(self, url: str) -> EngineCapacity | None:
        """One engine's capacity from /v1/loads, else /metrics; None when neither answers usefully."""
        assert self._session is not None
        if self.source != "metrics":
            cap = await self._scrape_loads(url)
            if cap is not None or self.source == "loads":
                return cap
        try:
            raw = None
            async with self._session.get(url + "/metrics") as resp:
                if resp.status == 200:
                    raw = await _gauge_lines(resp.content)
            if raw is not None:
                # An engine's /metrics runs to megabytes (histograms): only the gauges' lines were kept,
                # and they are parsed in a thread, off the event loop every client shares.
                cap = await asyncio.to_thread(_parse_metrics_bytes, raw)
                if cap is not None:
                    self.last_sources[url] = "/metrics"
                    return cap
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            pass
        self.last_sources[url] = "failed"
        return None

    async def _scrape_loads(self, url: str) -> EngineCapacity | None:
        try:
            async with self._session.get(url + "/v1/loads") as resp:
                if resp.status == 200:
                    cap = parse_engine_loads(orjson.loads(await resp.read()))
                    if cap is not None:
                        self.last_sources[url] = "/v1/loads"
                        return cap
        except (aiohttp.ClientError, asyncio.TimeoutError, orjson.JSONDecodeError, OSError):
            pass
        self.last_sources[url] = "failed"
        return None

    async def poll_once(self) -> ClusterSnapshot | None:
        """One round: scrape every engine whose KV pool holds sessions (a PD fleet's decode workers, not its
        prefill workers: kvgate.fleet.roles), reconcile or invalidate. Returns the snapshot (None = degraded)."""
        urls = self.directory.kv_holder_urls
        if not urls:
            if self.gate is not None:
                self.gate.invalidate()
            return None
        if self.directory.static is None and self.directory.last_error is not None:
            return None  # router unreachable: no fresh engine list, let the snapshot go stale
        snapshot = await self._shared_snapshot(urls) if self.shared is not None else None
        if snapshot is None:
            taken = self.clock()
            caps = await asyncio.gather(*(self.scrape(u) for u in urls))
            if all(c is None for c in caps):
                return None
            if self.count_host:
                await self._read_host_pools(urls)
                caps = [c.with_host(self.host_tokens.get(u)) if c is not None else None for u, c in zip(urls, caps)]
            snapshot = ClusterSnapshot.build(dict(zip(urls, caps)), taken, self.directory.layout.decode)
            if self._leading:
                await self.shared.publish_capacity(snapshot.to_wire(), stale_after_s(self.interval_s))
        if self.gate is not None:
            self.gate.reconcile(snapshot)
        for cb in self.listeners:
            try:
                cb(snapshot)
            except Exception:  # a consumer's fault must not stop polling
                log.exception("capacity listener failed")
        return snapshot

    async def _read_host_pools(self, urls: list[str]) -> None:
        """Read the HiCache host pool of every engine not read yet (one whose answer did not say: again after
        HOST_RETRY_S, /server_info asks the engine's scheduler); forget engines that left the list."""
        for gone in set(self.host_tokens) - set(urls):
            del self.host_tokens[gone]
        now = self.clock()
        new = [u for u in urls if u not in self.host_tokens and self._host_retry.get(u, -math.inf) <= now]
        for url, tokens in zip(new, await asyncio.gather(*(self._host_pool(u) for u in new))):
            if tokens is None:
                self._host_retry[url] = now + HOST_RETRY_S
            else:
                self._host_retry.pop(url, None)
                self.host_tokens[url] = tokens
                if tokens:
                    log.info("engine %s: its HiCache host pool adds %d tokens of room per rank for the program "
                             "policy", url, tokens)

    async def _host_pool(self, url: str) -> int | None:
        assert self._session is not None
        for path in ("/server_info", "/get_server_info"):
            try:
                async with self._session.get(url + path) as resp:
                    if resp.status == 200:
                        return host_pool_tokens(orjson.loads(await resp.read()))
            except (aiohttp.ClientError, asyncio.TimeoutError, orjson.JSONDecodeError, OSError):
                continue
        return None

    async def _shared_snapshot(self, urls: list[str]) -> ClusterSnapshot | None:
        """The snapshot another replica polled for this round, or None when this replica polls itself
        (it leads the poll: it then publishes what it gets; or no usable shared snapshot)."""
        self._leading = False
        lead = await self.shared.capacity_lead(3 * self.interval_s)
        if lead:
            self._leading = True
            self.shared_rounds["led"] += 1
            return None
        got = await self.shared.read_capacity() if lead is not None else None
        snapshot = None
        if got is not None and got[1] <= 2 * self.interval_s:
            wire, age, _ = got
            snapshot = ClusterSnapshot.from_wire(wire, self.clock() - age)
            if snapshot is not None and set(snapshot.engines) | snapshot.unhealthy != set(urls):
                snapshot = None  # the polling replica knows other engines: this one asks its own
        if snapshot is None:
            self.shared_rounds["own"] += 1
            return None
        self.shared_rounds["read"] += 1
        for u in urls:
            self.last_sources[u] = "failed" if u in snapshot.unhealthy else "shared"
        return snapshot

    def _log_transition(self) -> None:
        # One line when admission loses or regains its capacity signal, not one per round. Losing it needs the
        # user's action (WARNING, naming the cause); the first figures and their return are INFO.
        if self.gate is None:
            return
        degraded = self.gate.ledger.is_degraded(self.clock())
        if degraded != self._degraded:
            if degraded:
                log.warning("admission degraded: %s; requests bypass the queue until then",
                            degraded_cause(self.directory.upstream, self.directory.static is not None,
                                           self.directory.last_error, self.directory.urls, self.last_sources))
            elif self._degraded is None:
                log.info("admission: KV capacity figures from %d engines, ceiling %d tokens",
                         len(self.directory.kv_holder_urls), self.gate.ledger.ceiling)
            else:
                log.info("admission signal back: ceiling %d tokens", self.gate.ledger.ceiling)
            self._degraded = degraded

    async def _run(self) -> None:
        # The first round waits for the first engine list (or the router's failure to give one): before it,
        # "no engines" would only mean "not asked yet".
        await self.directory.first_refresh.wait()
        while True:
            try:
                await self.poll_once()
            except Exception:  # never let a bad answer kill the poller; staleness makes it degraded
                log.exception("capacity poll failed")
            self.rounds += 1
            self._log_transition()
            self.round_done.set()
            self.round_done.clear()
            await asyncio.sleep(self.interval_s)


def scrape_timeout_s(poll_interval_s: float) -> float:
    """Seconds one engine's /v1/loads or /metrics may take: 2 s, or 0.8 x the interval when that is longer, and
    never more than half the staleness bound (kvgate.admission.capacity.stale_after_s), so a slow answer delays
    a round without making the snapshot stale. It was 0.8 x the interval, at most 2 s: at a 0.2 s interval a
    real SGLang engine busy with a 2,600-token prompt on a loaded CPU answered later than 0.16 s, every scrape
    failed, and admission went degraded (every call bypassed) exactly while the pool was full."""
    return min(stale_after_s(poll_interval_s) / 2, max(2.0, 0.8 * poll_interval_s))


def degraded_cause(upstream: str, static: bool, discovery_error: str | None, urls: list[str],
                   scrapes: dict[str, str]) -> str:
    """Why admission has no fresh KV capacity figures, in words that say what to fix (pure).

    upstream: the router's base URL; static: the engines come from the config, not the router;
    discovery_error: the router's last discovery failure (None when it answered); urls: the engines known;
    scrapes: engine URL -> "/v1/loads", "/metrics" or "failed" from the last round."""
    if not static and discovery_error is not None:
        return (f"the router at {upstream} does not answer engine discovery ({discovery_error}); "
                f"check that it is running and that this is its HTTP port (not its Prometheus port)")
    if not urls:
        return (f"the router at {upstream} lists no engines (GET /workers); check its --worker-urls and that "
                f"the engines are healthy")
    failed = [u for u in urls if scrapes.get(u, "failed") == "failed"]
    if failed:
        return (f"{len(failed)} of {len(urls)} engines did not answer GET /v1/loads or GET /metrics "
                f"({', '.join(failed)}); check that they are up (/metrics needs --enable-metrics)")
    return ("the engines' last KV capacity figures are stale or show no healthy engine with KV capacity; check "
            "their token_usage and max_total_num_tokens in /kvgate/engines and /kvgate/stats")
