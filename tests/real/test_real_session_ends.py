"""Ends from what clients already send, on real SGLang 0.5.23 engines: a final-turn marker, vLLM router's
/finish_session and a parent's close each close the session on every engine within one close round trip of the
answer (or of the call that ended it). The figure printed is that time next to a bare /close_session round trip."""

from __future__ import annotations

import asyncio
import time

import aiohttp

from .helpers import generate, ids, post

WAIT_S = 60.0


async def _close_rtt(http, urls: list[str]) -> float:
    """One /close_session round trip to every engine at once (an id no engine knows), seconds."""
    t0 = time.perf_counter()
    await asyncio.gather(*(post(http, u + "/close_session", {"session_id": "rtt-probe"}) for u in urls))
    return time.perf_counter() - t0


async def _closed_after(gw, sid: str, t0: float) -> float:
    await gw.lifecycle.settled(sid, WAIT_S)
    s = gw.lifecycle.registry.get(sid)
    assert s.state == "closed" and s.close_results == {u: "ok" for u in gw.directory.urls}, s.as_json(0)
    return time.perf_counter() - t0


async def test_each_end_signal_closes_on_every_engine_within_one_round_trip(fleet, kvgate_factory):
    gw, kv = await kvgate_factory(upstream=fleet.smg, engines=fleet.urls, agentic_session_lifecycle=True,
                                  session_placement="kvgate", session_idle_close_s=0, close_timeout_s=30.0)
    figures = {}
    async with aiohttp.ClientSession() as http:
        rtt = min([await _close_rtt(http, fleet.urls) for _ in range(3)])
        prompt = ids(300, 1)
        await generate(http, kv, prompt, 4, headers={"X-Session-ID": "fin"})
        await generate(http, kv, prompt + ids(50, 2), 4,
                       headers={"x-dynamo-session-id": "fin", "x-dynamo-session-final": "true"})
        t0 = time.perf_counter()  # the answer is in: kvgate closes after it went out
        figures["final marker"] = await _closed_after(gw, "fin", t0)

        await generate(http, kv, ids(300, 3), 4, headers={"X-Session-ID": "vllm-traj"})
        t0 = time.perf_counter()
        async with http.post(kv + "/finish_session", params={"session_id": "vllm-traj"}) as r:
            assert r.status == 200 and await r.json() == {"status": "ok", "session_id": "vllm-traj", "known": True,
                                                          "state": "closing", "engines": len(fleet.urls)}
        figures["/finish_session"] = await _closed_after(gw, "vllm-traj", t0)

        await generate(http, kv, ids(300, 4), 4, headers={"X-Session-ID": "lead"})
        await generate(http, kv, ids(300, 5), 4, headers={"X-Session-ID": "helper",
                                                          "x-dynamo-parent-session-id": "lead"})
        t0 = time.perf_counter()
        st, _, _ = await post(http, kv + "/close_session", {"session_id": "lead"})
        assert st == 200
        figures["parent close"] = await _closed_after(gw, "helper", t0)
    print(f"close round trip to {len(fleet.urls)} engines: {rtt * 1000:.1f} ms; closed on every engine after: "
          + ", ".join(f"{k} {v * 1000:.1f} ms" for k, v in figures.items()))
    assert gw.lifecycle.registry.get("helper").close_reason == "parent"
    for name, took in figures.items():
        # one fan-out of calls in parallel: a round trip, and what a loaded 2-core machine adds to it
        assert took <= 2 * rtt + 0.25, (name, took, rtt)
