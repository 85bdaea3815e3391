"""Shared fixtures: kvgate in-process on a random port, an echo upstream, the real smg router.

Everything listens on 127.0.0.1 with ports chosen by the OS. Subprocesses (the router) run in their own
process group and are ended by group id (kvgate.tools.procs).
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
from pathlib import Path

import orjson
import pytest
from aiohttp import web

from kvgate.tools import procs
from kvgate.config import validate
from kvgate.proxy.bootstrap import start_gateway


@pytest.fixture
async def kvgate_factory():
    """``await make(**config)`` -> (gateway, base_url); every kvgate made is cleaned up."""
    runners = []

    async def make(**raw):
        raw.setdefault("port", 0)
        raw.setdefault("compat_probe", False)
        gw, runner, port = await start_gateway(validate(raw))
        runners.append(runner)
        return gw, f"http://127.0.0.1:{port}"

    yield make
    for r in runners:
        await r.cleanup()


class Echo:
    """An upstream that records what it received and echoes it back as JSON (or SSE, or slowly)."""

    def __init__(self):
        self.received: list[dict] = []
        self.arrived = asyncio.Event()
        self.cancelled = asyncio.Event()
        self.release = asyncio.Event()
        self.port = 0

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if request.path in ("/workers", "/list_workers"):  # kvgate's discovery, not a test's request
            return web.Response(status=404)
        if request.path in ("/server_info", "/get_model_info"):  # discovery asks what lists no engine: an engine
            return web.json_response({})
        body = await request.read()
        rec = {"method": request.method, "path": request.path, "query": request.raw_path.partition("?")[2],
               "headers": dict(request.headers), "body": body}
        self.received.append(rec)
        self.arrived.set()
        if request.path == "/sse":
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "X-Up": "1"})
            await resp.prepare(request)
            for i in range(3):
                await resp.write(b"data: " + orjson.dumps({"i": i}) + b"\n\n")
                if i == 0:
                    await self.release.wait()  # the test reads chunk 0 before chunk 1 is produced
            await resp.write(b"data: [DONE]\n\n")
            return resp
        if request.path == "/slow":
            try:
                await asyncio.wait_for(self.release.wait(), 30)
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
            return web.Response(text="late")
        if request.path == "/status/418":
            return web.Response(status=418, text="teapot", headers={"X-Custom": "yes"})
        return web.Response(body=orjson.dumps({"method": rec["method"], "path": rec["path"], "query": rec["query"],
                                               "len": len(body)}),
                            content_type="application/json", headers={"X-Upstream-Header": "kept"})


@pytest.fixture
async def echo_upstream():
    echo = Echo()
    app = web.Application(client_max_size=1 << 30)
    app.router.add_route("*", "/{tail:.*}", echo.handle)
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    echo.port = runner.addresses[0][1]
    echo.url = f"http://127.0.0.1:{echo.port}"
    yield echo
    await runner.cleanup()


@pytest.fixture
def log_dir():
    with tempfile.TemporaryDirectory(prefix="kvgate-test-") as d:
        yield Path(d)


@pytest.fixture
async def router_factory(log_dir):
    """``await start(worker_urls, legacy=False, extra=[])`` -> router base URL; a real smg (or, legacy, sglang-router
    0.3.2, which drops session_id on /generate and chat) subprocess in its own process group, waited on until
    /readiness reports the workers healthy.
    The wait runs in a thread so in-process simulated engines keep answering the router meanwhile."""
    started: list[procs.Proc] = []

    async def start(worker_urls: list[str], legacy: bool = False, extra: list[str] | None = None,
              wait_healthy: int | None = None, policy: str = "round_robin") -> str:
        port, mport = procs.free_port(), procs.free_port()
        if legacy:
            pytest.importorskip("sglang_router", reason="sglang-router 0.3.2 not installed")
            cmd = procs.legacy_router_command(port, worker_urls, mport, policy=policy) + list(extra or [])
        else:
            if not procs.smg_installed():
                pytest.skip("the smg router is not installed (pip install smg)")
            cmd = procs.smg_command(port, worker_urls, mport, policy=policy, extra=extra)
        p = procs.start(f"router{len(started)}", cmd, log_dir, url=f"http://127.0.0.1:{port}")
        started.append(p)
        n = len(worker_urls) if wait_healthy is None else wait_healthy
        await asyncio.to_thread(procs.wait_http, p.url + "/readiness", 60, p, procs.router_ready(n))
        return p.url

    yield start
    for p in started:
        p.stop()


@pytest.fixture
async def kvgate_process(log_dir):
    """``await start(upstream, *flags, env=None)`` -> kvgate base URL; kvgate as its own process (its event loop
    is not the test's, so a canary measures kvgate alone). ``start.procs[url]`` is its procs.Proc."""
    started = []

    async def start(upstream: str, *flags: str, env: dict | None = None) -> str:
        port = procs.free_port()
        cmd = [sys.executable, "-m", "kvgate", "serve", "--upstream", upstream, "--port", str(port),
               "--no-compat-probe", *flags]
        p = procs.start(f"kvgate{len(started)}", cmd, log_dir, url=f"http://127.0.0.1:{port}", env=env)
        started.append(p)
        start.procs[p.url] = p
        await asyncio.to_thread(procs.wait_http, p.url + "/kvgate/health", 30, p)
        return p.url

    start.procs = {}
    yield start
    for p in started:
        p.stop()


class CloseWatcher:
    """Records the session ids an in-process simulated engine is asked to close, as events."""

    def __init__(self, handle):
        self.ids: list[str] = []
        self._cond = asyncio.Condition()
        engine = handle.engine
        original = engine.close_session

        def close_session(session_id: str):
            result = original(session_id)
            self.ids.append(session_id)
            asyncio.get_running_loop().create_task(self._notify())
            return result

        engine.close_session = close_session

    async def _notify(self):
        async with self._cond:
            self._cond.notify_all()

    async def wait_for(self, session_id: str, timeout: float = 10.0) -> None:
        async def _wait():
            async with self._cond:
                await self._cond.wait_for(lambda: session_id in self.ids)
        await asyncio.wait_for(_wait(), timeout)


@pytest.fixture
async def sim_factory():
    """``await make(**opts)`` -> an in-process simulated engine handle (kvgate.sim) on a random port."""
    from kvgate.sim.http_api import start_sim_engine
    handles = []

    async def make(**opts):
        h = await start_sim_engine("127.0.0.1", 0, **opts)
        handles.append(h)
        return h

    yield make
    for h in handles:
        await h.close()


@pytest.fixture
async def scripted():
    """``await make(answer, keep_alive=False, answers_discovery=True)`` -> a started fake_upstream.ScriptedUpstream
    (a raw-socket upstream answering ``answer``, keeping its connections open with ``keep_alive``, leaving kvgate's
    discovery calls to ``answer`` too without ``answers_discovery``); all closed after the test."""
    from fake_upstream import ScriptedUpstream
    ups = []

    async def make(answer=None, keep_alive: bool = False, answers_discovery: bool = True):
        up = await ScriptedUpstream(answer, keep_alive=keep_alive, answers_discovery=answers_discovery).start()
        ups.append(up)
        return up

    yield make
    for up in ups:
        await up.close()


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    """A real redis-server of the test module's own on a random 127.0.0.1 port (its own process group):
    its URL. Tests that use it skip themselves when redis-server is not installed."""
    port = procs.free_port()
    proc = procs.start(f"redis-{port}", procs.redis_command(port), tmp_path_factory.mktemp("redis"))
    try:
        procs.wait_redis(port, 20, proc)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.stop(5.0)


async def until_state(pred, what: str) -> None:
    """Yield to the event loop until ``pred()`` holds (no wall-clock wait: what the test waits for is already
    on its way, a reply read or a socket's end); AssertionError naming ``what`` after 100,000 turns."""
    for _ in range(100000):
        if pred():
            return
        await asyncio.sleep(0)
    raise AssertionError(what)


class ManualClock:
    """An injected clock (seconds) that moves only when a test sets ``t``."""

    def __init__(self, t: float = 1_000_000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture
async def pd_fleet(sim_factory, log_dir):
    """``await make(prefill=1, decode=2, policy="consistent_hashing", extra=None, **sim)`` -> (router URL,
    prefill handles, decode handles): in-process simulated prefill and decode workers (each prefill worker with
    a bootstrap port of its own) behind the real smg 1.13 in PD mode (``--pd-disaggregation``), waited on until
    /readiness reports every worker healthy. ``make.metrics[router URL]`` is smg's Prometheus /metrics URL."""
    started: list[procs.Proc] = []

    async def make(prefill: int = 1, decode: int = 2, policy: str = "consistent_hashing",
                   extra: list[str] | None = None, **sim):
        if not procs.smg_installed():
            pytest.skip("the smg router is not installed (pip install smg)")
        sim = {"max_total_num_tokens": 50_000, "speed": 50, **sim}
        ps = [await sim_factory(disaggregation_mode="prefill", disaggregation_bootstrap_port=procs.free_port(),
                                **sim) for _ in range(prefill)]
        ds = [await sim_factory(disaggregation_mode="decode", **sim) for _ in range(decode)]
        port, mport = procs.free_port(), procs.free_port()
        cmd = procs.smg_pd_command(port, [(p.url, p.engine.opts.disaggregation_bootstrap_port) for p in ps],
                                   [d.url for d in ds], mport, policy=policy, extra=extra)
        p = procs.start(f"pd-router{len(started)}", cmd, log_dir, url=f"http://127.0.0.1:{port}")
        started.append(p)
        make.metrics[p.url] = f"http://127.0.0.1:{mport}/metrics"
        await asyncio.to_thread(procs.wait_http, p.url + "/readiness", 60, p, procs.router_ready(prefill + decode))
        return p.url, ps, ds

    make.metrics = {}
    yield make
    for p in started:
        p.stop()
