"""HTTP surface of the simulator (in-process aiohttp server on a random port)."""

import argparse
import asyncio

import aiohttp
import orjson
import pytest

from kvgate.sim import args as cli
from kvgate.sim.radix import SessionConfigError
from kvgate.sim.scheduler import TokenModel
from kvgate.sim.http_api import start_sim_engine
from kvgate.sim.tokenizer import decode, encode, render_chat


@pytest.fixture
async def sim():
    h = await start_sim_engine(max_total_num_tokens=2000, speed=1000.0)
    yield h
    await h.close()


async def post(url, body):
    async with aiohttp.ClientSession() as cs:
        async with cs.post(url, json=body) as r:
            return r.status, await r.read()


def sse_events(raw: bytes):
    parts = raw.split(b"\n\n")
    assert parts[-1] == b"" and parts[-2] == b"data: [DONE]"
    out = []
    for p in parts[:-2]:
        assert p.startswith(b"data: ")
        out.append(orjson.loads(p[6:]))
    return out


async def test_generate_meta_info_and_prefix_cache(sim):
    prompt = list(range(100, 200))
    st, raw = await post(sim.url + "/generate", {
        "input_ids": prompt, "session_id": "s-1", "rid": "r1",
        "sampling_params": {"max_new_tokens": 6, "ignore_eos": True, "temperature": 0}})
    assert st == 200
    out = orjson.loads(raw)
    ref = TokenModel().generate(prompt, 6)
    assert out["output_ids"] == ref and out["text"] == decode(ref)
    m = out["meta_info"]
    assert {k: m[k] for k in ("id", "finish_reason", "prompt_tokens", "completion_tokens",
                              "cached_tokens", "num_retractions", "weight_version")} == {
        "id": "r1", "finish_reason": {"type": "length", "length": 6}, "prompt_tokens": 100,
        "completion_tokens": 6, "cached_tokens": 0, "num_retractions": 0,
        "weight_version": "default"}
    assert m["e2e_latency"] >= 0
    st, raw = await post(sim.url + "/generate", {
        "input_ids": prompt, "session_id": "s-1",
        "sampling_params": {"max_new_tokens": 6, "ignore_eos": True, "temperature": 0}})
    m2 = orjson.loads(raw)["meta_info"]
    assert m2["cached_tokens"] == 99 and orjson.loads(raw)["output_ids"] == ref
    s = sim.stats()
    assert s["sessions"] == {"s-1": 2}
    assert s["totals"]["cached_tokens"] == 99 and s["totals"]["prompt_tokens"] == 200
    assert s["totals"]["evictable"] == 105 and s["totals"]["used"] == 0


