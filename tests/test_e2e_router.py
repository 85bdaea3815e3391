"""The whole path on real sockets: client -> kvgate -> real smg router -> simulated SGLang engines."""

import asyncio
import time

import aiohttp
import orjson

from conftest import CloseWatcher
from kvgate.tools.procs import free_port


async def _post(http, url, body, headers=None):
    async with http.post(url, data=orjson.dumps(body), headers={"Content-Type": "application/json", **(headers or {})}) as r:
        return r.status, await r.read(), r.headers


async def test_session_id_reaches_engine_through_smg_and_answers_are_identical(sim_factory, router_factory,
                                                                               kvgate_factory):
    e1 = await sim_factory(max_total_num_tokens=50_000, speed=50)
    router = await router_factory([e1.url])
    # the router places session traffic here (auto would place it on the engine itself)
    gw, kv = await kvgate_factory(upstream=router, agentic_session_lifecycle=True, session_placement="router")
    # greedy: identical answers direct and through the proxy (the default temperature 1.0 samples)
    req = {"input_ids": list(range(1, 301)),
           "sampling_params": {"max_new_tokens": 16, "ignore_eos": True, "temperature": 0}}
    async with aiohttp.ClientSession() as http:
        st, direct, _ = await _post(http, e1.url + "/generate", req)
        assert st == 200
        st, proxied, _ = await _post(http, kv + "/generate", req, {"X-Session-ID": "sess-42"})
        assert st == 200
        d, p = orjson.loads(direct), orjson.loads(proxied)
        assert p["output_ids"] == d["output_ids"] and p["text"] == d["text"] and len(p["output_ids"]) == 16
        assert p["meta_info"]["prompt_tokens"] == 300
        assert p["meta_info"]["cached_tokens"] >= 299  # the direct call left the prefix cached
        # stream: same SSE framing, same final ids, relayed through kvgate and smg
        sreq = {**req, "stream": True}
        async with http.post(kv + "/generate", json=sreq, headers={"X-Session-ID": "sess-42"}) as r:
            assert r.headers["Content-Type"].startswith("text/event-stream")
            via_kv = await r.read()
        async with http.post(e1.url + "/generate", json=sreq) as r:
            via_direct = await r.read()
    assert via_kv.endswith(b"data: [DONE]\n\n")
    kv_events = [orjson.loads(e[6:]) for e in via_kv.split(b"\n\n") if e.startswith(b"data: {")]
    dr_events = [orjson.loads(e[6:]) for e in via_direct.split(b"\n\n") if e.startswith(b"data: {")]
    assert [e["text"] for e in kv_events] == [e["text"] for e in dr_events]
    assert kv_events[-1]["output_ids"] == d["output_ids"]
    s = gw.lifecycle.registry.get("sess-42")
    assert (s.turns, s.in_flight, s.prompt_tokens, s.completion_tokens) == (2, 0, 600, 32)
    # Measured here: smg 1.13.0 re-serialises /generate and keeps the top-level session_id kvgate injected
    # (sglang-router 0.3.2 drops it: test_legacy_sglang_router_drops_session_id_and_kvgate_says_so); it
    # forwards it on /v1/completions too. (No probe here: the router places, session_placement: router.)
    assert not gw.directory.placed("/generate")
    assert e1.stats()["sessions"] == {"sess-42": 2}
    async with aiohttp.ClientSession() as http:
        st, body, _ = await _post(http, kv + "/v1/completions", {"model": "kvgate-sim", "prompt": "hello there",
                                                                 "max_tokens": 4}, {"X-Session-ID": "sess-42"})
    assert st == 200 and orjson.loads(body)["usage"]["completion_tokens"] == 4
    assert e1.stats()["sessions"] == {"sess-42": 3}


class HeldEngine:
    """An engine whose /close_session answers only when the test releases it (a hung engine, as an event)."""

    def __init__(self):
        self.arrived = asyncio.Event()
        self.release = asyncio.Event()

    async def __aenter__(self):
        from aiohttp import web

        async def close_session(request):
            self.arrived.set()
            await self.release.wait()
            return web.Response()
        app = web.Application()
        app.router.add_post("/close_session", close_session)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"
        return self

    async def __aexit__(self, *exc):
        self.release.set()
        await self.runner.cleanup()


