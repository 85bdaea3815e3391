"""Sessions without client ids (issue 5), on real sockets: kvgate infers them, ends them, and respects steps."""

import asyncio

import aiohttp
import orjson
from aiohttp import web

from conftest import CloseWatcher


async def _complete(http, kv, prompt: str, max_tokens: int = 24):
    async with http.post(kv + "/v1/completions", json={"model": "kvgate-sim", "prompt": prompt,
                                                      "max_tokens": max_tokens, "ignore_eos": True}) as r:
        assert r.status == 200
        return (await r.json())["choices"][0]["text"]


async def test_inferred_sessions_reach_the_engine_and_siblings_stay_apart(sim_factory, router_factory,
                                                                        kvgate_factory):
    e1 = await sim_factory(max_total_num_tokens=200_000, speed=50)
    router = await router_factory([e1.url])
    gw, kv = await kvgate_factory(upstream=router, agentic_session_lifecycle=True)
    task = "You are an agent. Fix the failing test in the repository. " * 20  # shared GRPO task prompt
    async with aiohttp.ClientSession() as http:
        # two siblings: same task prompt, different first outputs (different sampling = different rid here)
        prompts = [task + "[sibling A]\n", task + "[sibling B]\n"]
        for turn in range(4):
            outs = await asyncio.gather(*(_complete(http, kv, p) for p in prompts))
            prompts = [p + o + f"\n<observation turn={turn}>ok</observation>\n" for p, o in zip(prompts, outs)]
    sessions = gw.lifecycle.registry.as_json(0.0)["sessions"]
    assert len(sessions) == 2 and all(s["source"] == "inferred" and s["turns"] == 4 for s in sessions)
    assert sorted(e1.stats()["sessions"].values()) == [4, 4]  # smg forwards session_id on /v1/completions
    assert set(e1.stats()["sessions"]) == {s["session_id"] for s in sessions}
    m = gw.metrics.render()[0].decode()
    assert 'agentic_kv_session_inference_total{result="new"} 2.0' in m
    assert 'agentic_kv_session_inference_total{result="decisive"} 6.0' in m
    assert 'agentic_kv_session_id_injected_total{source="inferred"} 8.0' in m


async def test_step_boundary_skips_closing_kv_that_is_gone(sim_factory, router_factory, kvgate_factory):
    e1 = await sim_factory(max_total_num_tokens=50_000, speed=50)
    w1 = CloseWatcher(e1)
    router = await router_factory([e1.url])
    gw, kv = await kvgate_factory(upstream=router, agentic_session_lifecycle=True, session_idle_close_s=0.3)
    async with aiohttp.ClientSession() as http:
        async with http.post(kv + "/generate", json={"input_ids": [1, 2, 3], "sampling_params": {
                "max_new_tokens": 2}}, headers={"X-Session-ID": "before-flush"}) as r:
            assert r.status == 200
        async with http.post(kv + "/flush_cache") as r:  # a step boundary: smg fans it out to the engines
            assert r.status == 200
        async with http.get(kv + "/kvgate/sessions") as r:
            view = await r.json()
        async with http.post(kv + "/generate", json={"input_ids": [4, 5, 6], "sampling_params": {
                "max_new_tokens": 2}}, headers={"X-Session-ID": "after-flush"}) as r:
            assert r.status == 200
        closed = lambda sid: gw.lifecycle.registry.get(sid).state == "closed"  # noqa: E731
        await gw.lifecycle.wait_until(lambda: closed("before-flush") and closed("after-flush"))
    assert view["step"] == {"step": 1, "boundaries": {"/flush_cache": 1}}
    assert w1.ids == ["after-flush"]  # no close went out for KV the flush already freed
    assert gw.lifecycle.registry.get("before-flush").close_results == {}
    m = gw.metrics.render()[0].decode()
    assert 'agentic_kv_session_close_skipped_total{reason="no_kv"} 1.0' in m
    assert "agentic_kv_step 1.0" in m


async def test_only_an_abort_the_client_asked_for_closes_its_session(kvgate_factory, sim_factory):
    e1 = await sim_factory(max_total_num_tokens=10_000, speed=50)
    w1 = CloseWatcher(e1)

    async def aborting_generate(request):
        body = await request.json()
        return web.json_response({"text": "", "output_ids": [], "meta_info": {
            "id": body.get("rid") or "x", "finish_reason": {"type": "abort", "message": "aborted by the engine"},
            "prompt_tokens": len(body["input_ids"]), "completion_tokens": 0, "cached_tokens": 0}})

    async def abort_request(request):
        return web.Response(status=200)

    app = web.Application()
    app.router.add_post("/generate", aborting_generate)
    app.router.add_post("/abort_request", abort_request)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    router = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        # the turns go to the router (its answers are the aborts), not to the engine kvgate would place them on
        gw, kv = await kvgate_factory(upstream=router, agentic_session_lifecycle=True, engines=[e1.url],
                                      session_placement="router")
        async with aiohttp.ClientSession() as http:
            # An abort nobody asked kvgate for (a weight update, an engine fault): a step boundary.
            async with http.post(kv + "/generate", data=orjson.dumps({"input_ids": [1, 2], "rid": "r-1"}),
                                 headers={"X-Session-ID": "doomed"}) as r:
                assert r.status == 200
            assert gw.lifecycle.registry.get("doomed").state == "active"
            # abort_all is fleet-wide (a trainer before a weight update): still not the session's end.
            async with http.post(kv + "/abort_request", json={"abort_all": True}) as r:
                assert r.status == 200
            async with http.post(kv + "/generate", data=orjson.dumps({"input_ids": [1, 2], "rid": "r-2"}),
                                 headers={"X-Session-ID": "doomed"}) as r:
                assert r.status == 200
            assert gw.lifecycle.registry.get("doomed").state == "active"
            # The client aborts its own turn by rid: that ends the session.
            async with http.post(kv + "/abort_request", json={"rid": "r-3"}) as r:
                assert r.status == 200
            async with http.post(kv + "/generate", data=orjson.dumps({"input_ids": [1, 2], "rid": "r-3"}),
                                 headers={"X-Session-ID": "doomed"}) as r:
                assert r.status == 200
        await gw.lifecycle.wait_until(lambda: gw.lifecycle.registry.get("doomed").state == "closed", 5)
        assert w1.ids == ["doomed"]
        s = gw.lifecycle.registry.get("doomed")
        assert s.close_reason == "abort" and s.turns == 3
        m = gw.metrics.render()[0].decode()
        assert 'agentic_kv_session_close_total{reason="abort"} 1.0' in m
        assert 'agentic_kv_session_aborts_total{cause="other"} 2.0' in m
        assert 'agentic_kv_session_aborts_total{cause="client"} 1.0' in m
    finally:
        await runner.cleanup()