async def test_stream_matches_non_stream(sim):
    body = {"text": "hello simulated world", "sampling_params": {"max_new_tokens": 5, "temperature": 0}}
    st, raw = await post(sim.url + "/generate", body)
    plain = orjson.loads(raw)
    st2, raw2 = await post(sim.url + "/generate", dict(body, stream=True))
    assert st2 == 200
    ev = sse_events(raw2)
    assert [len(e["output_ids"]) for e in ev] == [1, 2, 3, 4, 5]
    assert [e["meta_info"]["finish_reason"] for e in ev[:-1]] == [None] * 4
    assert ev[-1]["output_ids"] == plain["output_ids"] and ev[-1]["text"] == plain["text"]
    assert ev[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    assert plain["meta_info"]["prompt_tokens"] == len(encode("hello simulated world")) == 21


async def test_batch_generate(sim):
    st, raw = await post(sim.url + "/generate", {
        "input_ids": [[1, 2, 3], [4, 5, 6, 7]], "sampling_params": {"max_new_tokens": 3, "temperature": 0}})
    out = orjson.loads(raw)
    assert st == 200 and len(out) == 2
    assert [o["output_ids"] for o in out] == [TokenModel().generate([1, 2, 3], 3),
                                             TokenModel().generate([4, 5, 6, 7], 3)]
    assert [o["meta_info"]["prompt_tokens"] for o in out] == [3, 4]


async def test_request_errors(sim):
    st, raw = await post(sim.url + "/generate", {
        "text": "x", "session_id": "a", "session_params": {"id": "a"}})
    assert (st, orjson.loads(raw)) == (
        400, {"error": {"message": "session_id and session_params cannot both be set."}})
    st, raw = await post(sim.url + "/generate", {"text": "x", "sampling_params": {"bogus": 1}})
    assert st == 400 and "bogus" in orjson.loads(raw)["error"]["message"]
    st, raw = await post(sim.url + "/generate", {"text": "x", "session_params": {"id": "nope"}})
    assert st == 400 and "session id nope does not exist" in orjson.loads(raw)["error"]["message"]
    st, raw = await post(sim.url + "/generate", {"sampling_params": {}})
    assert st == 400
    assert sim.stats()["totals"]["num_requests"] == 0


async def test_session_id_must_be_a_string_and_openai_routes_ignore_session_params(sim):
    """What SGLang 0.5.23 answers (measured on the CPU engine; kvgate's session_id probe relies on both): a
    non-string session_id is pydantic's 400 on every generate route; the OpenAI routes take session_params with
    session_id (they never pass session_params on) and generate."""
    bodies = {"/generate": {"input_ids": [1], "sampling_params": {"max_new_tokens": 1}},
              "/v1/chat/completions": {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1},
              "/v1/completions": {"model": "m", "prompt": "x", "max_tokens": 1}}
    for route, body in bodies.items():
        st, raw = await post(sim.url + route, {**body, "session_id": 0})
        err = orjson.loads(raw)
        assert st == 400 and err["object"] == "error" and err["code"] == 400, (route, raw)
        assert "'loc': ('body', 'session_id')" in err["message"] and "Input should be a valid string" in err["message"]
    assert sim.stats()["totals"]["num_requests"] == 0
    for route in ("/v1/chat/completions", "/v1/completions"):
        st, raw = await post(sim.url + route, {**bodies[route], "session_id": "s", "session_params": {"id": "s"}})
        assert st == 200 and orjson.loads(raw)["usage"]["completion_tokens"] == 1


async def test_legacy_session_params_rebuild_prompt(sim):
    async with aiohttp.ClientSession() as cs:
        sid = await (await cs.post(sim.url + "/open_session", json={"capacity_of_str_len": 100})).json()
    st, raw = await post(sim.url + "/generate", {
        "input_ids": [5, 6, 7], "session_params": {"id": sid},
        "sampling_params": {"max_new_tokens": 2}})
    first = orjson.loads(raw)
    assert st == 200 and first["meta_info"]["prompt_tokens"] == 3
    st, raw = await post(sim.url + "/generate", {
        "input_ids": [8], "session_params": {"id": sid}, "sampling_params": {"max_new_tokens": 2}})
    second = orjson.loads(raw)
    assert second["meta_info"]["prompt_tokens"] == 3 + 2 + 1
    assert second["meta_info"]["cached_tokens"] == 4  # 3 prompt + first output's KV


async def test_close_session_endpoint(sim):
    async with aiohttp.ClientSession() as cs:
        for method in ("POST", "GET"):
            r = await cs.request(method, sim.url + "/close_session",
                                 **({"json": {"session_id": "zz"}} if method == "POST"
                                    else {"params": {"session_id": "zz"}}))
            assert (r.status, await r.read()) == (200, b"")
        r = await cs.post(sim.url + "/close_session", json={})
        assert r.status == 400
    assert sim.stats()["closes_received"] == 2


async def test_openai_routes(sim):
    st, raw = await post(sim.url + "/v1/chat/completions", {
        "model": "kvgate-sim", "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4, "session_id": "c1", "temperature": 0})
    out = orjson.loads(raw)
    ids = encode(render_chat([{"role": "user", "content": "hi"}]))
    assert out["usage"]["prompt_tokens"] == len(ids) == 26
    assert out["usage"]["completion_tokens"] == 4
    assert out["choices"][0]["message"]["content"] == decode(TokenModel().generate(ids, 4))
    assert out["choices"][0]["finish_reason"] == "length"
    st, raw = await post(sim.url + "/v1/completions", {
        "prompt": "abc", "max_tokens": 3, "stream": True, "temperature": 0,
        "stream_options": {"include_usage": True}})
    ev = sse_events(raw)
    assert "".join(e["choices"][0]["text"] for e in ev if e["choices"]) == \
        decode(TokenModel().generate(encode("abc"), 3))
    assert ev[-1]["usage"]["completion_tokens"] == 3
    assert sim.stats()["sessions"] == {"c1": 1}


async def test_prompt_plus_max_new_over_the_pool_is_clipped_not_aborted():
    """scheduler.py init_req_max_new_tokens: max_new is clipped to the pool on arrival (100 - 90 - 2 = 8), so
    the request finishes with "length" instead of an out-of-memory abort."""
    h = await start_sim_engine(max_total_num_tokens=100, speed=1000.0)
    try:
        st, raw = await post(h.url + "/generate", {
            "input_ids": list(range(10, 100)),
            "sampling_params": {"max_new_tokens": 50, "ignore_eos": True}})
        body = orjson.loads(raw)
        assert st == 200
        assert body["meta_info"]["finish_reason"] == {"type": "length", "length": 8}
        assert body["meta_info"]["completion_tokens"] == 8
        t = h.stats()["totals"]
        assert t["aborted"] == 0 and t["clipped_max_new_tokens"] == 1
    finally:
        await h.close()


async def test_client_disconnect_aborts_and_frees_kv():
    h = await start_sim_engine(max_total_num_tokens=5000, speed=1.0)
    try:
        async with aiohttp.ClientSession() as cs:
            r = await cs.post(h.url + "/generate", json={
                "input_ids": list(range(1, 50)), "stream": True,
                "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}})
            await r.content.readuntil(b"\n\n")      # first token arrived
            assert h.stats()["totals"]["running"] == 1
            r.close()
        async def aborted():  # the engine notices the closed socket when it writes its next token
            while h.stats()["totals"]["aborted"] < 1:
                await asyncio.sleep(0.01)
        await asyncio.wait_for(aborted(), 60)  # a failure bound, not a timing assumption
        t = h.stats()["totals"]
        assert t["aborted"] == 1 and t["running"] == 0 and t["used"] == 0
    finally:
        await h.close()


async def test_abort_request_and_flush(sim):
    async with aiohttp.ClientSession() as cs:
        await cs.post(sim.url + "/generate", json={"input_ids": [1, 2, 3],
                                                   "sampling_params": {"max_new_tokens": 2}})
        assert sim.stats()["totals"]["evictable"] == 4
        r = await cs.post(sim.url + "/flush_cache")
        assert r.status == 200
        assert sim.stats()["totals"]["evictable"] == 0
        r = await cs.post(sim.url + "/abort_request", json={"rid": "nothing"})
        assert r.status == 200
        r = await cs.post(sim.url + "/update_weights_from_disk",
                          json={"model_path": "x", "weight_version": "v2"})
        assert (await r.json())["success"] is True
        out = await (await cs.post(sim.url + "/generate", json={"input_ids": [1]})).json()
        assert out["meta_info"]["weight_version"] == "v2"
        assert out["meta_info"]["completion_tokens"] == 128


async def test_info_endpoints(sim):
    async with aiohttp.ClientSession() as cs:
        for path in ("/health", "/health_generate"):
            r = await cs.get(sim.url + path)
            assert (r.status, await r.read()) == (200, b"")
        info = await (await cs.get(sim.url + "/server_info")).json()
        assert info == await (await cs.get(sim.url + "/get_server_info")).json()
        assert info["max_total_num_tokens"] == 2000 and info["version"] == "0.5.17"
        assert info["model_path"] == "" and info["served_model_name"] == "kvgate-sim" and info["tokenizer_path"] is None
        assert info["enable_session_radix_cache"] is True and info["dp_size"] == 1
        assert len(info["internal_states"]) == 1
        mi = await (await cs.get(sim.url + "/get_model_info")).json()
        assert mi["model_path"] == ""  # empty: smg would fetch a hub tokenizer otherwise
        models = await (await cs.get(sim.url + "/v1/models")).json()
        assert models["data"][0]["id"] == "kvgate-sim"


async def test_0515_semantics_needs_priority_policy():
    with pytest.raises(SessionConfigError):
        await start_sim_engine(session_semantics="0.5.15", radix_eviction_policy="lru")
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    assert cli.run(p.parse_args(["--session-semantics", "0.5.15"])) == 2
    h = await start_sim_engine(session_semantics="0.5.15", radix_eviction_policy="priority",
                               max_total_num_tokens=1000, speed=1000.0)
    try:
        async with aiohttp.ClientSession() as cs:
            info = await (await cs.get(h.url + "/server_info")).json()
            assert info["version"] == "0.5.15"
            await cs.post(h.url + "/generate", json={
                "input_ids": list(range(1, 31)), "session_id": "A",
                "sampling_params": {"max_new_tokens": 5, "ignore_eos": True}})
            before = h.stats()["totals"]["available"]
            r = await cs.post(h.url + "/close_session", json={"session_id": "A"})
            assert r.status == 200
        t = h.stats()["totals"]
        assert t["available"] - before == 34 and t["session_freed_tokens"] == 34
    finally:
        await h.close()


async def test_dp2_round_robin_and_close_broadcast():
    h = await start_sim_engine(max_total_num_tokens=1000, dp_size=2, speed=1000.0)
    try:
        async with aiohttp.ClientSession() as cs:
            ranks = []
            for i in range(4):
                out = await (await cs.post(h.url + "/generate", json={
                    "input_ids": [1, 2, 3, 4, 5, 6], "session_id": "S",
                    "sampling_params": {"max_new_tokens": 2}})).json()
                ranks.append(out["meta_info"]["dp_rank"])
                if i == 2:
                    assert out["meta_info"]["cached_tokens"] == 5  # rank 0 saw it before
            assert ranks == [0, 1, 0, 1]
            pinned = await (await cs.post(h.url + "/generate", json={
                "input_ids": [9, 9], "data_parallel_rank": 1,
                "sampling_params": {"max_new_tokens": 1}})).json()
            assert pinned["meta_info"]["dp_rank"] == 1
            r = await cs.post(h.url + "/close_session", json={"session_id": "S"})
            assert r.status == 200
        st = h.stats()
        assert [rk["closes_received"] for rk in st["ranks"]] == [1, 1]
        assert [rk["sessions"] for rk in st["ranks"]] == [{"S": 2}, {"S": 2}]
        assert [rk["num_requests"] for rk in st["ranks"]] == [2, 3]
        assert st["closes_received"] == 1
    finally:
        await h.close()
