"""Session ends from what clients already send, through real sockets: a final-turn marker, vLLM router's
/finish_session, a subagent's session closed with its parent; and session keys from smg's conventions.

client -> kvgate -> simulated SGLang engines (kvgate.sim, 0.5.17 session semantics); kvgate calls each engine's
/close_session directly (CloseWatcher sees each close as an event).
"""

from __future__ import annotations

import aiohttp
import orjson

from conftest import CloseWatcher

SIM = {"max_total_num_tokens": 60_000, "speed": 200}
TURN = {"model": "kvgate-sim", "prompt": "z" * 300, "max_tokens": 4}


async def _post(http, url, body, headers=None):
    async with http.post(url, data=orjson.dumps(body),
                         headers={"Content-Type": "application/json", **(headers or {})}) as r:
        return r.status, await r.read()


async def _fleet(sim_factory, kvgate_factory, **cfg):
    a, b = await sim_factory(**SIM), await sim_factory(**SIM)
    wa, wb = CloseWatcher(a), CloseWatcher(b)
    gw, kv = await kvgate_factory(upstream=a.url, agentic_session_lifecycle=True, engines=[a.url, b.url],
                                  session_idle_close_s=0, **cfg)
    return gw, kv, (wa, wb)


async def test_final_marker_closes_the_session_after_its_answer(sim_factory, kvgate_factory):
    gw, kv, (wa, wb) = await _fleet(sim_factory, kvgate_factory)
    reg = gw.lifecycle.registry
    async with aiohttp.ClientSession() as http:
        st, _ = await _post(http, kv + "/v1/completions", TURN, {"X-Session-ID": "traj-1"})
        assert st == 200 and reg.get("traj-1").state == "active"
        st, body = await _post(http, kv + "/v1/completions", {**TURN, "prompt": TURN["prompt"] + "y" * 50},
                               {"x-dynamo-session-id": "traj-1", "x-dynamo-session-final": "true"})
        assert st == 200 and orjson.loads(body)["choices"]  # the answer went out whole
        await wa.wait_for("traj-1")
        await wb.wait_for("traj-1")
    s = reg.get("traj-1")
    assert s.close_reason == "final" and s.turns == 2
    await gw.lifecycle.wait_until(lambda: reg.get("traj-1").state == "closed")
    assert s.close_results == {u: "ok" for u in gw.directory.urls}


async def test_finish_session_query_and_body_forms_answer_as_vllm_router(sim_factory, kvgate_factory):
    gw, kv, (wa, wb) = await _fleet(sim_factory, kvgate_factory)
    reg = gw.lifecycle.registry
    async with aiohttp.ClientSession() as http:
        for sid in ("r-1", "r-2"):
            assert (await _post(http, kv + "/generate", {"text": "q" * 300, "sampling_params": {"max_new_tokens": 2}},
                                {"X-Session-ID": sid}))[0] == 200
        async with http.post(kv + "/finish_session", params={"session_id": "r-1"}) as r:
            assert r.status == 200 and await r.json() == {"status": "ok", "session_id": "r-1", "known": True,
                                                          "state": "closing", "engines": 2}
        async with http.post(kv + "/finish_session", json={"session_id": "r-2"}) as r:
            assert r.status == 200 and (await r.json())["status"] == "ok"
        async with http.post(kv + "/finish_session", params={"session_id": "r-1"}) as r:  # again: idempotent
            assert r.status == 200
        async with http.post(kv + "/finish_session") as r:
            assert r.status == 400 and (await r.json())["error"]["message"].startswith("session_id is required")
        for w in (wa, wb):
            await w.wait_for("r-1")
            await w.wait_for("r-2")
    assert reg.get("r-1").close_reason == "finish" and reg.get("r-2").close_reason == "finish"


