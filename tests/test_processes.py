"""``workers: 2``: two kvgate worker processes on one port (SO_REUSEPORT) under ``kvgate serve``'s
supervisor, sharing state through a real redis-server, in front of in-process simulated engines.

The supervisor is a subprocess in its own process group (kvgate.tools.procs); its run directory is put
in the test's log directory (TMPDIR), where each worker registers its private 127.0.0.1 port: a test
that must reach one given worker uses that port, everything else goes through the shared port. Waits
are on events a process we started reports (its registration, its answers), with deadlines.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvgate.tools import procs
from test_replicas_redis import REDIS, redis_server  # noqa: F401  (a real redis-server per test)

pytestmark = pytest.mark.skipif(REDIS is None, reason="redis-server not installed (Debian package redis-server)")


class Workers:
    """A running ``kvgate serve --workers N`` (the supervisor) and what its run directory says."""

    def __init__(self, proc: procs.Proc, port: int, tmp: Path, count: int):
        self.proc, self.port, self.tmp, self.count = proc, port, tmp, count
        self.url = f"http://127.0.0.1:{port}"

    def run_dir(self) -> Path:
        dirs = list(self.tmp.glob("kvgate-processes-*"))
        assert len(dirs) == 1, dirs
        return dirs[0]

    def registrations(self) -> dict[int, dict]:
        out = {}
        for i in range(self.count):
            try:
                out[i] = json.loads((self.run_dir() / f"process-{i}.json").read_text())
            except (OSError, ValueError):
                pass
        return out

    def private_url(self, i: int) -> str:
        return f"http://127.0.0.1:{self.registrations()[i]['port']}"

    async def wait_registered(self, timeout_s: float = 60, not_pid: dict[int, int] | None = None) -> dict[int, dict]:
        """Until every worker slot is registered (by a pid other than ``not_pid[i]``); returns the registrations."""
        deadline = time.monotonic() + timeout_s
        while True:  # a process we started reports readiness in its run directory
            if not self.proc.alive():
                raise RuntimeError(f"supervisor exited {self.proc.popen.returncode}:\n{self.proc.log_tail()}")
            regs = self.registrations() if list(self.tmp.glob("kvgate-processes-*")) else {}
            if len(regs) == self.count and all(regs[i]["pid"] != (not_pid or {}).get(i) for i in regs):
                return regs
            if time.monotonic() > deadline:
                raise TimeoutError(f"workers not registered: {regs}\n{self.proc.log_tail()}")
            await asyncio.sleep(0.05)


@pytest.fixture
async def workers_factory(log_dir):
    started: list[procs.Proc] = []

    async def start(*flags: str, count: int = 2) -> Workers:
        port = procs.free_port()
        tmp = log_dir / f"run{len(started)}"
        tmp.mkdir()
        cmd = [sys.executable, "-m", "kvgate", "serve", "--port", str(port), "--workers", str(count),
               "--no-compat-probe", *flags]
        p = procs.start(f"kvgate-workers{len(started)}", cmd, log_dir, env={"TMPDIR": str(tmp)})
        started.append(p)
        w = Workers(p, port, tmp, count)
        await w.wait_registered()
        await asyncio.to_thread(procs.wait_http, w.url + "/kvgate/health", 30, p,
                                lambda st, body: st == 200 and json.loads(body)["workers"]["up"] == count)
        return w

    yield start
    for p in started:
        p.stop()


def _flags(redis_url: str, engines: list[str], *extra: str) -> list[str]:
    return ["--upstream", engines[0], "--engines", *engines, "--state-backend", "redis", "--redis-url", redis_url,
            "--agentic-session-lifecycle", *extra]


async def _metrics(http: aiohttp.ClientSession, url: str) -> dict[tuple[str, tuple], float]:
    async with http.get(url + "/metrics") as r:
        assert r.status == 200
        text = await r.text()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def _by_worker(m: dict, name: str) -> dict[str, float]:
    return {dict(labels)["worker"]: v for (n, labels), v in m.items() if n == name}


def _total(m: dict, name: str, **labels: str) -> float:
    return sum(v for (n, ls), v in m.items() if n == name and all(dict(ls).get(k) == x for k, x in labels.items()))


async def _wait_reaped(pid: int, timeout_s: float = 30) -> None:
    """Until process ``pid`` is gone from /proc: it exited and the supervisor reaped it. (Earlier signs are
    not enough: a killed process's listening sockets are closed late in its exit, after its fd table looks
    empty and after its main thread is a zombie.)"""
    deadline = time.monotonic() + timeout_s
    while os.path.exists(f"/proc/{pid}"):  # the state of a process we started, read from /proc
        if time.monotonic() > deadline:
            raise TimeoutError(f"pid {pid} not reaped")
        await asyncio.sleep(0.01)


async def _generate(url: str, body: dict, http: aiohttp.ClientSession | None = None) -> dict:
    """One generate call on a new connection (the kernel picks the worker per connection)."""
    own = http is None
    http = http or aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))
    try:
        async with http.post(url + "/generate", data=orjson.dumps(body),
                             headers={"Content-Type": "application/json"}) as r:
            assert r.status == 200, await r.text()
            return await r.json()
    finally:
        if own:
            await http.close()


async def test_requests_over_many_connections_land_on_both_workers(redis_server, sim_factory, workers_factory):
    """40 calls, each on its own connection to the shared port: both workers serve some, and one scrape of
    the shared port counts all 40 (per worker and summed), whichever worker answers it."""
    e1 = await sim_factory(max_total_num_tokens=100_000, speed=1000)
    w = await workers_factory(*_flags(redis_server.url, [e1.url], "--agentic-program-admission"))
    sem = asyncio.Semaphore(8)

    async def one(i: int) -> None:
        async with sem:
            await _generate(w.url, {"input_ids": [1 + i % 7] * 20, "session_id": f"s{i}",
                                    "sampling_params": {"max_new_tokens": 2}})

    await asyncio.gather(*(one(i) for i in range(40)))
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as http:
        for _ in range(3):  # each scrape may land on either worker: the merge is the same
            m = await _metrics(http, w.url)
            per = _by_worker(m, "agentic_kv_worker_requests_total")
            assert sum(per.values()) == 40 and min(per.values()) > 0, per
            assert _total(m, "agentic_kv_requests_total", route="/generate", status="200") == 40
            assert _total(m, "agentic_kv_upstream_latency_seconds_count", route="/generate") == 40
            assert _by_worker(m, "agentic_kv_worker_up") == {"0": 1.0, "1": 1.0}
            assert m[("agentic_kv_workers", ())] == 2
            # a worker's own view (its session registry) is labelled per worker, not summed
            sessions = _by_worker({k: v for k, v in m.items() if dict(k[1]).get("state") == "active"},
                                  "agentic_kv_sessions")
            assert sessions == {k: per[k] for k in ("0", "1")}
        async with http.get(w.url + "/kvgate/health") as r:
            health = await r.json()
    assert health["workers"]["configured"] == 2 and health["workers"]["up"] == 2
    assert sum(e1.stats()["sessions"].values()) == 40  # every call reached the engine with its session id


async def test_a_session_alternating_workers_is_one_session_closed_once(redis_server, sim_factory, workers_factory):
    """One agent's turns alternate between the two workers, and then run on worker 1 alone for longer than
    the idle threshold: worker 0, which has not seen the session for that long, does not close it (Redis
    says it is active); every turn reached one engine under one session id. Once it is idle everywhere,
    exactly one worker closes it, once per engine."""
    e1 = await sim_factory(max_total_num_tokens=100_000, speed=1000)
    e2 = await sim_factory(max_total_num_tokens=100_000, speed=1000)
    threshold = 2.0
    w = await workers_factory(*_flags(redis_server.url, [e1.url, e2.url], "--session-placement", "kvgate",
                                      "--no-session-inference",
                                      "--session-idle-close-s", str(threshold)))
    w0, w1 = w.private_url(0), w.private_url(1)
    prompt = list(range(1, 80))
    turns = 0

    async def turn(url: str) -> None:
        nonlocal prompt, turns
        out = await _generate(url, {"input_ids": prompt, "session_id": "agent-1",
                                    "sampling_params": {"max_new_tokens": 4}})
        prompt = prompt + out["output_ids"] + [7, 8]
        turns += 1

    for k in range(6):
        await turn((w0, w1)[k % 2])
    w0_last = time.monotonic()
    # Worker 1 alone, back to back, for longer than the threshold plus a sweep (threshold / 4).
    while time.monotonic() - w0_last < threshold * 1.5:
        await turn(w1)
    async with aiohttp.ClientSession() as http:
        # Worker 0's own registry has not seen a turn for > threshold; its sweep asks Redis and learns the
        # session is active (its idle time restarts from the shared last activity).
        deadline = time.monotonic() + 30
        while True:
            async with http.get(w0 + "/kvgate/sessions/agent-1") as r:
                s0 = await r.json()
            if s0["idle_s"] < time.monotonic() - w0_last - threshold / 2 or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
        assert s0["state"] == "active" and s0["idle_s"] < time.monotonic() - w0_last - threshold / 2, s0
        await turn(w0)
        m = await _metrics(http, w.url)
        assert _total(m, "agentic_kv_session_close_total", reason="idle") == 0
        assert e1.engine.closes_received + e2.engine.closes_received == 0
        seen = [e1.stats()["sessions"].get("agent-1", 0), e2.stats()["sessions"].get("agent-1", 0)]
        assert sorted(seen) == [0, turns], seen  # one engine, one session id, every turn
        assert min(_by_worker(m, "agentic_kv_worker_requests_total").values()) >= 4
        # Idle everywhere now: one worker closes it (one call per engine), the other marks it closed elsewhere.
        deadline = time.monotonic() + 30
        while True:
            m = await _metrics(http, w.url)
            done = (_total(m, "agentic_kv_session_close_total", reason="idle") == 1
                    and _total(m, "agentic_kv_session_close_skipped_total", reason="elsewhere") == 1)
            if done or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)
        assert done, {k: v for k, v in m.items() if "close" in k[0]}
        assert e1.engine.closes_received == 1 and e2.engine.closes_received == 1


async def test_a_clients_close_on_one_worker_reads_as_the_clients_on_the_other(redis_server, sim_factory,
                                                                              workers_factory):
    """A client closes a session through worker 0 after a turn on each worker: worker 1 marks it closed
    without calls, for the client's reason (not as an idle close), and says the closes were another
    replica's; worker 0's record has both engines' answers."""
    e1 = await sim_factory(max_total_num_tokens=100_000, speed=1000)
    e2 = await sim_factory(max_total_num_tokens=100_000, speed=1000)
    w = await workers_factory(*_flags(redis_server.url, [e1.url, e2.url], "--session-placement", "kvgate",
                                      "--no-session-inference", "--session-idle-close-s", "1"))
    w0, w1 = w.private_url(0), w.private_url(1)
    prompt = list(range(1, 80))
    for url in (w0, w1):
        before = time.time()
        out = await _generate(url, {"input_ids": prompt, "session_id": "agent-2",
                                    "sampling_params": {"max_new_tokens": 4}})
        prompt = prompt + out["output_ids"] + [7, 8]
    import redis.asyncio as redis
    c = redis.from_url(redis_server.url, decode_responses=True)
    try:  # worker 1's record of its turn has reached Redis (a turn of a few ms is sent after its answer, batched)
        async with asyncio.timeout(30):
            while float((await c.hgetall("kvgate:sess:agent-2")).get("last", 0)) < before:
                await asyncio.sleep(0.01)
    finally:
        await c.aclose()
    async with aiohttp.ClientSession() as http:
        async with http.post(w0 + "/close_session", json={"session_id": "agent-2"}) as r:
            assert r.status == 200
        deadline = time.monotonic() + 30
        while True:  # worker 1's idle sweep (every quarter second here) learns of the close from Redis
            async with http.get(w1 + "/kvgate/sessions/agent-2") as r:
                s1 = await r.json()
            if s1["state"] == "closed" or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
        async with http.get(w0 + "/kvgate/sessions/agent-2") as r:
            s0 = await r.json()
        m = await _metrics(http, w.url)
    assert (s1["state"], s1["close_reason"], s1["closed_by_other_replica"], s1["close_results"]) == \
        ("closed", "client", True, {}), s1
    assert (s0["close_reason"], s0["closed_by_other_replica"]) == ("client", False), s0
    assert s0["close_results"] == {e1.url: "ok", e2.url: "ok"}, s0
    assert _total(m, "agentic_kv_session_close_total", reason="client") == 1
    assert _total(m, "agentic_kv_session_close_total", reason="idle") == 0
    assert _total(m, "agentic_kv_session_close_skipped_total", reason="elsewhere") == 1
    assert e1.engine.closes_received == 1 and e2.engine.closes_received == 1


