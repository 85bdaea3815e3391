"""The simulated engine's HTTP surface follows SGLang where kvgate's results depend on it: sampling seeds, DP rank
pinning, OpenAI defaults and stream usage, per-session KV state and HiCache counters, smg's HTTP/2 probe.
Real sockets; a subprocess engine where the check must come from outside the process."""

import asyncio
import sys

import aiohttp
import orjson
import pytest

from kvgate.sim.tokenizer import encode, render_chat
from kvgate.tools import procs


async def post(url, body):
    async with aiohttp.ClientSession() as cs:
        async with cs.post(url, json=body) as r:
            return r.status, await r.read()


def sse(raw: bytes) -> list:
    out = []
    for block in raw.split(b"\n\n"):
        if block.startswith(b"data: ") and block != b"data: [DONE]":
            out.append(orjson.loads(block[6:]))
    return out


@pytest.fixture
async def engine_proc(log_dir):
    """A ``kvgate sim-engine`` subprocess (own process group) -> (url, Proc)."""
    started = []

    async def start(*flags):
        port = procs.free_port()
        url = f"http://127.0.0.1:{port}"
        p = procs.start(f"engine{len(started)}", [sys.executable, "-m", "kvgate", "sim-engine", "--port",
                                                  str(port), "--speed", "1000", *flags], log_dir, url=url)
        started.append(p)
        await asyncio.to_thread(procs.wait_http, url + "/health", 30, p)
        return url, p

    yield start
    for p in started:
        p.stop()


async def test_siblings_sample_different_outputs_by_seed_from_outside_the_process(engine_proc):
    """sampling_params.py: temperature defaults to 1.0; sampler.py seeds a request's draw with sampling_seed."""
    url, _ = await engine_proc()
    prompt = list(range(500, 700))

    async def gen(**sp):
        st, raw = await post(url + "/generate", {"input_ids": prompt,
                                                 "sampling_params": {"max_new_tokens": 32, **sp}})
        assert st == 200
        return orjson.loads(raw)["output_ids"]

    s1, s2, s1_again = await gen(temperature=1.0, sampling_seed=1), await gen(temperature=1.0, sampling_seed=2), \
        await gen(temperature=1.0, sampling_seed=1)
    assert s1 == s1_again and s1 != s2
    g1, g2 = await gen(temperature=0), await gen(temperature=0, sampling_seed=9)
    assert g1 == g2 and g1 not in (s1, s2)
    u1, u2 = await gen(), await gen()            # default temperature 1.0, no seed: random draws
    assert len({tuple(x) for x in (u1, u2, g1)}) == 3
    # OpenAI routes take `seed`
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 16, "temperature": 1.0}
    outs = [orjson.loads((await post(url + "/v1/chat/completions", dict(body, seed=s)))[1])
            ["choices"][0]["message"]["content"] for s in (3, 3, 4)]
    assert outs[0] == outs[1] != outs[2]