async def test_close_reaches_every_engine_with_dp_ranks_collapsed_and_dead_engine_bounded(
        sim_factory, router_factory, kvgate_factory):
    """No wall-clock bounds: an engine that answers only when released shows that the caller is not held by the
    fan-out and that the other engines (and the dead one) are not held by a slow one."""
    e1 = await sim_factory(max_total_num_tokens=50_000, speed=50, dp_size=2)
    e2 = await sim_factory(max_total_num_tokens=50_000, speed=50)
    w1, w2 = CloseWatcher(e1), CloseWatcher(e2)
    router = await router_factory([e1.url, e2.url])
    dead = f"http://127.0.0.1:{free_port()}"
    async with HeldEngine() as held, aiohttp.ClientSession() as http:
        # DP-aware style URLs: the same engine listed once per rank; plus an engine that is down and one that hangs.
        gw, kv = await kvgate_factory(upstream=router, agentic_session_lifecycle=True, close_timeout_s=60,
                                      close_retry_backoff_s=30.0,  # no timed retry during the test
                                      engines=[e1.url + "@0", e1.url + "@1", e2.url, dead, held.url])
        await gw.directory.first_refresh.wait()
        assert gw.directory.urls == [e1.url, e2.url, dead, held.url]
        for turn in range(3):
            st, _, _ = await _post(http, kv + "/generate", {"input_ids": [1, 2, 3, turn], "sampling_params": {
                "max_new_tokens": 2}}, {"X-Session-ID": "s-close"})
            assert st == 200
        async with http.post(kv + "/close_session", json={"session_id": "s-close"}) as r:
            # the four engines listed (DP ranks collapsed, the dead one and the held one included)
            assert r.status == 200 and await r.json() == {"session_id": "s-close", "known": True,
                                                          "state": "closing", "engines": 4}
        # answered although the held engine cannot have answered: the caller is never held by the fan-out
        assert gw.lifecycle.registry.get("s-close").state == "closing" and not held.release.is_set()
        await w1.wait_for("s-close")
        await w2.wait_for("s-close")
        await held.arrived.wait()
        # every other engine has its answer while the hung one still holds its call: one slow engine holds up none
        await gw.lifecycle.wait_until(lambda: gw.lifecycle.registry.get("s-close").close_results.keys() == {
            e1.url, e2.url, dead})
        held.release.set()
        await gw.lifecycle.wait_until(lambda: held.url in gw.lifecycle.registry.get("s-close").close_results)
        # Asking again is idempotent for the engines that have the close, and retries the one that does not.
        async with http.post(kv + "/kvgate/sessions/s-close/close", params={"wait": "1"}) as r:
            view = await r.json()
    assert w1.ids.count("s-close") == 1 and w2.ids.count("s-close") == 1  # one call per engine, not per DP rank
    assert view["state"] == "closing" and view["closes"] == 0 and view["turns"] == 3  # not closed: dead lacks it
    assert [view["close_results"][u] for u in (e1.url, e2.url, held.url)] == ["ok", "ok", "ok"]
    assert view["close_results"][dead].startswith("connect error")
    assert view["close_pending"][dead]["state"] == "pending" and view["close_pending"][dead]["attempts"] == 1
    assert list(view["close_pending"]) == [dead]
    m = gw.metrics.render()[0].decode()
    assert 'agentic_kv_session_close_total{reason="client"} 0.0' in m
    assert "agentic_kv_session_close_failure_total 2.0" in m  # the first call and the one asked for again
    assert 'agentic_kv_session_close_pending{state="pending"} 1.0' in m
    assert 'agentic_kv_session_close_calls_total{result="ok"} 3.0' in m


async def test_close_waits_for_inflight_request(sim_factory, router_factory, kvgate_factory):
    e1 = await sim_factory(max_total_num_tokens=50_000, speed=5)
    w1 = CloseWatcher(e1)
    router = await router_factory([e1.url])
    gw, kv = await kvgate_factory(upstream=router, agentic_session_lifecycle=True)
    async with aiohttp.ClientSession() as http:
        gen = asyncio.create_task(_post(http, kv + "/generate", {"input_ids": [5] * 100, "sampling_params": {
            "max_new_tokens": 200, "ignore_eos": True}}, {"X-Session-ID": "busy"}))
        while gw.lifecycle.registry.get("busy") is None:
            await asyncio.sleep(0)
        async with http.post(kv + "/close_session", json={"session_id": "busy"}) as r:
            assert r.status == 200
        st, body, _ = await gen
        done_at = time.monotonic()
        await w1.wait_for("busy")
        closed_at = time.monotonic()
    assert st == 200 and len(orjson.loads(body)["output_ids"]) == 200
    assert closed_at >= done_at  # the close went out only after the turn finished
    assert w1.ids == ["busy"]


