"""Chaos: engines killed mid-stream, the router killed and restarted, clients leaving at random, all at once;
kvgate keeps answering (never a 500 of its own) and ends with nothing reserved, waiting or in flight
(docs/guarantees.md).

A real smg in front of two simulated engines (each its own process, so they can be killed), kvgate
in-process with session lifecycle, prefix inference and admission on. Every step waits on an event
(first chunks received, processes ready), never on a sleep. KVGATE_CHAOS_CLIENTS sets clients per wave.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import sys

import aiohttp
import orjson
import pytest

from kvgate.tools import procs

pytestmark = pytest.mark.router

CLIENTS = int(os.environ.get("KVGATE_CHAOS_CLIENTS", "24"))


class Fleet:
    """Processes that can be killed and restarted on the same port."""

    def __init__(self, log_dir):
        self.log_dir = log_dir
        self.engine_ports = [procs.free_port(), procs.free_port()]
        self.router_port = procs.free_port()
        self.engines: list[procs.Proc | None] = [None, None]
        self.router: procs.Proc | None = None
        self.starts = 0

    @property
    def engine_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{p}" for p in self.engine_ports]

    async def start_engine(self, i: int) -> None:
        self.starts += 1
        cmd = [sys.executable, "-m", "kvgate", "sim-engine", "--port", str(self.engine_ports[i]),
               "--max-total-num-tokens", "6000", "--speed", "4"]
        p = procs.start(f"engine{i}-{self.starts}", cmd, self.log_dir, url=self.engine_urls[i])
        self.engines[i] = p
        await asyncio.to_thread(procs.wait_http, p.url + "/health", 30, p)

    async def start_router(self, healthy: int) -> None:
        self.starts += 1
        cmd = procs.smg_command(self.router_port, self.engine_urls, procs.free_port())
        self.router = procs.start(f"router-{self.starts}", cmd, self.log_dir, url=f"http://127.0.0.1:{self.router_port}")
        await asyncio.to_thread(procs.wait_http, self.router.url + "/readiness", 60, self.router,
                                procs.router_ready(healthy))

    @staticmethod
    def kill(p: procs.Proc) -> None:
        p.stop(grace_s=0.0)  # SIGTERM then SIGKILL to the group at once: a crash, not a drain

    def stop_all(self) -> None:
        for p in [self.router, *self.engines]:
            if p is not None:
                p.stop()


class Clients:
    """Client tasks with outcomes, and an event per first streamed chunk."""

    def __init__(self, kv: str, seed: int):
        self.kv = kv
        self.rng = random.Random(seed)
        self.outcomes: list[str] = []
        self.first_chunks = 0
        self.progress = asyncio.Condition()
        self.tasks: list[asyncio.Task] = []
        self.statuses: list[tuple[int, bytes, str | None]] = []

    async def _note_chunk(self) -> None:
        async with self.progress:
            self.first_chunks += 1
            self.progress.notify_all()

    async def wait_first_chunks(self, n: int, timeout: float = 60) -> None:
        async with self.progress:
            await asyncio.wait_for(self.progress.wait_for(lambda: self.first_chunks >= n), timeout)

    async def one(self, http: aiohttp.ClientSession, i: int, leave_after_first_chunk: bool) -> None:
        sid = f"chaos-{i % 7}"
        body = {"input_ids": list(range(1 + i % 5, 200 + 40 * (i % 9))),
                "sampling_params": {"max_new_tokens": 30 + 10 * (i % 13), "ignore_eos": True}, "stream": True}
        headers = {"Content-Type": "application/json"}
        if i % 3:
            headers["X-Session-ID"] = sid  # a third have no id: prefix inference names them
        try:
            async with http.post(self.kv + "/generate", data=orjson.dumps(body), headers=headers) as r:
                first = True
                async for _ in r.content.iter_any():
                    if first:
                        first = False
                        await self._note_chunk()
                        if leave_after_first_chunk:
                            self.outcomes.append("left")
                            return  # leaving the block closes the connection: the client is gone
                self.statuses.append((r.status, b"", r.headers.get("X-Kvgate-Error")))
                self.outcomes.append(f"status {r.status}")
        except aiohttp.ClientPayloadError:
            self.outcomes.append("cut")  # an engine or the router died mid-stream: the client sees the cut
        except aiohttp.ClientError as exc:
            self.outcomes.append(type(exc).__name__)

    def wave(self, http: aiohttp.ClientSession, start: int, n: int) -> list[asyncio.Task]:
        new = [asyncio.create_task(self.one(http, i, self.rng.random() < 0.3)) for i in range(start, start + n)]
        self.tasks += new
        return new

    def cancel_some(self, tasks: list[asyncio.Task]) -> None:
        for t in tasks:
            if self.rng.random() < 0.25:
                t.cancel()  # a client that disconnects at any point (waiting, streaming)


async def test_chaos_ends_with_nothing_reserved_waiting_or_in_flight(kvgate_factory, log_dir, caplog):
    if not procs.smg_installed():
        pytest.skip("the smg router is not installed (pip install smg)")
    fleet = Fleet(log_dir)
    try:
        await asyncio.gather(fleet.start_engine(0), fleet.start_engine(1))
        await fleet.start_router(2)
        gw, kv = await kvgate_factory(upstream=f"http://127.0.0.1:{fleet.router_port}", agentic_session_lifecycle=True,
                                      agentic_program_admission=True, admission_poll_interval_s=0.1,
                                      discovery_interval_s=0.2, agentic_admission_max_wait_s=5.0,
                                      close_timeout_s=0.5)
        await gw.directory.first_refresh.wait()
        clients = Clients(kv, seed=16)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
            # Wave 1: an engine dies while streams run on it.
            w1 = clients.wave(http, 0, CLIENTS)
            await clients.wait_first_chunks(CLIENTS // 3)
            fleet.kill(fleet.engines[0])
            clients.cancel_some(w1)
            await asyncio.gather(*w1, return_exceptions=True)
            # Wave 2: the router dies while streams run through it, and comes back (with the engine).
            w2 = clients.wave(http, CLIENTS, CLIENTS)
            await clients.wait_first_chunks(clients.first_chunks + 1)
            fleet.kill(fleet.router)
            clients.cancel_some(w2)
            await asyncio.gather(*w2, return_exceptions=True)
            # Wave 2b, sent while the router and engine 0 are down: a session kvgate places on the live engine is
            # answered there; anything else gets kvgate's 502 naming the upstream. Which of the two depends on
            # when discovery noticed the deaths, so only the set of outcomes is fixed.
            before = len(clients.outcomes)
            w3 = clients.wave(http, 2 * CLIENTS, CLIENTS // 2)
            await asyncio.gather(*w3, return_exceptions=True)
            w3_outcomes = clients.outcomes[before:]
            await fleet.start_engine(0)
            await fleet.start_router(2)
            # Wave 3: everything back; clients still leave at random.
            w4 = clients.wave(http, 3 * CLIENTS, CLIENTS)
            clients.cancel_some(w4)
            await asyncio.gather(*w4, return_exceptions=True)

        # The end state, on the gate's change events: nothing reserved, waiting or in flight.
        inflight = lambda: gw.metrics.inflight._value.get()  # noqa: E731
        await gw.gate.wait_until(lambda: gw.gate.ledger.reserved == 0 and gw.gate.coord.waiting == 0
                                 and inflight() == 0, timeout_s=30)
        sessions = gw.lifecycle.registry.as_json(gw.lifecycle.clock(), limit=1000)["sessions"]
        assert sessions and all(s["in_flight"] == 0 for s in sessions)
        assert all(t.in_flight == 0 for t in gw.inference._tracks.values())
        outcomes = {o: clients.outcomes.count(o) for o in sorted(set(clients.outcomes))}
        assert outcomes.get("status 200", 0) > 0, outcomes
        assert len(w3_outcomes) == CLIENTS // 2 and set(w3_outcomes) <= {"status 200", "status 502", "left"}, w3_outcomes
        assert "status 500" not in outcomes or all(e is None for s, _, e in clients.statuses if s == 500), outcomes
        kvgate_502 = [e for s, _, e in clients.statuses if s == 502]
        assert all(e in ("upstream_unreachable", "upstream_protocol_error", None) for e in kvgate_502)
        unhandled = [r for r in caplog.records if r.name.startswith("aiohttp.") and r.levelno >= logging.ERROR]
        assert unhandled == [], [r.getMessage() for r in unhandled]
        m = gw.metrics.render()[0].decode()
        assert 'agentic_kv_faults_total{stage="session"} 0.0' in m and 'agentic_kv_faults_total{stage="observer"} 0.0' in m
        # Every session's close reaches both engines, although one engine and the router died on the way.
        reg = gw.lifecycle.registry
        ids = [s["session_id"] for s in sessions]
        async with aiohttp.ClientSession() as http:
            for sid in ids:
                async with http.post(kv + "/close_session", json={"session_id": sid}) as r:
                    assert r.status == 200
        await gw.lifecycle.wait_until(lambda: reg.close_counts() == {"sending": 0, "pending": 0}
                                      and all(reg.get(sid).state == "closed" for sid in ids), 60)
        assert reg.close_stats["given_up"] == 0
        assert all(reg.get(sid).close_results == {u: "ok" for u in fleet.engine_urls} for sid in ids), \
            {sid: reg.get(sid).close_results for sid in ids}
    finally:
        fleet.stop_all()
