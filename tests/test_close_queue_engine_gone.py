"""An engine that leaves the fleet: its close queue and workers go, its pending closes are dropped (counted).

Real sockets: kvgate's lifecycle against simulated engines; one engine sits behind a NetGate so it can refuse
connections. The engine list is kvgate's static list, changed and refreshed by the test the way a discovery
round changes it (the same directory on_change path the router's /workers list takes).
"""

from __future__ import annotations

import aiohttp

from kvgate.fleet.discovery import static_engines
from kvgate.sessions.registry import ENGINE_GONE, SessionRegistry
from netgate import NetGate

SIM = {"max_total_num_tokens": 60_000, "speed": 50}


async def _set_fleet(gw, urls: list[str]) -> None:
    gw.directory.static = static_engines(urls)
    await gw.directory.refresh()


async def test_a_live_engine_that_leaves_loses_its_queue_and_gets_no_new_closes(sim_factory, kvgate_factory):
    a, b = await sim_factory(**SIM), await sim_factory(**SIM)
    gw, kv = await kvgate_factory(upstream=a.url, agentic_session_lifecycle=True, engines=[a.url, b.url])
    lc = gw.lifecycle
    async with aiohttp.ClientSession() as http:
        async with http.post(kv + "/kvgate/sessions/s1/close", params={"wait": "1"}) as r:
            assert (await r.json())["close_results"] == {a.url: "ok", b.url: "ok"}
        workers = list(lc._queues[b.url].workers)
        assert set(lc.stats()) == {a.url, b.url} and len(workers) == lc.close_concurrency
        await _set_fleet(gw, [a.url])
        # nothing queued, on the wire or pending for b: its queue goes at once and its workers end
        assert set(lc.stats()) == {a.url} and lc.queues_removed == 1
        await lc.wait_until(lambda: all(w.done() for w in workers), 10)
        async with http.post(kv + "/kvgate/sessions/s2/close", params={"wait": "1"}) as r:
            assert (await r.json())["close_results"] == {a.url: "ok"}
        assert (a.stats()["closes_received"], b.stats()["closes_received"]) == (2, 1)
        # b listed again: it gets a fresh queue and the next close
        await _set_fleet(gw, [a.url, b.url])
        async with http.post(kv + "/kvgate/sessions/s3/close", params={"wait": "1"}) as r:
            assert (await r.json())["close_results"] == {a.url: "ok", b.url: "ok"}
        assert b.stats()["closes_received"] == 2 and lc.stats()[b.url] == {"queued": 0, "failing": False,
                                                                             "gone": False}


async def test_a_dead_engine_that_leaves_has_its_pending_closes_dropped_and_its_queue_removed(sim_factory,
                                                                                                  kvgate_factory):
    a, b = await sim_factory(**SIM), await sim_factory(**SIM)
    gate = await NetGate.open(b.port)
    # retries 30 s apart: the failed closes stay pending for the whole test unless something drops them
    gw, kv = await kvgate_factory(upstream=a.url, agentic_session_lifecycle=True, engines=[a.url, gate.url],
                                  close_retry_backoff_s=30.0, close_timeout_s=0.5)
    lc, reg = gw.lifecycle, gw.lifecycle.registry
    try:
        await gate.down()  # b dies
        async with aiohttp.ClientSession() as http:
            for i in range(5):
                async with http.post(kv + "/close_session", json={"session_id": f"d{i}"}) as r:
                    assert r.status == 200
            await lc.wait_until(lambda: reg.close_counts()["pending"] == 5 and reg.close_stats["ok"] == 5, 30)
            assert reg.unfinished_on(gate.url) == 5 and reg.counts()["closing"] == 5
            workers = list(lc._queues[gate.url].workers)
            await _set_fleet(gw, [a.url])  # the router stops listing it
            assert reg.close_stats["dropped"] == 5 and reg.close_counts() == {"sending": 0, "pending": 0}
            assert reg.counts()["closed"] == 5
            assert all(reg.get(f"d{i}").close_results == {a.url: "ok", gate.url: ENGINE_GONE} for i in range(5))
            await lc.wait_until(lambda: gate.url not in lc.stats() and all(w.done() for w in workers), 10)
            m = gw.metrics.render()[0].decode()
            assert 'agentic_kv_session_close_dropped_total{reason="engine_gone"} 5.0' in m
            assert 'agentic_kv_session_close_total{reason="client"} 5.0' in m
            # closing d0 again re-arms its dropped close, but no engine listed would send it: dropped again,
            # and the session is closed (not stuck closing)
            async with http.post(kv + "/kvgate/sessions/d0/close", params={"wait": "1"}) as r:
                view = await r.json()
            assert view["state"] == "closed" and view["close_results"][gate.url] == ENGINE_GONE
            assert reg.close_stats["dropped"] == 6 and gate.url not in lc.stats()
    finally:
        await gate.close()