async def test_idle_close_fires(sim_factory, router_factory, kvgate_factory):
    e1 = await sim_factory(max_total_num_tokens=50_000, speed=50)
    w1 = CloseWatcher(e1)
    router = await router_factory([e1.url])
    gw, kv = await kvgate_factory(upstream=router, agentic_session_lifecycle=True, session_idle_close_s=0.3)
    async with aiohttp.ClientSession() as http:
        st, _, _ = await _post(http, kv + "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}},
                               {"X-Session-ID": "idle-1"})
        assert st == 200
        finished = time.monotonic()
        await w1.wait_for("idle-1", timeout=60)
        waited = time.monotonic() - finished
    assert waited >= 0.3  # not before the idle threshold (how late the sweep runs on a busy machine is not asserted)
    s = gw.lifecycle.registry.get("idle-1")
    assert s.close_reason == "idle"
    assert 'agentic_kv_session_close_total{reason="idle"} 1.0' in gw.metrics.render()[0].decode()


async def test_discovery_from_smg_workers(sim_factory, router_factory, kvgate_factory):
    e1 = await sim_factory(max_total_num_tokens=10_000, speed=50)
    e2 = await sim_factory(max_total_num_tokens=10_000, speed=50)
    router = await router_factory([e1.url, e2.url])
    gw, kv = await kvgate_factory(upstream=router, agentic_session_lifecycle=True, compat_probe=True)
    await gw.directory.first_refresh.wait()
    assert sorted(gw.directory.urls) == sorted([e1.url, e2.url])
    await asyncio.wait_for(gw.directory.compat_checked.wait(), 20)
    # smg 1.13.0 forwards session_id on every generate route (see the first test); the probe must say so.
    assert gw.directory.verdicts == {"/generate": "forwarded", "/v1/chat/completions": "forwarded",
                                     "/v1/completions": "forwarded"}
    m = gw.metrics.render()[0].decode()
    assert 'agentic_kv_router_session_id_passthrough{route="/generate",verdict="forwarded"} 1.0' in m
    assert 'agentic_kv_router_session_id_passthrough{route="/v1/completions",verdict="forwarded"} 1.0' in m
    assert 'agentic_kv_engines{worker_type="regular"} 2.0' in m
    # The probes tag nothing and generate nothing: the engine rejects each (its session_id is not a string)
    # before it runs anything.
    totals = [e.stats()["totals"] for e in (e1, e2)]
    assert sum(t["generation_tokens"] for t in totals) == 0 and sum(t["num_requests"] for t in totals) == 0
    assert e1.stats()["sessions"] == e2.stats()["sessions"] == {}
    # The router restarts (new worker registrations, same URLs): kvgate probes again.
    probes = gw.directory.probes
    gw.directory._note_workers({"workers": [{"id": "restarted-1", "url": e1.url}, {"id": "restarted-2", "url": e2.url}]})
    while gw.directory.probes == probes:
        await asyncio.wait_for(gw.directory.probed.wait(), 20)
    assert gw.directory.verdicts["/generate"] == "forwarded"


async def test_legacy_sglang_router_drops_session_id_and_kvgate_says_so(sim_factory, router_factory,
                                                                         kvgate_factory, caplog):
    e1 = await sim_factory(max_total_num_tokens=10_000, speed=50)
    router = await router_factory([e1.url], legacy=True)
    caplog.set_level("INFO", logger="kvgate.fleet.directory")
    gw, kv = await kvgate_factory(upstream=router, agentic_session_lifecycle=True, compat_probe=True,
                                  session_placement="router")
    await asyncio.wait_for(gw.directory.compat_checked.wait(), 30)
    assert gw.directory.verdict == "dropped"
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("compat: router")]
    assert len(lines) == 1 and "/generate dropped (via the router)" in lines[0]
    assert caplog.records[[r.getMessage() for r in caplog.records].index(lines[0])].levelname == "WARNING"
    async with aiohttp.ClientSession() as http:
        st, _, _ = await _post(http, kv + "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}},
                               {"X-Session-ID": "lost"})
    assert st == 200
    assert e1.stats()["sessions"] == {}  # what the probe predicted: the engine never saw it
    assert ('agentic_kv_router_session_id_passthrough{route="/generate",verdict="dropped"} 1.0'
            in gw.metrics.render()[0].decode())


