"""Session placement on real sockets: client -> kvgate -> (engine kvgate picks | real router) -> simulated engines.

sglang-router 0.3.2 drops a top-level session_id on /generate and /v1/chat/completions (smg 1.13.0 keeps it);
kvgate's probe finds that per route and, in ``auto`` mode with session lifecycle on, sends those routes' session
calls straight to an engine with session_id in the body. The simulator's GET /sim/stats lists the session ids each
engine saw.
"""

import asyncio

import aiohttp
import orjson
import pytest
from aiohttp import web

from kvgate.tools.procs import free_port


async def _post(http, url, body, headers=None):
    async with http.post(url, data=orjson.dumps(body),
                         headers={"Content-Type": "application/json", **(headers or {})}) as r:
        return r.status, await r.read(), r.headers


def _seen(*engines) -> list[dict]:
    return [e.stats()["sessions"] for e in engines]


def _where(sid: str, *engines) -> list[int]:
    """Per engine: how many requests carrying ``sid`` it saw."""
    return [s.get(sid, 0) for s in _seen(*engines)]


async def _wait(predicate, timeout=20.0):
    async def loop():
        while not predicate():
            await asyncio.sleep(0.02)
    await asyncio.wait_for(loop(), timeout)


def _sse_events(raw: bytes) -> list[dict]:
    return [orjson.loads(e[6:]) for e in raw.split(b"\n\n") if e.startswith(b"data: {")]