def test_registry_drops_only_pending_closes_of_that_engine():
    reg = SessionRegistry()
    for sid in ("x", "y"):
        reg.request_started(sid, "header", 0.0)
        reg.request_finished(sid, 1.0)
        assert reg.begin_close(sid, "idle", 2.0)
        assert reg.to_send(sid, ["A", "B"], 2.0) == ["A", "B"]
    reg.close_result("x", 1, "B", "connect error", 3.0)       # x: pending on B
    reg.close_result("x", 1, "A", "ok", 3.0)
    assert reg.drop_engine("B", 4.0) == ["x"]                 # y's call to B is still out: left to its call
    assert reg.get("x").state == "closed" and reg.get("x").close_results["B"] == ENGINE_GONE
    assert reg.get("y").state == "closing" and reg.unfinished_on("B") == 1 and reg.unfinished_on("A") == 1
    assert reg.due_retries(100.0) == []                      # x's retry is not sent
    assert reg.close_stats["dropped"] == 1 and reg.close_stats["given_up"] == 0


async def test_a_close_asked_while_no_engine_is_known_goes_to_the_engines_listed_next(sim_factory, kvgate_factory):
    a, b = await sim_factory(**SIM), await sim_factory(**SIM)
    gw, kv = await kvgate_factory(upstream=a.url, agentic_session_lifecycle=True, engines=[a.url, b.url])
    lc, reg = gw.lifecycle, gw.lifecycle.registry
    await _set_fleet(gw, [])  # kvgate knows no engine yet (just started, or the router lists none)
    async with aiohttp.ClientSession() as http:
        async with http.post(kv + "/close_session", json={"session_id": "early"}) as r:
            assert r.status == 200
        async with http.get(kv + "/kvgate/sessions/early") as r:
            view = await r.json()
        assert view["state"] == "closing" and view["close_results"] == {}
        assert reg.awaiting_engines() == ["early"]
        await _set_fleet(gw, [a.url, b.url])
        await lc.wait_until(lambda: reg.get("early").state == "closed", 10)
        async with http.get(kv + "/kvgate/sessions/early") as r:
            view = await r.json()
    assert view["close_results"] == {a.url: "ok", b.url: "ok"}
    assert (a.stats()["closes_received"], b.stats()["closes_received"]) == (1, 1)
    assert 'agentic_kv_session_close_total{reason="client"} 1.0' in gw.metrics.render()[0].decode()


async def test_a_waiting_close_dropped_over_the_cap_leaves_nothing_behind(sim_factory, kvgate_factory):
    a = await sim_factory(**SIM)
    gw, kv = await kvgate_factory(upstream=a.url, agentic_session_lifecycle=True, engines=[a.url])
    lc, reg = gw.lifecycle, gw.lifecycle.registry
    await _set_fleet(gw, [])
    reg.max_sessions = 1
    async with aiohttp.ClientSession() as http:
        for sid in ("first", "second"):  # the second close pushes the first, still waiting for an engine, out
            async with http.post(kv + "/close_session", json={"session_id": sid}) as r:
                assert r.status == 200
    assert reg.get("first") is None and reg.dropped == 1 and reg.awaiting_engines() == ["second"]
    await _set_fleet(gw, [a.url])
    await lc.wait_until(lambda: reg.get("second").state == "closed", 10)
    assert a.stats()["closes_received"] == 1 and lc._started == {}