async def test_router_down_then_discovery_keeps_last_good_list(sim_factory, kvgate_factory, log_dir):
    from kvgate.tools import procs
    e1 = await sim_factory(max_total_num_tokens=10_000, speed=50)
    port, mport = free_port(), free_port()
    p = procs.start("smg-down", procs.smg_command(port, [e1.url], mport), log_dir, url=f"http://127.0.0.1:{port}")
    try:
        await asyncio.to_thread(procs.wait_http, p.url + "/readiness", 60, p, procs.router_ready(1))
        gw, kv = await kvgate_factory(upstream=p.url, discovery_interval_s=0.1)
        await gw.directory.first_refresh.wait()
        assert gw.directory.urls == [e1.url]
    finally:
        p.stop()
    before = gw.directory.metrics.discovery_failures._value.get()
    while gw.directory.last_error is None:
        await asyncio.wait_for(gw.directory.refreshed.wait(), 10)
    assert gw.directory.urls == [e1.url]  # the last good list is kept
    assert gw.directory.metrics.discovery_failures._value.get() > before
    async with aiohttp.ClientSession() as http:
        async with http.post(kv + "/generate", json={"input_ids": [1]}) as r:
            assert r.status == 502
            assert (await r.json())["error"]["upstream"] == p.url


async def test_client_disconnect_aborts_the_engine_request_through_smg(sim_factory, router_factory, kvgate_factory):
    e1 = await sim_factory(max_total_num_tokens=50_000, speed=1)
    router = await router_factory([e1.url])
    gw, kv = await kvgate_factory(upstream=router, agentic_session_lifecycle=True)
    http = aiohttp.ClientSession()
    resp = await http.post(kv + "/generate", json={"input_ids": [7] * 50, "stream": True, "sampling_params": {
        "max_new_tokens": 5000, "ignore_eos": True}}, headers={"X-Session-ID": "gone"})
    first = await resp.content.readuntil(b"\n\n")  # decoding has started on the engine
    assert first.startswith(b"data: {")
    resp.close()
    await http.close()
    async def aborted():
        while e1.stats()["totals"]["aborted"] < 1:
            await asyncio.sleep(0.02)
    await asyncio.wait_for(aborted(), 60)
    st = e1.stats()["totals"]
    assert st["running"] == 0 and st["generation_tokens"] < 5000  # stopped early, KV no longer decoding
    while gw.lifecycle.registry.get("gone").in_flight:
        await asyncio.sleep(0.02)
    assert "agentic_kv_inflight_requests 0.0" in gw.metrics.render()[0].decode()


async def test_smg_dp_aware_workers_collapse_to_one_engine(sim_factory, router_factory, kvgate_factory):
    e1 = await sim_factory(max_total_num_tokens=10_000, speed=50, dp_size=2)
    w1 = CloseWatcher(e1)
    router = await router_factory([e1.url], extra=["--dp-aware"], wait_healthy=2)
    async with aiohttp.ClientSession() as http:
        async with http.get(router + "/workers") as r:
            listed = sorted(w["url"] for w in (await r.json())["workers"])
    assert listed == [e1.url + "@0", e1.url + "@1"]  # what smg --dp-aware really lists
    gw, kv = await kvgate_factory(upstream=router, agentic_session_lifecycle=True)
    await gw.directory.first_refresh.wait()
    assert gw.directory.urls == [e1.url]
    async with aiohttp.ClientSession() as http:
        async with http.post(kv + "/kvgate/sessions/dp-s/close", params={"wait": "1"}) as r:
            view = await r.json()
    assert view["close_results"] == {e1.url: "ok"}
    assert w1.ids == ["dp-s"]  # one call; the engine broadcasts to its DP ranks itself


async def test_engine_warnings_from_server_info_and_metrics(sim_factory, router_factory, kvgate_factory):
    e_off = await sim_factory(max_total_num_tokens=10_000, speed=50, enable_session_radix_cache=False,
                              disable_metrics=True)
    e_ok = await sim_factory(max_total_num_tokens=10_000, speed=50)
    router = await router_factory([e_off.url, e_ok.url])
    gw, kv = await kvgate_factory(upstream=router, agentic_session_lifecycle=True, compat_probe=True)
    await asyncio.wait_for(gw.directory.compat_checked.wait(), 20)
    assert sorted(k for k, _ in gw.directory.warnings[e_off.url]) == ["metrics_404", "session_radix_cache_off"]
    assert gw.directory.warnings[e_ok.url] == []
    m = gw.metrics.render()[0].decode()
    assert f'agentic_kv_engine_warning{{engine="{e_off.url}",kind="session_radix_cache_off"}} 1.0' in m
    async with aiohttp.ClientSession() as http:
        async with http.get(kv + "/kvgate/engines") as r:
            view = {e["url"]: e for e in (await r.json())["engines"]}
    assert view[e_off.url]["warnings"] == ["session_radix_cache_off", "metrics_404"]