async def test_a_killed_worker_is_restarted_and_requests_keep_succeeding(redis_server, sim_factory, workers_factory):
    """SIGKILL one worker: calls on the shared port keep being answered 200 (by the other worker meanwhile),
    the supervisor starts a new worker in its slot (counted), and both serve again. Stopping the supervisor
    stops every worker."""
    e1 = await sim_factory(max_total_num_tokens=100_000, speed=1000)
    w = await workers_factory(*_flags(redis_server.url, [e1.url]))
    before = w.registrations()
    os.kill(before[0]["pid"], signal.SIGKILL)
    # Connections the kernel queued on the worker until its sockets closed are reset (SO_REUSEPORT: one accept
    # queue per worker); the calls start once it is gone.
    await _wait_reaped(before[0]["pid"])
    for i in range(10):
        await _generate(w.url, {"input_ids": [3] * 20, "sampling_params": {"max_new_tokens": 2}})
    after = await w.wait_registered(not_pid={0: before[0]["pid"]})
    assert after[1]["pid"] == before[1]["pid"]
    for i in range(30):
        await _generate(w.url, {"input_ids": [4] * 20, "sampling_params": {"max_new_tokens": 2}})
    async with aiohttp.ClientSession() as http:
        m = await _metrics(http, w.url)
    assert _by_worker(m, "agentic_kv_worker_restarts_total") == {"0": 1.0, "1": 0.0}
    assert _by_worker(m, "agentic_kv_worker_up") == {"0": 1.0, "1": 1.0}
    per = _by_worker(m, "agentic_kv_worker_requests_total")
    assert per["1"] >= 10 and per["0"] > 0, per  # the new worker 0 serves again (30 new connections)
    assert sum(per.values()) == 40
    assert "process 0 exited with status -9" in w.proc.log_path.read_text()
    w.proc.stop()
    assert w.proc.popen.returncode == 0
    for reg in after.values():
        with pytest.raises(ProcessLookupError):
            os.kill(reg["pid"], 0)