async def test_auto_places_every_generate_route_behind_a_router_that_drops_session_id(
        sim_factory, router_factory, kvgate_factory):
    # sglang-router 0.3.2 drops session_id on /generate and chat and forwards it on /v1/completions; with
    # lifecycle on, auto places the sessions of all three routes whatever the probe says
    e1 = await sim_factory(max_total_num_tokens=50_000, speed=50)
    e2 = await sim_factory(max_total_num_tokens=50_000, speed=50)
    router = await router_factory([e1.url, e2.url], legacy=True, policy="manual")
    gw, kv = await kvgate_factory(upstream=router, agentic_session_lifecycle=True, compat_probe=True,
                                  session_inference=False, admission_poll_interval_s=0.2)
    await asyncio.wait_for(gw.directory.compat_checked.wait(), 30)
    assert gw.directory.verdicts == {"/generate": "dropped", "/v1/chat/completions": "dropped",
                                     "/v1/completions": "forwarded"}
    async with aiohttp.ClientSession() as http:
        async with http.get(kv + "/kvgate/health") as r:
            health = await r.json()
        assert health["session_placement"] == {"/generate": "kvgate", "/v1/chat/completions": "kvgate",
                                               "/v1/completions": "kvgate"}
        assert health["session_placement_why"]["/v1/completions"] == "auto: session lifecycle on"
        assert health["session_id_passthrough_by_route"]["/v1/completions"] == "forwarded"
        base_probe = [sum(s.values()) for s in _seen(e1, e2)]
        assert base_probe == [0, 0]  # the probe's session ids never tag anything

        # /generate with input_ids, not streamed: 3 turns, the prompt growing like an agent's
        prompt = list(range(1, 101))
        for turn in range(3):
            st, body, hdr = await _post(http, kv + "/generate", {"input_ids": prompt, "sampling_params": {
                "max_new_tokens": 8, "ignore_eos": True}}, {"X-Session-ID": "gen"})
            assert st == 200 and hdr["X-Kvgate-Session-Id"] == "gen"
            prompt = prompt + orjson.loads(body)["output_ids"] + [200 + turn] * 5
        counts = _where("gen", e1, e2)
        assert sorted(counts) == [0, 3]
        home = (e1, e2)[counts.index(3)]
        # answers equal calling that engine directly (same prompt, greedy decoding)
        greedy = {"max_new_tokens": 8, "ignore_eos": True, "temperature": 0}
        st, direct, _ = await _post(http, home.url + "/generate", {"input_ids": prompt, "sampling_params": greedy})
        st, via, _ = await _post(http, kv + "/generate", {"input_ids": prompt, "sampling_params": greedy},
                                 {"X-Session-ID": "gen"})
        d, v = orjson.loads(direct), orjson.loads(via)
        assert (v["text"], v["output_ids"]) == (d["text"], d["output_ids"])
        assert v["meta_info"]["cached_tokens"] >= len(prompt) - 1  # the session's prefix is on this engine
        assert _where("gen", e1, e2)[counts.index(3)] == 4

        # /generate streamed
        sreq = {"input_ids": list(range(300, 380)), "stream": True,
                "sampling_params": {"max_new_tokens": 6, "ignore_eos": True}}
        for _ in range(2):
            async with http.post(kv + "/generate", json=sreq, headers={"X-Session-ID": "gen-sse"}) as r:
                assert r.headers["Content-Type"].startswith("text/event-stream")
                raw = await r.read()
            assert raw.endswith(b"data: [DONE]\n\n") and len(_sse_events(raw)[-1]["output_ids"]) == 6
        assert sorted(_where("gen-sse", e1, e2)) == [0, 2]

        # /v1/chat/completions streamed
        msgs = [{"role": "user", "content": "solve the task " * 20}]
        for turn in range(3):
            async with http.post(kv + "/v1/chat/completions", json={"model": "kvgate-sim", "messages": msgs,
                                                                     "max_tokens": 5, "stream": True},
                                 headers={"X-Session-ID": "chat"}) as r:
                assert r.status == 200
                raw = await r.read()
            text = "".join(e["choices"][0]["delta"].get("content") or "" for e in _sse_events(raw) if e["choices"])
            msgs = msgs + [{"role": "assistant", "content": text}, {"role": "user", "content": f"obs {turn}"}]
        assert sorted(_where("chat", e1, e2)) == [0, 3]

        # /v1/completions: the router forwards session_id there; kvgate places it all the same
        for turn in range(3):
            st, body, _ = await _post(http, kv + "/v1/completions", {"model": "kvgate-sim", "prompt": "p" * 300,
                                                                     "max_tokens": 3}, {"X-Session-ID": "cmpl"})
            assert st == 200 and orjson.loads(body)["usage"]["completion_tokens"] == 3
        assert sorted(_where("cmpl", e1, e2)) == [0, 3]
        assert gw.placement.engine_of("cmpl") is not None and gw.placement.placed_by("cmpl") == "kvgate"

        # kvgate's views name each placed session's engine
        async with http.get(kv + "/kvgate/sessions") as r:
            sessions = {s["session_id"]: s for s in (await r.json())["sessions"]}
        assert sessions["gen"]["engine"] == {"url": home.url, "dp_rank": None, "placed_by": "kvgate", "moves": 0}
        assert sessions["cmpl"]["engine"]["placed_by"] == "kvgate"
        async with http.get(kv + "/kvgate/engines") as r:
            engines = await r.json()
        assert sum(e["placed_sessions"] for e in engines["engines"]) == 4
        assert sum(e["placements"] for e in engines["engines"]) == 4
        assert engines["placement"]["counts"]["free_kv"] == 4
        m = gw.metrics.render()[0].decode()
    assert 'agentic_kv_router_session_id_passthrough{route="/generate",verdict="dropped"} 1.0' in m
    assert 'agentic_kv_session_placement_active{route="/v1/completions"} 1.0' in m
    assert 'agentic_kv_placement_calls_total{outcome="engine"} 12.0' in m  # 4 + 2 + 3 + 3 placed calls
    assert f'agentic_kv_placed_sessions{{engine="{home.url}"}}' in m


