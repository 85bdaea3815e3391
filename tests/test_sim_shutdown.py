"""``kvgate sim-engine`` ends promptly on SIGTERM: an in-flight stream is finished with an error event and [DONE],
the connection closes and the process exits, instead of the client hanging until it gives up. Real subprocess in its
own process group on 127.0.0.1 with a free port; the test waits on the first chunk, never on a sleep."""

import asyncio
import os
import signal
import sys
import time

import aiohttp
import orjson
import pytest

from kvgate.sim.http_api import start_sim_engine
from kvgate.sim.scheduler import Request
from kvgate.tools import procs

CLIENT_END_BOUND_S = 3.0   # the stream must end this soon after SIGTERM
EXIT_BOUND_S = 5.0         # and the process must be gone this soon after SIGTERM


async def test_sigterm_ends_an_in_flight_stream_and_the_process(log_dir):
    port = procs.free_port()
    url = f"http://127.0.0.1:{port}"
    # --speed 1 and 100000 output tokens at ~6 ms a decode step: the stream would run for minutes.
    p = procs.start("engine", [sys.executable, "-m", "kvgate", "sim-engine", "--port", str(port), "--speed", "1"],
                    log_dir, url=url)
    try:
        await asyncio.to_thread(procs.wait_http, url + "/health", 30, p)
        body = {"input_ids": list(range(100, 164)), "stream": True,
                "sampling_params": {"max_new_tokens": 100000, "ignore_eos": True}}
        async with aiohttp.ClientSession() as cs:
            async with cs.post(url + "/generate", json=body) as r:
                assert r.status == 200
                first = await asyncio.wait_for(r.content.readuntil(b"\n\n"), 30)
                assert first.startswith(b"data: ")
                assert len(orjson.loads(first[6:])["output_ids"]) >= 1
                t0 = time.monotonic()
                os.killpg(p.popen.pid, signal.SIGTERM)
                try:
                    rest = await asyncio.wait_for(r.content.read(), CLIENT_END_BOUND_S + 2)
                except asyncio.TimeoutError:
                    rest = None
                client_end_s = time.monotonic() - t0
        assert rest is not None, f"the stream was still open {CLIENT_END_BOUND_S + 2} s after SIGTERM"
        assert client_end_s < CLIENT_END_BOUND_S
        blocks = [b for b in rest.split(b"\n\n") if b]
        assert blocks[-1] == b"data: [DONE]"
        err = orjson.loads(blocks[-2][6:])
        assert err["error"]["code"] == 503
        assert "shutting down" in err["error"]["message"]
        rc = await asyncio.to_thread(p.popen.wait, EXIT_BOUND_S)
        exit_s = time.monotonic() - t0
        assert rc == 0
        assert exit_s < EXIT_BOUND_S
    finally:
        p.stop(grace_s=2.0)


async def test_closing_the_engine_answers_a_waiting_request_503_and_refuses_new_ones():
    """The in-process side of the same shutdown: a non-streaming request in flight gets a 503 with the message."""
    sim = await start_sim_engine(speed=1.0)
    submitted = asyncio.Event()
    orig = sim.engine.submit

    def submit(req, dp_rank=None):
        h = orig(req, dp_rank)
        submitted.set()
        return h
    sim.engine.submit = submit
    async with aiohttp.ClientSession() as cs:
        async def call():
            async with cs.post(sim.url + "/generate", json={"input_ids": list(range(100, 164)), "sampling_params": {
                    "max_new_tokens": 100000, "ignore_eos": True}}) as r:
                return r.status, await r.read()
        task = asyncio.create_task(call())
        await asyncio.wait_for(submitted.wait(), 10)
        t0 = time.monotonic()
        await sim.close()
        status, raw = await asyncio.wait_for(task, 5)
        assert time.monotonic() - t0 < 2.0
    assert status == 503
    out = orjson.loads(raw)
    assert out["error"]["message"] == "The server is shutting down."
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert out["meta_info"]["completion_tokens"] == len(out["output_ids"]) < 100000
    from kvgate.sim.sim_engine import EngineStopped
    with pytest.raises(EngineStopped, match="The server is shutting down."):
        sim.engine.submit(Request(rid="late", input_ids=(1, 2, 3), max_new_tokens=1))