def test_several_workers_with_the_memory_backend_is_one_config_error():
    res = subprocess.run([sys.executable, "-m", "kvgate", "serve", "--workers", "2", "--port", "0"],
                         capture_output=True, text=True, timeout=60, start_new_session=True)
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvgate: config error: workers: 2 worker processes need "
                                                   "state_backend: redis"), res.stderr


async def test_a_turns_end_written_before_its_start_leaves_no_turn_in_flight(redis_server):
    """A worker's turn writes go out in the background in batches, kept in order; a batch that failed halfway
    can still leave a turn's end in Redis without its start (then sent later): the session must not be left
    with a turn in flight for ever (it would never be idle-closed)."""
    from kvgate.common.metrics import Metrics
    from kvgate.shared.redis_state import SharedState
    st = SharedState(redis_server.url, "kvgate:", 600, 1.0, Metrics())
    await st.start()
    try:
        st.turn_finished("s")  # the end arrives first, in a batch of its own
        await st.drain()
        st.turn_started("s")
        await st.drain()
        import redis.asyncio as redis
        c = redis.from_url(redis_server.url, decode_responses=True)
        fields = await c.hgetall("kvgate:sess:s")
        await c.aclose()
        assert not [f for f in fields if f.startswith("if:")], fields
        assert (await st.idle_claim("s", -1.0))[0] == "close"
    finally:
        await st.stop()


