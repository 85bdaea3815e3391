"""/kvgate/health tells the truth about the router and the engines, with the reason, and kvgate says each change
in one log line: a real smg 1.13 (``python -m smg``) in front of two ``kvgate sim-engine`` processes, kvgate
in-process; the router and an engine are killed and restarted on their ports. Every wait is on an event (a
discovery refresh, a close's answer, a process ready), never a sleep."""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp
import pytest

from kvgate.fleet.directory import CONTROL_TIMEOUT_S
from test_chaos import Fleet

pytestmark = pytest.mark.router

INTERVAL_S = 1.0


async def _health(http, kv) -> tuple[int, dict]:
    async with http.get(kv + "/kvgate/health") as r:
        return r.status, await r.json()


def _lines(caplog, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


@pytest.fixture
async def router_fleet(kvgate_factory, log_dir, caplog):
    """A real smg in front of two simulated engines (all healthy), kvgate's INFO log captured, and
    ``await start(**config)`` -> (gateway, base_url): kvgate in front of that router with lifecycle on,
    session inference off and a discovery refresh every INTERVAL_S, plus ``config``. Yields (fleet, start);
    the fleet is stopped afterwards."""
    from kvgate.tools import procs
    if not procs.smg_installed():
        pytest.skip("the smg router is not installed (pip install smg)")
    fleet = Fleet(log_dir)
    caplog.set_level(logging.INFO, logger="kvgate")

    async def start(**config):
        return await kvgate_factory(upstream=fleet.router.url, discovery_interval_s=INTERVAL_S,
                                    agentic_session_lifecycle=True, session_inference=False, **config)

    try:
        await asyncio.gather(fleet.start_engine(0), fleet.start_engine(1))
        await fleet.start_router(healthy=2)
        yield fleet, start
    finally:
        fleet.stop_all()


async def test_health_follows_the_router_and_the_engines_with_the_reason(router_fleet, caplog):
    fleet, start = router_fleet
    router = fleet.router.url
    # the router routes every call (kvgate places none): without it nothing is served
    gw, kv = await start(close_retry_backoff_s=0.1, close_retry_max_backoff_s=0.3, close_retries=1000,
                         session_placement="router")
    d = gw.directory
    async with aiohttp.ClientSession() as http:
        status, h = await _health(http, kv)
        assert (status, h["status"], h["reasons"]) == (200, "ok", [])
        assert [(c["check"], c["ok"]) for c in h["checks"]] == [("router", True), ("engines", True)]
        assert h["checks"][1]["reason"] == "2 of 2 usable"

        # --- an engine dies: kvgate's own close to it fails, and marks it at once ---------------------
        async with http.post(kv + "/generate", json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}},
                             headers={"X-Session-ID": "s1"}) as r:
            assert r.status == 200
        dead = fleet.engine_urls[0]
        fleet.kill(fleet.engines[0])
        async with http.post(kv + "/kvgate/sessions/s1/close?wait=1") as r:
            closed = await r.json()
        assert closed["close_results"][dead].startswith("connect error")
        async with http.get(kv + "/kvgate/sessions/s1") as r:
            viewed = await r.json()
        assert set(closed) == set(viewed) >= {"kv_step", "idle_threshold_s", "engine", "children"}  # one view
        assert closed["close_results"] == viewed["close_results"]
        async with http.get(kv + "/kvgate/engines") as r:
            engines = {e["url"]: e for e in (await r.json())["engines"]}
        assert (engines[dead]["healthy"], engines[dead]["router_healthy"]) == (False, True)
        assert engines[dead]["kvgate_calls_failing"].startswith("/close_session: connect error")
        assert engines[fleet.engine_urls[1]]["healthy"] is True
        status, h = await _health(http, kv)
        assert (status, h["status"]) == (200, "degraded")
        assert h["reasons"] == [f"engines: 1 of 2 engines unusable: {dead} (kvgate's calls fail: "
                                f"{engines[dead]['kvgate_calls_failing']})"]
        assert h["checks"][1]["usable"] == 1

        # it comes back: the pending close goes through, the engine is usable again, each said once
        await fleet.start_engine(0)
        await gw.lifecycle.wait_until(lambda: gw.lifecycle.registry.get("s1").state == "closed", 30)
        await gw.lifecycle.wait_until(lambda: dead not in d.own_failures, 30)
        assert gw.lifecycle.registry.get("s1").as_json(0)["close_results"][dead] == "ok"
        assert _lines(caplog, "kvgate's own calls to it fail") == [
            f"engine {dead}: kvgate's own calls to it fail (/close_session: "
            f"{closed['close_results'][dead]}); marked unhealthy until it answers again"]
        assert _lines(caplog, "answers kvgate's calls again") == [f"engine {dead} answers kvgate's calls again"]
        assert _lines(caplog, "answers /close_session again") == [
            f"engine {dead} answers /close_session again: the close of s1 went through (no other close "
            f"was pending)"]
        status, h = await _health(http, kv)
        assert (status, h["status"]) == (200, "ok")

        # --- the router dies: down within one discovery interval, its 502s said once -----------------
        fleet.kill(fleet.router)
        killed = time.monotonic()
        refreshes = 0
        while (await _health(http, kv))[1]["status"] != "down":
            assert refreshes < 2, "still not down after a full discovery interval began after the kill"
            await d.refreshed.wait()
            refreshes += 1
        elapsed = time.monotonic() - killed
        assert elapsed <= INTERVAL_S + CONTROL_TIMEOUT_S, elapsed
        status, h = await _health(http, kv)
        assert (status, h["status"]) == (503, "down")
        assert h["reasons"][0].startswith(f"router: {router} unreachable (")
        assert h["reasons"][0].endswith("); forwarded calls get kvgate's 502")
        assert h["checks"][0]["ok"] is False
        for _ in range(5):
            async with http.post(kv + "/v1/completions", json={"model": "kvgate-sim", "prompt": "hi", "max_tokens": 1}) as r:
                assert r.status == 502
        assert len(_lines(caplog, f"router {router} unreachable")) == 1

        # --- it comes back: ok again at the next refresh, said once --------------------------------
        await fleet.start_router(healthy=2)
        while (await _health(http, kv))[1]["status"] != "ok":
            await d.refreshed.wait()
        assert _lines(caplog, f"router {router} answers again") == [f"router {router} answers again"]
        async with http.post(kv + "/v1/completions", json={"model": "kvgate-sim", "prompt": "hi", "max_tokens": 1}) as r:
            assert r.status == 200
    print(f"health down {elapsed:.2f} s after the router was killed (discovery interval {INTERVAL_S} s)")


