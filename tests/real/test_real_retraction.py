"""A retraction on a real engine is counted where kvgate reports it: the session's record, kvgate's
agentic_kv_session_retractions_total, and the engine's own sglang:num_retracted_requests_total (the dashboard's
"Retracted requests per second" panel) all say the same number.

How a retraction is made to happen (SGLang 0.5.23 schedule_policy.py PrefillAdder): a new request is admitted
when its prompt plus its whole max_new_tokens fit, while the running requests count their remaining tokens times
new_token_ratio (0.7 at first) unless they set ignore_eos. Five calls of 300 + 400 tokens fill 3,500 of the 4,000
slots; a sixth sent while they decode finds 4,000 - 5 x (300 + g + 0.7 x (400 - g)) >= 700 free and is admitted;
six contexts of 700 need 4,200 slots, so when they have grown to ~670 each the engine retracts one."""

from __future__ import annotations

import asyncio

import aiohttp

from .helpers import engine_metrics, get_json, ids, post

PROMPT, NEW = 300, 400


def _body(seed: int) -> dict:
    # no ignore_eos (else the whole max_new_tokens is reserved and nothing is ever retracted); min_new_tokens
    # keeps an early EOS of the random weights from ending a call before the pool fills
    return {"input_ids": ids(PROMPT, seed), "sampling_params": {"max_new_tokens": NEW, "min_new_tokens": NEW,
                                                                "temperature": 0}}


async def test_retraction_counted_by_kvgate_as_by_the_engine(fleet, kvgate_factory):
    e0 = fleet.urls[0]
    gw, kv = await kvgate_factory(upstream=fleet.smg, engines=[e0], agentic_session_lifecycle=True,
                                  session_placement="kvgate")
    async with aiohttp.ClientSession() as http:
        before = (await engine_metrics(http, e0)).get("sglang:num_retracted_requests_total", 0)
        calls = [asyncio.create_task(post(http, kv + "/generate", _body(40 + i), {"X-Session-ID": f"r{i}"}))
                 for i in range(5)]
        while True:  # the engine's own report is the event: five calls decoding
            load = (await get_json(http, e0 + "/v1/loads"))["loads"][0]
            if load["num_running_reqs"] == 5 and load["num_used_tokens"] > 5 * PROMPT:
                break
            assert not any(c.done() for c in calls)
            await asyncio.sleep(0.05)
        calls.append(asyncio.create_task(post(http, kv + "/generate", _body(45), {"X-Session-ID": "r5"})))
        answers = await asyncio.gather(*calls)
        after = (await engine_metrics(http, e0)).get("sglang:num_retracted_requests_total", 0)
    assert [st for st, _, _ in answers] == [200] * 6
    assert [a["meta_info"]["completion_tokens"] for _, a, _ in answers] == [NEW] * 6  # retracted calls finish
    by_answer = sum(a["meta_info"]["num_retractions"] for _, a, _ in answers)
    assert by_answer >= 1
    assert after - before == by_answer
    reg = gw.lifecycle.registry
    assert sum(reg.get(f"r{i}").retractions for i in range(6)) == by_answer
    assert f"agentic_kv_session_retractions_total {float(by_answer)}" in gw.metrics.render()[0].decode()