async def test_routed_dp_rank_pins_a_sessions_turns_to_one_rank(sim_factory):
    """io_struct.py GenerateReqInput.routed_dp_rank (alias data_parallel_rank): the DP controller sends the
    request to that rank instead of round-robin; a session's turns then share one rank's radix cache."""
    sim = await sim_factory(dp_size=2, max_total_num_tokens=10_000, speed=1000.0)
    prompt = list(range(100, 400))
    ranks, cached = [], []
    for turn in range(4):
        key = "routed_dp_rank" if turn % 2 else "data_parallel_rank"
        st, raw = await post(sim.url + "/generate", {
            "input_ids": prompt, key: 1, "session_id": "S",
            "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
        m = orjson.loads(raw)["meta_info"]
        ranks.append(m["dp_rank"])
        cached.append(m["cached_tokens"])
        prompt = prompt + orjson.loads(raw)["output_ids"] + [7, 7]
    assert ranks == [1, 1, 1, 1] and cached == [0, 303, 309, 315]
    st = sim.stats()
    assert [r["num_requests"] for r in st["ranks"]] == [0, 4]
    # without it the controller round-robins
    for _ in range(2):
        await post(sim.url + "/generate", {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}})
    assert [r["num_requests"] for r in sim.stats()["ranks"]] == [1, 5]
    st, raw = await post(sim.url + "/generate", {"input_ids": [1, 2], "routed_dp_rank": 2})
    assert st == 400


async def test_chat_without_max_tokens_runs_to_the_context_length(sim_factory):
    """protocol.py ChatCompletionRequest: max_tokens None -> max_new_tokens None -> scheduler.py
    init_req_max_new_tokens clips to the pool (max_total - prompt - 2); /v1/completions defaults to 16."""
    sim = await sim_factory(max_total_num_tokens=1000, speed=1000.0)
    messages = [{"role": "user", "content": "hello"}]
    st, raw = await post(sim.url + "/v1/chat/completions", {"model": "m", "messages": messages})
    out = orjson.loads(raw)
    n_prompt = len(encode(render_chat(messages)))
    assert out["usage"]["completion_tokens"] == 1000 - n_prompt - 2 > 128
    assert out["choices"][0]["finish_reason"] == "length"
    st, raw = await post(sim.url + "/v1/completions", {"model": "m", "prompt": "hello"})
    assert orjson.loads(raw)["usage"]["completion_tokens"] == 16


async def test_stream_include_usage_final_chunk(sim_factory):
    """serving_chat.py / serving_completions.py: with stream_options.include_usage the last chunk before
    [DONE] has choices [] and a usage block (prompt, completion, total tokens; cached tokens)."""
    sim = await sim_factory(max_total_num_tokens=10_000, speed=1000.0)
    messages = [{"role": "user", "content": "hi there"}]
    n_prompt = len(encode(render_chat(messages)))
    for route, body in (("/v1/chat/completions", {"messages": messages}), ("/v1/completions", {"prompt": "abc"})):
        st, raw = await post(sim.url + route, {"model": "m", "max_tokens": 5, "stream": True,
                                               "stream_options": {"include_usage": True}, **body})
        ev = sse(raw)
        assert raw.endswith(b"data: [DONE]\n\n")
        assert all("usage" not in e for e in ev[:-1]) and ev[-1]["choices"] == []
        u = ev[-1]["usage"]
        p = n_prompt if "messages" in body else 3
        assert (u["prompt_tokens"], u["completion_tokens"], u["total_tokens"]) == (p, 5, p + 5)
        assert u["prompt_tokens_details"] == {"cached_tokens": 0}
        assert ev[-1]["object"] == ("chat.completion.chunk" if "messages" in body else "text_completion")
        st, raw = await post(sim.url + route, {"model": "m", "max_tokens": 5, "stream": True, **body})
        assert all("usage" not in e for e in sse(raw))


async def test_sim_stats_reports_each_sessions_cache_references_and_tombstone(sim_factory):
    sim = await sim_factory(max_total_num_tokens=10_000, speed=1000.0)
    body = {"input_ids": list(range(100, 150)), "session_id": "S",
            "sampling_params": {"max_new_tokens": 5, "ignore_eos": True}}
    await post(sim.url + "/generate", body)
    assert sim.stats()["session_state"] == {"S": {"ref_tokens": 54, "closed": False}}
    await post(sim.url + "/close_session", {"session_id": "S"})
    assert sim.stats()["session_state"] == {"S": {"ref_tokens": 0, "closed": True}}
    await post(sim.url + "/generate", body)      # a new request re-opens the id (session_ref_tracker.py)
    async with aiohttp.ClientSession() as cs:
        async with cs.get(sim.url + "/sim/stats") as r:
            st = await r.json()
    assert st["session_state"] == {"S": {"ref_tokens": 54, "closed": False}}


async def test_hicache_host_hits_in_stats_and_metrics(sim_factory):
    sim = await sim_factory(max_total_num_tokens=1000, speed=1000.0, enable_hierarchical_cache=True,
                            hicache_ratio=2.0)
    first = {"input_ids": list(range(100, 700)), "sampling_params": {"max_new_tokens": 1}}
    await post(sim.url + "/generate", first)
    await post(sim.url + "/generate", {"input_ids": list(range(5000, 5900)), "sampling_params": {"max_new_tokens": 1}})
    st, raw = await post(sim.url + "/generate", first)
    assert orjson.loads(raw)["meta_info"]["cached_tokens"] == 599
    t = sim.stats()["totals"]
    assert (t["host_hit_tokens"], t["load_back_tokens"], t["hicache_host_total_tokens"]) == (599, 599, 2000)
    assert t["hicache_backup_tokens"] == 600 + 900
    # the default profile (Llama-3-8B): 128 KiB of KV per token, at 50 GB/s
    assert t["load_back_seconds"] == pytest.approx(599 * 131072 / 50e9)
    assert t["hicache_backup_seconds"] == pytest.approx(1500 * 131072 / 50e9)
    async with aiohttp.ClientSession() as cs:
        async with cs.get(sim.url + "/metrics") as r:
            text = await r.text()
    assert 'sglang:load_back_tokens_total{engine_type="unified",model_name="kvgate-sim",moe_ep_rank="0",' \
           'pool="kv",pp_rank="0",tp_rank="0"} 599' in text
    assert "sglang:hicache_host_total_tokens{" in text and "} 2000" in text
    plain = await sim_factory(max_total_num_tokens=1000)
    async with aiohttp.ClientSession() as cs:
        async with cs.get(plain.url + "/metrics") as r:
            assert "hicache" not in await r.text()


async def test_smg_registering_a_sim_engine_leaves_no_traceback_in_its_log(engine_proc, router_factory):
    """smg probes a new worker with an HTTP/2 prior-knowledge preface (PRI * HTTP/2.0); the engine answers it
    400 (HTTP/1.1 only) without logging aiohttp's BadHttpMessage traceback."""
    url, proc = await engine_proc()
    router = await router_factory([url])
    st, raw = await post(router + "/generate", {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}})
    assert st == 200
    log = proc.log_path.read_text()
    assert "Traceback" not in log and "BadHttpMessage" not in log and "PRI/Upgrade" not in log


async def test_usage_counts_the_prompt_once_for_n_choices(sim_factory):
    """usage_processor.py: with n choices the prompt (and its cached tokens) counts once, completions n times."""
    sim = await sim_factory(max_total_num_tokens=10_000, speed=1000.0)
    st, raw = await post(sim.url + "/v1/completions", {"model": "m", "prompt": "abcd", "max_tokens": 3, "n": 3})
    u = orjson.loads(raw)["usage"]
    assert (u["prompt_tokens"], u["completion_tokens"], u["total_tokens"]) == (4, 9, 13)
    assert len(orjson.loads(raw)["choices"]) == 3
