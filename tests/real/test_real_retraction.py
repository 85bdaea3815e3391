"""A retraction on a real engine is counted where kvgate reports it: the session's record, kvgate's
agentic_kv_session_retractions_total, and the engine's own sglang:num_retracted_requests_total (the dashboard's
"Retracted requests per second" panel) all say the same number.

How a retraction is made to happen, with no race (SGLang 0.5.23 schedule_policy.py PrefillAdder): a request is
admitted when its prompt plus min(max_new_tokens, CLIP_MAX_NEW_TOKENS) fit beside what the running ones still
reserve. The test's engine runs with SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION=100, so six calls of 300 + 400 tokens
reserve 6 x 400 = 2,400 of the 4,000 slots and are all admitted at once, whenever each arrives; six contexts of
700 need 4,200 slots, so the engine must retract one before they end. (With the default clip of 4,096 each
reserves 700: five fill 3,500, the sixth is refused and waits for one of them to finish, unless it arrives while
the five have generated under ~200 tokens each - a race a busy machine lost.)"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from kvgate.tools.sglang_engine import EngineSpec

from .helpers import engine_metrics, ids, post

PROMPT, NEW = 300, 400
#: The engine's SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION: what a new request reserves for its output, tokens.
CLIP = 100


def _body(seed: int) -> dict:
    # no ignore_eos (else the whole max_new_tokens is reserved and nothing is ever retracted); min_new_tokens
    # keeps an early EOS of the random weights from ending a call before the pool fills
    return {"input_ids": ids(PROMPT, seed), "sampling_params": {"max_new_tokens": NEW, "min_new_tokens": NEW,
                                                                "temperature": 0}}


@pytest.mark.exclusive_engines
async def test_retraction_counted_by_kvgate_as_by_the_engine(real_fleet, kvgate_factory):
    spec = EngineSpec(max_total_tokens=4000, env={"SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION": str(CLIP)})
    with real_fleet.exclusive([spec], "retraction") as (engine,):
        e0 = engine.url
        gw, kv = await kvgate_factory(upstream=e0, engines=[e0], agentic_session_lifecycle=True,
                                      session_placement="kvgate")
        async with aiohttp.ClientSession() as http:
            before = (await engine_metrics(http, e0)).get("sglang:num_retracted_requests_total", 0)
            answers = await asyncio.gather(*(post(http, kv + "/generate", _body(40 + i), {"X-Session-ID": f"r{i}"})
                                             for i in range(6)))
            after = (await engine_metrics(http, e0)).get("sglang:num_retracted_requests_total", 0)
    assert [st for st, _, _ in answers] == [200] * 6
    assert [a["meta_info"]["completion_tokens"] for _, a, _ in answers] == [NEW] * 6  # retracted calls finish
    by_answer = sum(a["meta_info"]["num_retractions"] for _, a, _ in answers)
    assert by_answer >= 1
    assert after - before == by_answer
    reg = gw.lifecycle.registry
    assert sum(reg.get(f"r{i}").retractions for i in range(6)) == by_answer
    assert f"agentic_kv_session_retractions_total {float(by_answer)}" in gw.metrics.render()[0].decode()
