"""Parallel sampling (``sampling_params.n``, OpenAI ``n``) in the simulator: a request expands to prompts x n
sequences, and one that expands to more sequences than its KV pools hold tokens is refused with a 400 before anything
per sequence is built, so a huge n is answered at once instead of exhausting memory (docs/simulator.md). Real sockets
on 127.0.0.1; the huge-n case runs a ``kvgate sim-engine`` subprocess under an address-space limit."""

import asyncio
import sys
import time

import aiohttp
import orjson

from kvgate.tools import procs


async def post(url, body):
    async with aiohttp.ClientSession() as cs:
        async with cs.post(url, json=body) as r:
            return r.status, await r.read()


def requests_seen(sim) -> int:
    return sum(r["num_requests"] + r["running"] + r["waiting"] for r in sim.stats()["ranks"])


async def test_n_beyond_what_runs_at_once_is_served_and_beyond_the_kv_pool_refused(sim_factory):
    sim = await sim_factory(max_total_num_tokens=300, speed=1000.0, max_running_requests=4, dp_size=2)
    prompt = list(range(100, 140))
    # 12 sequences: more than the 4 x 2 that run at once (the rest wait for a later batch), all served
    st, raw = await post(sim.url + "/generate", {"input_ids": prompt, "rid": "r",
                                                 "sampling_params": {"n": 12, "max_new_tokens": 5}})
    assert st == 200
    outs = orjson.loads(raw)
    assert len(outs) == 12
    assert sorted(o["meta_info"]["id"] for o in outs) == sorted(f"r_{j}" for j in range(12))
    assert [o["meta_info"]["completion_tokens"] for o in outs] == [5] * 12
    assert requests_seen(sim) == 12

    # the KV pools hold 300 x 2 = 600 tokens: 601 sequences, and 2 prompts x n=301 = 602, are refused and
    # nothing reaches the engine
    for body, total, n in (({"input_ids": prompt, "sampling_params": {"n": 601}}, 601, 601),
                           ({"text": ["a b", "c d"], "sampling_params": {"n": 301}}, 602, 301)):
        st, raw = await post(sim.url + "/generate", body)
        assert st == 400
        msg = orjson.loads(raw)["error"]["message"]
        assert f"expands to {total} sequences" in msg and f"n={n}" in msg and "the 600 tokens" in msg
    st, raw = await post(sim.url + "/v1/completions", {"model": "m", "prompt": "a b", "n": 601, "max_tokens": 2})
    assert st == 400
    assert "expands to 601 sequences" in orjson.loads(raw)["error"]["message"]
    assert requests_seen(sim) == 12

    # io_struct.py: every sampling_params of a batch must ask for the same n; a non-integer n is a bad request
    st, raw = await post(sim.url + "/generate", {"text": ["a", "b"], "sampling_params": [{"n": 2}, {"n": 3}]})
    assert (st, orjson.loads(raw)["error"]["message"]) == (
        400, "The parallel_sample_num should be the same for all samples in sample params.")
    st, _ = await post(sim.url + "/generate", {"text": "a", "sampling_params": {"n": "2"}})
    assert st == 400
    # n below 2 is one sample (GenerateReqInput only expands when n > 1)
    st, raw = await post(sim.url + "/generate", {"text": "a", "sampling_params": {"n": 0, "max_new_tokens": 3}})
    assert st == 200 and orjson.loads(raw)["meta_info"]["completion_tokens"] == 3
    assert requests_seen(sim) == 13


async def test_a_huge_n_is_refused_at_once_without_growing_the_process(log_dir):
    """The reported case: n = 10^9 on one prompt. The engine runs under a 1.5 GB address-space limit, so an
    implementation that builds per-sequence state fails (a MemoryError, a 500) instead of taking the machine."""
    port = procs.free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = ["bash", "-c", 'ulimit -v 1500000 && exec "$0" "$@"', sys.executable, "-m", "kvgate", "sim-engine",
           "--port", str(port), "--speed", "1000"]
    p = procs.start("engine", cmd, log_dir, url=url)
    try:
        await asyncio.to_thread(procs.wait_http, url + "/health", 30, p)
        t0 = time.monotonic()
        st, raw = await asyncio.wait_for(post(url + "/generate", {"text": "hello world",
                                                                 "sampling_params": {"n": 1_000_000_000}}), 30)
        took = time.monotonic() - t0
        assert st == 400, raw[:300]
        assert "expands to 1000000000 sequences" in orjson.loads(raw)["error"]["message"]
        assert took < 2.0
        rss_kb = int(next(line.split()[1] for line in open(f"/proc/{p.popen.pid}/status")
                          if line.startswith("VmRSS:")))
        assert rss_kb < 400_000
        # and the engine still serves
        st, raw = await post(url + "/generate", {"text": "hello world", "sampling_params": {"max_new_tokens": 4}})
        assert st == 200 and orjson.loads(raw)["meta_info"]["completion_tokens"] == 4
        stats = orjson.loads((await asyncio.to_thread(procs.wait_http, url + "/sim/stats", 5, p)))
        assert sum(r["num_requests"] for r in stats["ranks"]) == 1
    finally:
        p.stop(grace_s=2.0)