async def test_with_the_router_dead_health_says_what_kvgate_still_serves(router_fleet, caplog):
    """kvgate places a session's calls on the engines itself (lifecycle on): with smg dead those calls are still
    answered, so /kvgate/health is degraded (200) naming the router, with the figures; it checks the engines
    itself meanwhile (the router's verdicts are stale), and is down once no engine answers either."""
    fleet, start = router_fleet
    router = fleet.router.url
    gw, kv = await start(session_idle_close_s=0)
    d = gw.directory
    turn = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}
    async with aiohttp.ClientSession() as http:
        assert (await _health(http, kv))[1]["status"] == "ok"
        fleet.kill(fleet.router)
        while d.router.ok is not False:
            await d.refreshed.wait()
        statuses = []
        for sid in ("a", "b", "c"):  # a session's calls: placed by kvgate, straight to an engine
            async with http.post(kv + "/generate", json=turn, headers={"X-Session-ID": sid}) as r:
                statuses.append(r.status)
        async with http.post(kv + "/generate", json=turn) as r:  # no session: the router's, and it is gone
            statuses.append(r.status)
        assert statuses == [200, 200, 200, 502]
        status, h = await _health(http, kv)
        assert (status, h["status"]) == (200, "degraded")
        assert h["reasons"][0].startswith(f"router: {router} unreachable (")
        assert h["reasons"][0].endswith("; a session's calls on /generate, /v1/chat/completions, /v1/completions "
                                        "go straight to the engines kvgate places them on (2 usable, 3 calls "
                                        "answered since), every other call gets kvgate's 502")
        rc = h["checks"][0]
        assert (rc["ok"], rc["usable_engines"], rc["placed_calls_answered"]) == (False, 2, 3)
        assert rc["failures"] >= 1 and rc["since_s"] >= 0
        assert len(_lines(caplog, "still go straight to the engines")) == 1

        # an engine dies too: kvgate's own check finds it within a discovery interval (no call needed)
        fleet.kill(fleet.engines[0])
        dead = fleet.engine_urls[0]
        while dead not in d.own_failures:
            await d.refreshed.wait()
        status, h = await _health(http, kv)
        assert (status, h["status"]) == (200, "degraded")
        assert h["checks"][0]["usable_engines"] == 1 and h["checks"][1]["usable"] == 1
        assert d.own_failures[dead] == "GET /health: connect error while the router is unreachable"
        async with http.post(kv + "/generate", json=turn, headers={"X-Session-ID": "d"}) as r:
            assert r.status == 200

        # and the other: nothing can be served, down
        fleet.kill(fleet.engines[1])
        while fleet.engine_urls[1] not in d.own_failures:
            await d.refreshed.wait()
        status, h = await _health(http, kv)
        assert (status, h["status"]) == (503, "down")
        assert h["checks"][0]["usable_engines"] == 0

        # everything back: ok
        await asyncio.gather(fleet.start_engine(0), fleet.start_engine(1))
        await fleet.start_router(healthy=2)
        while (await _health(http, kv))[1]["status"] != "ok":
            await d.refreshed.wait()