async def test_close_session_answers_what_kvgate_did_for_a_known_an_unknown_and_a_repeated_id(
        sim_factory, kvgate_factory):
    """/close_session of an id kvgate never saw is closed on every engine all the same (as an engine answers any
    id 200: a session kvgate did not route, or routed before a restart) and says so: 200 with known false; a
    known one says known true; a repeated close, once done, says closed. The engines get one call each per close."""
    gw, kv, (wa, wb) = await _fleet(sim_factory, kvgate_factory)
    reg = gw.lifecycle.registry
    async with aiohttp.ClientSession() as http:
        assert (await _post(http, kv + "/v1/completions", TURN, {"X-Session-ID": "seen"}))[0] == 200
        answers = []
        for sid in ("never-seen", "seen"):
            async with http.post(kv + "/close_session", json={"session_id": sid}) as r:
                assert (r.status, r.content_type) == (200, "application/json")
                answers.append(await r.json())
        for w in (wa, wb):
            await w.wait_for("never-seen")
            await w.wait_for("seen")
        await gw.lifecycle.wait_until(lambda: all(reg.get(s).state == "closed" for s in ("never-seen", "seen")))
        async with http.get(kv + "/close_session", params={"session_id": "seen"}) as r:  # again, done: nothing to send
            again = (r.status, await r.json())
    assert answers == [{"session_id": "never-seen", "known": False, "state": "closing", "engines": 2},
                       {"session_id": "seen", "known": True, "state": "closing", "engines": 2}]
    assert again == (200, {"session_id": "seen", "known": True, "state": "closed", "engines": 2})
    assert [wa.ids.count("never-seen"), wb.ids.count("never-seen"), wa.ids.count("seen"), wb.ids.count("seen")] == \
        [1, 1, 1, 1]


async def test_subagent_sessions_are_listed_under_and_closed_with_their_parent(sim_factory, kvgate_factory):
    gw, kv, (wa, wb) = await _fleet(sim_factory, kvgate_factory)
    reg = gw.lifecycle.registry
    async with aiohttp.ClientSession() as http:
        await _post(http, kv + "/v1/completions", TURN, {"X-Session-ID": "parent"})
        for i in range(2):
            await _post(http, kv + "/v1/completions", {**TURN, "prompt": f"sub {i} " * 60},
                        {"x-dynamo-session-id": f"sub-{i}", "x-dynamo-parent-session-id": "parent"})
        async with http.get(kv + "/kvgate/sessions/parent") as r:
            listed = await r.json()
        assert listed["children"] == ["sub-0", "sub-1"]
        async with http.get(kv + "/kvgate/sessions") as r:
            rows = {e["session_id"]: e for e in (await r.json())["sessions"]}
        assert rows["sub-1"]["parent"] == "parent" and rows["parent"]["children"] == ["sub-0", "sub-1"]
        async with http.post(kv + "/close_session", json={"session_id": "parent"}) as r:
            assert r.status == 200
        for w in (wa, wb):
            for sid in ("parent", "sub-0", "sub-1"):
                await w.wait_for(sid)
    assert reg.get("sub-0").close_reason == "parent" and reg.get("parent").close_reason == "client"


async def test_subagent_stays_open_when_closing_children_is_off(sim_factory, kvgate_factory):
    gw, kv, (wa, _) = await _fleet(sim_factory, kvgate_factory, session_close_children=False)
    async with aiohttp.ClientSession() as http:
        await _post(http, kv + "/v1/completions", TURN, {"X-Session-ID": "p"})
        await _post(http, kv + "/v1/completions", {**TURN, "prompt": "c" * 300},
                    {"X-Session-ID": "c", "X-Parent-Session-ID": "p"})
        await _post(http, kv + "/close_session", {"session_id": "p"})
        await wa.wait_for("p")
    assert gw.lifecycle.registry.get("c").state == "active" and "c" not in wa.ids


async def test_smg_routing_key_and_rid_lineage_name_the_session(sim_factory, kvgate_factory):
    gw, kv, _ = await _fleet(sim_factory, kvgate_factory)
    reg = gw.lifecycle.registry
    async with aiohttp.ClientSession() as http:
        for t in (1, 2):
            await _post(http, kv + "/generate", {"text": "a" * 300 + "b" * t, "rid": f"conv_t{t}",
                                                 "sampling_params": {"max_new_tokens": 2}})
        await _post(http, kv + "/generate", {"text": "a" * 300 + "bb", "rid": "conv_t2_r1",
                                             "sampling_params": {"max_new_tokens": 2}})
        for _ in range(2):
            await _post(http, kv + "/v1/completions", TURN, {"X-SMG-Routing-Key": "rk-7"})
    assert (reg.get("conv").turns, reg.get("conv").source) == (3, "rid")
    assert (reg.get("rk-7").turns, reg.get("rk-7").source) == (2, "routing_key")