async def test_a_refused_call_is_no_turn_of_an_inferred_session(sim_factory, router_factory, kvgate_factory):
    """Behind the real smg, over random conversations of calls the engine answers and calls it refuses (400: a
    bad body): a refused call leaves no session state (registry, inference index, placement) and counts no turn;
    the sessions, their turns and the inference counts are those of the answered calls alone."""
    from hypothesis import HealthCheck, given, settings, strategies as st

    e1, e2 = await sim_factory(max_total_num_tokens=200_000, speed=500), await sim_factory(
        max_total_num_tokens=200_000, speed=500)
    router = await router_factory([e1.url, e2.url])
    gw, kv = await kvgate_factory(upstream=router, agentic_session_lifecycle=True, session_idle_close_s=0)
    loop = asyncio.get_running_loop()
    reg, inf = gw.lifecycle.registry, gw.inference
    examples = [0]

    def counts() -> dict[str, float]:
        out = {}
        for line in gw.metrics.render()[0].decode().splitlines():
            if line.startswith("agentic_kv_session_inference_total{"):
                out[line.split('"')[1]] = float(line.rsplit(" ", 1)[1])
        return out

    async def conversation(http, n: int, calls: list[bool], route: str) -> tuple[int, list[int]]:
        """Call by call (True: a call the engine answers, False: one it refuses); returns the turns answered
        and the statuses."""
        prompt, answered, statuses = f"[task {examples[0]}.{n}] " + "Solve the puzzle step by step. " * 12, 0, []
        for ok in calls:
            if route == "/v1/completions":
                body = {"model": "kvgate-sim", "prompt": prompt, "max_tokens": 8, "ignore_eos": True}
                if not ok:
                    body["max_tokens"] = "many"  # refused: 400 (a validation error)
            else:
                body = {"text": prompt, "sampling_params": {"max_new_tokens": 8, "ignore_eos": True}}
                if not ok:
                    body["sampling_params"]["no_such_param"] = 1  # refused: 400 (an unknown sampling param)
            async with http.post(kv + route, json=body) as r:
                statuses.append(r.status)
                out = await r.json()
            if ok:
                text = out["choices"][0]["text"] if route == "/v1/completions" else out["text"]
                prompt += text + "\nobservation: ok\n"
                answered += 1
        return answered, statuses

    async def run(convs, route):
        before_sessions, before_tracked, before = len(reg), len(inf), counts()
        async with aiohttp.ClientSession() as http:
            results = [await conversation(http, n, calls, route) for n, calls in enumerate(convs)]
        return before_sessions, before_tracked, before, results

    @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
    @given(convs=st.lists(st.lists(st.booleans(), min_size=1, max_size=5), min_size=1, max_size=3),
           route=st.sampled_from(["/generate", "/v1/completions"]))
    def check(convs, route):
        examples[0] += 1
        before_sessions, before_tracked, before, results = asyncio.run_coroutine_threadsafe(
            run(convs, route), loop).result(120)
        for (answered, statuses), calls in zip(results, convs):
            assert statuses == [200 if ok else 400 for ok in calls]
        live = [answered for answered, _ in results if answered]
        assert len(reg) - before_sessions == len(live)  # a conversation refused throughout made no session
        assert len(inf) - before_tracked == len(live)
        mine = [s for s in reg.as_json(0.0, limit=10 ** 6)["sessions"] if s["session_id"] not in seen]
        seen.update(s["session_id"] for s in mine)
        assert sorted(s["turns"] for s in mine) == sorted(live)
        assert all(s["in_flight"] == 0 and s["state"] == "active" for s in mine)
        after = counts()
        delta = {k: after[k] - before.get(k, 0.0) for k in after}
        assert delta["refused"] == sum(calls.count(False) for calls in convs)
        assert delta["new"] == len(live)  # one new session per conversation answered at least once
        assert sum(v for k, v in delta.items() if k not in ("refused", "unsupported")) == sum(live)
        placed = {sid for sid in (s["session_id"] for s in mine)}
        assert placed == {sid for sid in placed if gw.placement.engine_of(sid) is not None}
        assert len(gw.placement) == len(seen)  # no placement left of a session that never had a turn

    seen: set[str] = set()
    await asyncio.to_thread(check)
    m = gw.metrics.render()[0].decode()
    assert f'agentic_kv_sessions{{state="active"}} {float(len(seen))}' in m
