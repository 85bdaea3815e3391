"""The real-engine tier: kvgate in front of real SGLang 0.5.23 engines (CPU) and the real routers.

Two engines (kvgate.tools.sglang_engine, a tiny Llama with random weights, KV pools of POOL tokens, the session radix
cache on) are started once for the whole tier, side by side, with smg 1.13 (``python -m smg``, round_robin) and
sglang-router 0.3.2 in front of both; every test shares them and finds both radix caches flushed. A test that
needs engines started otherwise (DP, HiCache) asks ``real_fleet.exclusive(...)``: the shared engines stop first
(the tier holds at most two engine slots) and start again for the next test that uses them.
Skipped, saying why, when no engine environment is installed (``KVGATE_SKIP_ENGINE=1``, or no
``scripts/setup-engine.sh`` run). Docs: docs/real-engines.md.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from kvgate.tools import sglang_engine as eng
from kvgate.tools import procs

#: Each shared engine's KV pool (--max-total-tokens), tokens.
POOL = 4000
#: Shared engines (2; KVGATE_REAL_ENGINES=1 runs the tier on one where only one engine slot is free: the tests
#: that need two engines then skip the parts that do).
ENGINES = max(1, int(os.environ.get("KVGATE_REAL_ENGINES", "2")))
#: How long an engine may take to start, and to wait for a machine-wide engine slot (seconds): 17-32 s idle,
#: 130-353 s on a loaded 2-core machine.
START_TIMEOUT_S = float(os.environ.get("KVGATE_ENGINE_START_TIMEOUT_S", "900"))


def shared_spec() -> eng.EngineSpec:
    """The shared engines: POOL tokens, session radix cache (priority eviction), cache report on."""
    return eng.EngineSpec(max_total_tokens=POOL)


def start_engines(specs: list[eng.EngineSpec], log_dir: Path, prefix: str) -> list[eng.Engine]:
    """Start one engine per spec at once (each start is mostly imports: they overlap); all or none."""
    with concurrent.futures.ThreadPoolExecutor(len(specs)) as pool:
        futs = [pool.submit(eng.start_engine, s, log_dir, f"{prefix}{i}", None, START_TIMEOUT_S, START_TIMEOUT_S)
                for i, s in enumerate(specs)]
        started, errors = [], []
        for f in futs:
            try:
                started.append(f.result())
            except BaseException as exc:  # noqa: BLE001 - every engine that did start is stopped below
                errors.append(exc)
    if errors:
        for e in started:
            e.stop()
        raise errors[0]
    return started


def start_router(urls: list[str], log_dir: Path, name: str, legacy: bool = False,
                 policy: str = "round_robin") -> procs.Proc:
    """smg 1.13 (or, legacy, sglang-router 0.3.2) in front of ``urls``, waited on until /readiness lists them."""
    port, mport = procs.free_port(), procs.free_port()
    cmd = (procs.legacy_router_command(port, urls, mport, policy=policy) if legacy
           else procs.smg_command(port, urls, mport, policy=policy))
    p = procs.start(name, cmd, log_dir, url=f"http://127.0.0.1:{port}")
    try:
        procs.wait_http(p.url + "/readiness", 120, p, procs.router_ready(len(urls)))
    except BaseException:
        p.stop()
        raise
    return p


@dataclass
class RealFleet:
    """The tier's engines and routers. ``engines``/``smg``/``legacy`` are started on first use."""

    log_dir: Path
    engines: list[eng.Engine] = field(default_factory=list)
    routers: dict[str, procs.Proc] = field(default_factory=dict)
    starts: list[float] = field(default_factory=list)  # seconds each shared engine took to start
    failed: str | None = None  # why the shared engines could not start: every later test fails at once

    def ensure(self) -> "RealFleet":
        """Start the shared engines and both routers if they are not running."""
        if self.failed:
            pytest.fail(f"the shared engines did not start: {self.failed}")
        if not self.engines:
            try:
                self.engines = start_engines([shared_spec() for _ in range(ENGINES)], self.log_dir, "engine")
            except BaseException as exc:  # a timeout's Failed too: later tests must not start engines again
                self.failed = f"{type(exc).__name__}: {exc}"
                raise
            self.starts += [e.started_s for e in self.engines]
        for name, legacy in (("smg", False), ("legacy", True)):
            if name not in self.routers:
                self.routers[name] = start_router(self.urls, self.log_dir, name, legacy)
        return self

    @property
    def urls(self) -> list[str]:
        return [e.url for e in self.engines]

    @property
    def smg(self) -> str:
        return self.routers["smg"].url

    @property
    def legacy(self) -> str:
        return self.routers["legacy"].url

    def flush(self) -> None:
        for u in self.urls:
            eng.flush_cache(u, 60)

    def stop(self) -> None:
        procs.stop_all(list(self.routers.values()))
        self.routers.clear()
        for e in self.engines:
            e.stop()
        self.engines = []

    @contextlib.contextmanager
    def exclusive(self, specs: list[eng.EngineSpec], prefix: str = "special"):
        """Stop the shared fleet and run ``specs`` instead (yields their Engines); stops them after."""
        self.stop()
        started = start_engines(specs, self.log_dir, prefix)
        try:
            yield started
        finally:
            for e in started:
                e.stop()


def pytest_collection_modifyitems(config, items):
    """Tests that stop the shared engines for engines of their own (``exclusive_engines``) run after the others,
    so the shared engines start once. Only this tier's items move, among themselves. Each gets pytest-timeout's
    limit raised to cover an engine start (the first test of the tier, and the exclusive ones, start engines in
    their setup, which the limit counts)."""
    here = Path(__file__).parent
    slots = [i for i, it in enumerate(items) if Path(str(it.path)).is_relative_to(here)]
    for i in slots:
        items[i].add_marker(pytest.mark.timeout(2 * START_TIMEOUT_S + 600))
    block = sorted((items[i] for i in slots), key=lambda it: it.get_closest_marker("exclusive_engines") is not None)
    for i, it in zip(slots, block):
        items[i] = it


@pytest.fixture(scope="package")
def real_fleet():
    """The tier's RealFleet (not started yet: tests call ``ensure()`` through the ``fleet`` fixture)."""
    reason = eng.unavailable_reason()
    if reason:
        pytest.skip(f"real SGLang engine not available: {reason}")
    if not procs.smg_installed():
        pytest.skip("the smg router is not installed (pip install smg)")
    log_dir = Path(tempfile.mkdtemp(prefix="kvgate-real-"))
    f = RealFleet(log_dir)
    t0 = time.monotonic()
    try:
        yield f
    finally:
        f.stop()
        print(f"\nreal-engine tier: engines started in {', '.join(f'{s:.0f} s' for s in f.starts)}; "
              f"{time.monotonic() - t0:.0f} s with them; logs in {log_dir}")


@pytest.fixture
def fleet(real_fleet):
    """The shared fleet, running, both engines' radix caches flushed (no request runs between tests)."""
    real_fleet.ensure()
    real_fleet.flush()
    return real_fleet