async def test_grpo_siblings_share_an_engine_and_a_killed_engine_moves_its_sessions(sim_factory, router_factory,
                                                                                   kvgate_factory):
    e1 = await sim_factory(max_total_num_tokens=50_000, speed=50)
    e2 = await sim_factory(max_total_num_tokens=50_000, speed=50)
    router = await router_factory([e1.url, e2.url])
    # discovery every 60 s: the refused connection, not the router's health check, is what moves the sessions
    gw, kv = await kvgate_factory(upstream=router, agentic_session_lifecycle=True, session_placement="kvgate",
                                  session_inference=False, discovery_interval_s=60)
    await gw.directory.first_refresh.wait()
    task_a = list(range(1000, 1200))  # one GRPO group's shared task prompt (3 full blocks)
    task_b = list(range(2000, 2200))
    gen = {"sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}
    async with aiohttp.ClientSession() as http:
        for i in range(4):
            for task, group in ((task_a, "a"), (task_b, "b")):
                st, _, _ = await _post(http, kv + "/generate", {"input_ids": task, **gen}, {"X-Session-ID": f"{group}{i}"})
                assert st == 200
        where_a = {tuple(_where(f"a{i}", e1, e2)) for i in range(4)}
        where_b = {tuple(_where(f"b{i}", e1, e2)) for i in range(4)}
        assert len(where_a) == 1 and len(where_b) == 1 and where_a != where_b  # one engine per group, two groups spread
        assert gw.placement.counts["prefix"] == 6 and gw.placement.counts["free_kv"] == 2
        # /v1/completions placed by kvgate too (mode kvgate): one engine, every turn, session_id in the body
        for turn in range(3):
            st, body, _ = await _post(http, kv + "/v1/completions", {"model": "kvgate-sim", "prompt": "q" * (300 + turn),
                                                                     "max_tokens": 2}, {"X-Session-ID": "c1"})
            assert st == 200 and orjson.loads(body)["usage"]["completion_tokens"] == 2
        assert sorted(_where("c1", e1, e2)) == [0, 3]
        # kill a0's engine between turns: its sessions move to the other engine and later turns succeed
        victim_url, _ = gw.placement.engine_of("a0")
        victim, survivor = (e1, e2) if victim_url == e1.url else (e2, e1)
        before = survivor.stats()["totals"]["num_requests"]
        await victim.close()
        for i in range(4):
            st, body, _ = await _post(http, kv + "/generate", {"input_ids": task_a + [7, 7, 7], **gen},
                                      {"X-Session-ID": f"a{i}"})
            assert st == 200 and len(orjson.loads(body)["output_ids"]) == 4
            assert gw.placement.engine_of(f"a{i}") == (survivor.url, None)
        assert survivor.stats()["totals"]["num_requests"] == before + 4
        assert survivor.stats()["sessions"]["a0"] == 1
        assert gw.placement.counts["replaced"] == 4 and gw.placement.counts["unreachable"] == 1
        m = gw.metrics.render()[0].decode()
        assert 'agentic_kv_placement_calls_total{outcome="connect_retry"} 1.0' in m
        # the close fan-out still reaches every engine kvgate knows (the dead one fails, bounded)
        async with http.post(kv + "/kvgate/sessions/a0/close", params={"wait": "1"}) as r:
            view = await r.json()
        assert view["close_results"][survivor.url] == "ok"
        assert gw.placement.engine_of("a0") is None


async def test_dp_engine_keeps_each_session_on_one_rank(sim_factory, router_factory, kvgate_factory):
    e1 = await sim_factory(max_total_num_tokens=20_000, speed=50, dp_size=2)
    router = await router_factory([e1.url])
    gw, kv = await kvgate_factory(upstream=router, agentic_session_lifecycle=True, session_placement="kvgate",
                                  session_inference=False, admission_poll_interval_s=0.1)
    # the ranks are known once the capacity poller has read /v1/loads
    await _wait(lambda: gw.placement.as_json().get(e1.url, {}).get("dp_size") == 2)
    async with aiohttp.ClientSession() as http:
        for turn in range(3):
            for s in range(4):
                st, _, _ = await _post(http, kv + "/generate", {"input_ids": [s + 1] * 80 + [turn], "sampling_params": {
                    "max_new_tokens": 2}}, {"X-Session-ID": f"dp{s}"})
                assert st == 200
    ranks = e1.stats()["ranks"]
    for s in range(4):
        per_rank = [r["sessions"].get(f"dp{s}", 0) for r in ranks]
        assert sorted(per_rank) == [0, 3], per_rank
    assert [sum(1 for s in range(4) if r["sessions"].get(f"dp{s}")) for r in ranks] == [2, 2]  # spread over ranks


class Recorder:
    """A fake engine or router: records each request's bytes and answers fixed bytes."""

    ANSWER = b'{"text":"ok",  "output_ids":[1, 2],"meta_info":{"x":1.50}}'

    def __init__(self, name: str):
        self.name = name
        self.received: list[tuple[str, bytes, dict]] = []
        self.url = ""

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if request.path in ("/workers", "/list_workers", "/v1/loads", "/metrics", "/server_info", "/get_server_info"):
            return web.Response(status=404)
        body = await request.read()
        self.received.append((request.path, body, dict(request.headers)))
        return web.Response(body=self.ANSWER, content_type="application/json", headers={"X-From": self.name})


@pytest.fixture
async def recorders():
    made, runners = [], []

    async def make(name):
        rec = Recorder(name)
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", rec.handle)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        rec.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        made.append(rec)
        runners.append(runner)
        return rec

    yield make
    for r in runners:
        await r.cleanup()


async def test_placed_calls_are_byte_preserving_and_other_traffic_goes_via_the_router(recorders, kvgate_factory):
    router, engine = await recorders("router"), await recorders("engine")
    dead = f"http://127.0.0.1:{free_port()}"
    gw, kv = await kvgate_factory(upstream=router.url, engines=[dead, engine.url], agentic_session_lifecycle=True,
                                  session_placement="kvgate", session_inference=False)
    await gw.directory.first_refresh.wait()
    raw = b'{"input_ids": [1,2, 3],  "sampling_params": {"max_new_tokens": 1.0}}'
    async with aiohttp.ClientSession() as http:
        async with http.post(kv + "/generate", data=raw, headers={"X-Session-ID": "s1",
                                                                   "Content-Type": "application/json"}) as r:
            assert r.status == 200 and r.headers["X-From"] == "engine"
            assert await r.read() == Recorder.ANSWER  # the engine's bytes, unchanged
        # the first engine refused the connection: nothing went out, so the next one got it
        path, body, headers = engine.received[-1]
        assert path == "/generate" and body == b'{"session_id":"s1",' + raw[1:]
        assert "X-SMG-Routing-Key" not in headers
        assert gw.placement.engine_of("s1") == (engine.url, None)
        # not a session: the router, as before
        async with http.post(kv + "/generate", data=raw, headers={"Content-Type": "application/json"}) as r:
            assert r.headers["X-From"] == "router"
        assert router.received[-1][1] == raw
        # a route placement does not serve: the router, with the routing key
        async with http.post(kv + "/v1/responses", json={"input": "x"}, headers={"X-Session-ID": "s1"}) as r:
            assert r.headers["X-From"] == "router"
        assert router.received[-1][2]["X-SMG-Routing-Key"] == "s1"
    # a DP rank pin is injected the same byte-preserving way
    from kvgate.fleet.placement import Target
    from kvgate.proxy.placed import engine_body
    assert engine_body(raw, orjson.loads(raw), Target(engine.url, 1)) == b'{"routed_dp_rank":1,' + raw[1:]
    assert engine_body(raw, {**orjson.loads(raw), "routed_dp_rank": 0}, Target(engine.url, 1)) == raw


async def test_no_usable_engine_falls_back_to_the_router_unchanged(recorders, kvgate_factory):
    router = await recorders("router")
    dead = f"http://127.0.0.1:{free_port()}"
    gw, kv = await kvgate_factory(upstream=router.url, engines=[dead], agentic_session_lifecycle=True,
                                  session_placement="kvgate", session_inference=False)
    await gw.directory.first_refresh.wait()
    async with aiohttp.ClientSession() as http:
        for _ in range(2):
            st, body, hdr = await _post(http, kv + "/generate", {"input_ids": [1]}, {"X-Session-ID": "s"})
            assert st == 200 and hdr["X-From"] == "router"
    assert orjson.loads(router.received[-1][1]) == {"session_id": "s", "input_ids": [1]}
    assert router.received[-1][2]["X-SMG-Routing-Key"] == "s"
    m = gw.metrics.render()[0].decode()
    assert 'agentic_kv_placement_calls_total{outcome="router_fallback"} 2.0' in m
    assert 'agentic_kv_placement_calls_total{outcome="connect_retry"} 1.0' in m  # then kept out for a while


async def test_lifecycle_off_placement_on_sends_the_body_unchanged(recorders, kvgate_factory):
    router, engine = await recorders("router"), await recorders("engine")
    gw, kv = await kvgate_factory(upstream=router.url, engines=[engine.url], session_placement="kvgate")
    await gw.directory.first_refresh.wait()
    raw = b'{"input_ids": [5, 6]}'
    async with aiohttp.ClientSession() as http:
        async with http.post(kv + "/generate", data=raw, headers={"X-Session-ID": "s"}) as r:
            assert r.headers["X-From"] == "engine" and "X-Kvgate-Session-Id" not in r.headers
    # the router got nothing but kvgate's liveness check (a static engine list is not discovered from it)
    assert engine.received[-1][1] == raw and [r[0] for r in router.received] == ["/health"]
    assert gw.lifecycle.registry.get("s") is None


async def test_routing_key_warning_when_the_router_policy_ignores_it(recorders, kvgate_factory, caplog):
    router = await recorders("router")
    caplog.set_level("WARNING", logger="kvgate")
    # the router places session traffic: warned for a policy that spreads a routing key (smg 1.13)
    await kvgate_factory(upstream=router.url, agentic_session_lifecycle=True, router_policy="cache_aware",
                         session_placement="router")
    for policy in ("manual", "consistent_hashing"):  # these keep a routing key on one worker
        await kvgate_factory(upstream=router.url, agentic_session_lifecycle=True, router_policy=policy,
                             session_placement="router")
    # --sticky-sessions keeps a routing key on one worker on any policy
    await kvgate_factory(upstream=router.url, agentic_session_lifecycle=True, router_policy="cache_aware",
                         router_sticky_sessions=True, session_placement="router")
    # kvgate places session traffic itself (auto with lifecycle on, or kvgate): the router's policy does not matter
    await kvgate_factory(upstream=router.url, agentic_session_lifecycle=True, router_policy="cache_aware")
    await kvgate_factory(upstream=router.url, agentic_session_lifecycle=True, router_policy="cache_aware",
                         session_placement="kvgate")
    lines = [r.getMessage() for r in caplog.records if "ignores X-SMG-Routing-Key" in r.getMessage()]
    assert len(lines) == 1 and "'cache_aware'" in lines[0] and "--sticky-sessions" in lines[0]


async def test_router_restart_is_probed_again_and_placed_sessions_ride_through_it(sim_factory, kvgate_factory,
                                                                                log_dir):
    from kvgate.tools import procs
    e1 = await sim_factory(max_total_num_tokens=20_000, speed=50)
    port, mport = free_port(), free_port()
    cmd = procs.legacy_router_command(port, [e1.url], mport)  # sglang-router 0.3.2: drops session_id
    url = f"http://127.0.0.1:{port}"
    p = procs.start("smg-a", cmd, log_dir, url=url)
    try:
        await asyncio.to_thread(procs.wait_http, url + "/readiness", 60, p, procs.router_ready(1))
        gw, kv = await kvgate_factory(upstream=url, agentic_session_lifecycle=True, compat_probe=True,
                                      discovery_interval_s=0.1, session_inference=False)
        await asyncio.wait_for(gw.directory.compat_checked.wait(), 30)
        assert gw.directory.placed("/generate")
    finally:
        p.stop()
    while gw.directory.last_error is None:
        await asyncio.wait_for(gw.directory.refreshed.wait(), 10)
    probes = gw.directory.probes
    async with aiohttp.ClientSession() as http:
        # the router is down: a placed session still reaches its engine; non-session traffic gets the 502
        st, _, _ = await _post(http, kv + "/generate", {"input_ids": [1, 2, 3]}, {"X-Session-ID": "ride"})
        assert st == 200 and e1.stats()["sessions"] == {"ride": 1}
        st, _, _ = await _post(http, kv + "/v1/models", {})
        assert st == 502
    p2 = procs.start("smg-b", cmd, log_dir, url=url)
    try:
        await asyncio.to_thread(procs.wait_http, url + "/readiness", 60, p2, procs.router_ready(1))
        while gw.directory.probes == probes or gw.directory.last_error is not None:
            await asyncio.wait_for(gw.directory.probed.wait(), 30)
        assert gw.directory.verdicts["/generate"] == "dropped"
    finally:
        p2.stop()


async def test_a_closed_session_reopened_goes_back_to_its_engine(sim_factory, router_factory, kvgate_factory):
    # SGLang 0.5.17+ re-opens a closed session id on its next request; placement keeps the closed session's
    # engine as a hint, so the re-opened session goes back where its KV may still be. Prompts under one
    # 64-token block have no prefix key, so only the hint can bring it back; free KV ties (tiny prompts), and
    # by the session-count rule it would go to the other engine.
    e1 = await sim_factory(max_total_num_tokens=50_000, speed=50)
    e2 = await sim_factory(max_total_num_tokens=50_000, speed=50)
    router = await router_factory([e1.url, e2.url])
    gw, kv = await kvgate_factory(upstream=router, agentic_session_lifecycle=True, session_placement="kvgate",
                                  session_inference=False, discovery_interval_s=60, admission_poll_interval_s=0.2)
    await gw.directory.first_refresh.wait()
    gen = {"sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}
    engines = {e1.url: e1, e2.url: e2}
    async with aiohttp.ClientSession() as http:
        prompt = list(range(1, 41))
        st, body, _ = await _post(http, kv + "/generate", {"input_ids": prompt, **gen}, {"X-Session-ID": "r"})
        assert st == 200
        home_url, _ = gw.placement.engine_of("r")
        home = engines[home_url]
        other = e2 if home is e1 else e1
        st, _, _ = await _post(http, kv + "/close_session", {"session_id": "r"})
        assert st == 200
        await _wait(lambda: home.stats()["closes_received"] == 1 and other.stats()["closes_received"] == 1)
        assert home.stats()["session_state"]["r"]["closed"] is True
        # three other sessions: the engine list's first engine (r's) ends with 2, the other with 1
        for sid in ("a", "b", "c"):
            st, _, _ = await _post(http, kv + "/generate", {"input_ids": list(range(100, 130)), **gen},
                                   {"X-Session-ID": sid})
            assert st == 200
        assert gw.placement.sessions_on(home.url) == 2 and gw.placement.sessions_on(other.url) == 1
        # r comes back: re-opened on its engine (the session-count rule would have picked the other one)
        prompt = prompt + orjson.loads(body)["output_ids"] + [7] * 10
        for turn in range(2):
            st, body, _ = await _post(http, kv + "/generate", {"input_ids": prompt, **gen}, {"X-Session-ID": "r"})
            assert st == 200
            prompt = prompt + orjson.loads(body)["output_ids"] + [8] * 4
        assert _where("r", home, other) == [3, 0]
        assert home.stats()["session_state"]["r"]["closed"] is False  # the engine re-opened the id
        assert gw.placement.engine_of("r") == (home.url, None)
        assert gw.placement.counts["reopened"] == 1 and gw.placement.counts["sticky"] == 1
        async with http.get(kv + "/kvgate/engines") as r:
            view = await r.json()
        assert view["placement"]["counts"]["reopened"] == 1 and view["placement"]["reopen_hints"] == 0
        m = gw.metrics.render()[0].decode()
    assert f'agentic_kv_session_placements_total{{engine="{home.url}",reason="reopened"}} 1.0' in m


async def test_placed_calls_carry_the_engine_key_and_skip_the_router_only_with_the_routers_key(
        recorders, kvgate_factory, monkeypatch, tmp_path):
    """With the router's key given to kvgate, a session call is placed only when it carries that key (any other
    goes to the router, which answers it); a placed call and kvgate's close carry the engines' key instead."""
    router, engine = await recorders("router"), await recorders("engine")
    (tmp_path / "engine.key").write_text("engine-key\n")
    monkeypatch.setenv("KVGATE_TEST_ROUTER_KEY", "router-key")
    gw, kv = await kvgate_factory(upstream=router.url, engines=[engine.url], agentic_session_lifecycle=True,
                                  session_inference=False, router_api_key_env="KVGATE_TEST_ROUTER_KEY",
                                  engine_api_key_file=str(tmp_path / "engine.key"))
    await gw.directory.first_refresh.wait()
    body = b'{"input_ids": [1, 2, 3]}'
    async with aiohttp.ClientSession() as http:
        for auth, to in ((None, "router"), ("Bearer wrong", "router"), ("Bearer router-key", "engine")):
            hdr = {"X-Session-ID": "k", **({"Authorization": auth} if auth else {})}
            async with http.post(kv + "/generate", data=body, headers=hdr) as r:
                assert r.headers["X-From"] == to, auth
        async with http.post(kv + "/kvgate/sessions/k/close?wait=1") as r:
            assert (await r.json())["close_results"] == {engine.url: "ok"}
    sent = [h for p, _, h in router.received if p == "/generate"]
    assert [h.get("Authorization") for h in sent] == [None, "Bearer wrong"]  # the client's, as it came
    placed = [h for p, _, h in engine.received if p == "/generate"]
    assert [h["Authorization"] for h in placed] == ["Bearer engine-key"]
    assert [h["Authorization"] for p, _, h in engine.received if p == "/close_session"] == ["Bearer engine-key"]
    assert 'agentic_kv_placement_calls_total{outcome="router_auth"} 2.0' in gw.metrics.render()[0].decode()