def test_several_workers_on_a_port_in_use_is_one_line():
    import socket
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        res = subprocess.run([sys.executable, "-m", "kvgate", "serve", "--workers", "2", "--port", str(port),
                              "--state-backend", "redis"], capture_output=True, text=True, timeout=60,
                             start_new_session=True)
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"kvgate: startup error: cannot listen on 127.0.0.1:{port} ("), \
        res.stderr


async def test_many_calls_at_once_do_not_mark_redis_unreachable(redis_server):
    """Hundreds of requests in flight make hundreds of Redis calls at once: each gets a connection (redis-py's
    default pool of 100 raised MaxConnectionsError, and Redis was taken for down)."""
    from kvgate.common.metrics import Metrics
    from kvgate.shared.redis_state import SharedState
    m = Metrics()
    st = SharedState(redis_server.url, "kvgate:", 600, 1.0, m)
    await st.start()
    try:
        for i in range(300):
            st.turn_started(f"s{i}")  # 300 background writes at once
        await st.drain()
        # 300 calls at once; bounded, so a lost answer fails here instead of hanging the suite (one hang was seen
        # once under heavy load and not reproduced since)
        async with asyncio.timeout(60):
            claims = await asyncio.gather(*(st.idle_claim(f"s{i}", 3600.0) for i in range(300)))
        assert st.up and m.state_backend_up._value.get() == 1
        assert sum(m.state_backend_bypass.labels(op)._value.get() for op in ("turn", "idle")) == 0
        assert {c[0] for c in claims} == {"busy"}
    finally:
        await st.stop()