async def test_with_lifecycle_off_a_close_still_reaches_every_engine(sim_factory, router_factory, kvgate_factory):
    """Session lifecycle off, behind the real smg (which answers /close_session and /finish_session with 404): a
    session the client named in its bodies is closed on every engine all the same, by kvgate."""
    a, b = await sim_factory(**SIM), await sim_factory(**SIM)
    wa, wb = CloseWatcher(a), CloseWatcher(b)
    router = await router_factory([a.url, b.url])
    gw, kv = await kvgate_factory(upstream=router, agentic_session_lifecycle=False)
    await gw.directory.first_refresh.wait()
    assert sorted(gw.directory.urls) == sorted([a.url, b.url])
    async with aiohttp.ClientSession() as http:
        for sid in ("off-1", "off-2"):
            st, _ = await _post(http, kv + "/generate", {"text": "o" * 300, "session_id": sid,
                                                         "sampling_params": {"max_new_tokens": 2}})
            assert st == 200
        async with http.post(router + "/close_session", json={"session_id": "off-1"}) as r:
            assert r.status == 404  # the router alone: what a client got through kvgate before
        async with http.post(kv + "/close_session", json={"session_id": "off-1"}) as r:
            # lifecycle off: kvgate's registry tracks no call, so it did not know the session; closed all the same
            assert r.status == 200 and await r.json() == {"session_id": "off-1", "known": False, "state": "closing",
                                                          "engines": 2}
        async with http.post(kv + "/finish_session", params={"session_id": "off-2"}) as r:
            assert r.status == 200 and await r.json() == {"status": "ok", "session_id": "off-2", "known": False,
                                                          "state": "closing", "engines": 2}
        for w in (wa, wb):
            await w.wait_for("off-1")
            await w.wait_for("off-2")
    reg = gw.lifecycle.registry
    await gw.lifecycle.wait_until(lambda: all(reg.get(s).state == "closed" for s in ("off-1", "off-2")))
    assert [reg.get(s).close_reason for s in ("off-1", "off-2")] == ["client", "finish"]
    assert reg.get("off-1").close_results == {a.url: "ok", b.url: "ok"}
    m = gw.metrics.render()[0].decode()
    assert 'agentic_kv_session_close_total{reason="client"} 1.0' in m
    assert 'agentic_kv_session_close_total{reason="finish"} 1.0' in m
    assert 'agentic_kv_session_close_calls_total{result="ok"} 4.0' in m


async def test_close_and_finish_refuse_a_request_without_a_usable_id_with_one_json_shape(sim_factory,
                                                                                         kvgate_factory):
    """Whatever is wrong with the request (no body, a body that is not JSON or not an object, no id, an id that
    is not a non-empty string, one over max_session_id_bytes; in the query or not), /close_session and
    /finish_session answer the same: 400, application/json, {"error": {"message", "type", "code"}}."""
    import asyncio
    from hypothesis import HealthCheck, given, settings, strategies as st

    gw, kv, (wa, wb) = await _fleet(sim_factory, kvgate_factory, max_session_id_bytes=64)
    loop = asyncio.get_running_loop()
    bodies = st.one_of(
        st.just(None), st.binary(min_size=1, max_size=40).filter(lambda b: _not_json(b)),
        st.sampled_from([b"[]", b"1", b'"s"', b"null", b"{}", b'{"other": "x"}']),
        st.sampled_from([None, 0, 1.5, True, [], {}, "", "x" * 65]).map(lambda v: orjson.dumps({"session_id": v})))
    queries = st.sampled_from([None, "", "x" * 65])

    async def ask(http, path, body, query):
        params = None if query is None else {"session_id": query}
        async with http.post(kv + path, data=body, params=params) as r:
            return r.status, r.headers.get("Content-Type"), await r.read()

    async with aiohttp.ClientSession() as http:
        @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
        @given(body=bodies, query=queries)
        def check(body, query):
            for path in ("/close_session", "/finish_session"):
                status, ctype, raw = asyncio.run_coroutine_threadsafe(ask(http, path, body, query), loop).result(30)
                assert (status, ctype) == (400, "application/json"), (path, body, query, raw)
                err = orjson.loads(raw)["error"]
                assert set(err) == {"message", "type", "code"} and (err["type"], err["code"]) == ("invalid_request", 400)
                assert isinstance(err["message"], str) and "session_id" in err["message"]

        await asyncio.to_thread(check)
    assert wa.ids == [] and wb.ids == []  # nothing was closed


def _not_json(raw: bytes) -> bool:
    try:
        orjson.loads(raw)
    except orjson.JSONDecodeError:
        return True
    return False
