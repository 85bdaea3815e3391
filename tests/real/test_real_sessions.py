"""Session lifecycle on real engines: an open session's cached prompt survives KV pressure, and once kvgate has
closed a session (the client's close, the idle close) its KV is evicted first. Measured by cached_tokens."""

from __future__ import annotations

import asyncio

import aiohttp

from .conftest import POOL
from .helpers import engine_metrics, generate, get_json, ids, post, pressure

PROMPT = 300
# 12 calls of 300 + 150 tokens: 5,400 tokens through a 4,000-token pool, about 8 running at once.
PRESSURE = (12, 300, 150)


async def _closed(kv: str, sid: str, reason: str, timeout_s: float = 60) -> dict:
    """Wait until kvgate's registry shows ``sid`` closed for ``reason`` with every engine's close ok."""
    async with aiohttp.ClientSession() as http:
        async def poll():
            while True:
                s = await get_json(http, f"{kv}/kvgate/sessions/{sid}")
                if s["state"] == "closed" and s["close_reason"] == reason:
                    return s
                await asyncio.sleep(0.1)  # the idle sweep runs on kvgate's clock; its API is what there is to read
        return await asyncio.wait_for(poll(), timeout_s)


async def test_open_session_survives_pressure_closed_sessions_go_first(fleet, kvgate_factory):
    e0, e1 = fleet.urls[0], fleet.urls[-1]  # one engine: both kvgates in front of it
    # Engine 0: sessions kvgate never closes unless the client asks. Engine 1: kvgate closes idle sessions.
    common = dict(upstream=fleet.smg, agentic_session_lifecycle=True, session_placement="kvgate",
                  close_timeout_s=30.0)  # a loaded engine may answer a close slowly; a timeout would be retried
    gw0, kv0 = await kvgate_factory(engines=[e0], session_idle_close_s=0, **common)
    gw1, kv1 = await kvgate_factory(engines=[e1], session_idle_close_s=1.0, **common)
    keep, closed, idle, plain0, plain1 = (ids(PROMPT, s) for s in (11, 12, 13, 14, 15))
    async with aiohttp.ClientSession() as http:
        first = [
            await generate(http, kv0, keep, 4, headers={"X-Session-ID": "keep"}),
            await generate(http, kv0, closed, 4, headers={"X-Session-ID": "client-closed"}),
            await generate(http, e0, plain0, 4),
            await generate(http, kv1, idle, 4, headers={"X-Session-ID": "idle-closed"}),
            await generate(http, e1, plain1, 4),
        ]
        assert [a["meta_info"]["cached_tokens"] for a in first] == [0] * 5
        assert gw0.placement.engine_of("keep")[0] == e0 and gw1.placement.engine_of("idle-closed")[0] == e1
        st, _, _ = await post(http, kv0 + "/close_session", {"session_id": "client-closed"})
        assert st == 200
        c = await _closed(kv0, "client-closed", "client")
        assert c["close_results"] == {e0: "ok"}
        i = await _closed(kv1, "idle-closed", "idle")
        assert i["close_results"] == {e1: "ok"}
        assert (await get_json(http, f"{kv0}/kvgate/sessions/keep"))["state"] == "active"

        evicted = [(await engine_metrics(http, u)).get("sglang:evicted_tokens_total", 0) for u in fleet.urls]
        await asyncio.gather(*(pressure(http, u, *PRESSURE, seed=1000 * (i + 1)) for i, u in enumerate(fleet.urls)))
        after = [(await engine_metrics(http, u)).get("sglang:evicted_tokens_total", 0) for u in fleet.urls]
        assert all(a - b >= PRESSURE[0] * sum(PRESSURE[1:]) - POOL for a, b in zip(after, evicted)), (evicted, after)

        again = {
            "keep": await generate(http, kv0, keep, 1, headers={"X-Session-ID": "keep"}),
            "client-closed": await generate(http, e0, closed, 1),
            "plain0": await generate(http, e0, plain0, 1),
            "idle-closed": await generate(http, e1, idle, 1),
            "plain1": await generate(http, e1, plain1, 1),
        }
    cached = {k: a["meta_info"]["cached_tokens"] for k, a in again.items()}
    # The open session's prompt is all there (SGLang matches at most len - 1 tokens: the last one is recomputed
    # for its logits); what kvgate closed went like KV of no session at all.
    assert cached == {"keep": PROMPT - 1, "client-closed": 0, "plain0": 0, "idle-closed": 0, "plain1": 0}
