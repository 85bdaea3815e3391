"""What the real-engine tests send and read: token ids the tiny model knows, JSON calls, engine metrics."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import aiohttp
import orjson
from prometheus_client.parser import text_string_to_metric_families

from kvgate.tools.sglang_cpu.make_model import VOCAB

#: Seconds a single call may take on a loaded 2-core machine (a pressure batch runs for tens of seconds).
CALL_TIMEOUT_S = 300


def ids(n: int, seed: int) -> list[int]:
    """``n`` token ids from ``seed``, inside the model's vocabulary (ids 3..VOCAB-1; 0-2 are <unk> <s> </s>).
    An id at or past the vocabulary crashes SGLang 0.5.23's scheduler (IndexError in the embedding): the whole
    server exits."""
    rnd = random.Random(seed)
    return [rnd.randrange(3, VOCAB) for _ in range(n)]


async def post(http: aiohttp.ClientSession, url: str, body: dict, headers: dict | None = None
               ) -> tuple[int, Any, Any]:
    """POST ``body`` as JSON; returns (status, the JSON answer or the raw bytes, response headers)."""
    async with http.post(url, data=orjson.dumps(body), headers={"Content-Type": "application/json", **(headers or {})},
                         timeout=aiohttp.ClientTimeout(total=CALL_TIMEOUT_S)) as r:
        raw = await r.read()
        try:
            return r.status, orjson.loads(raw), r.headers
        except orjson.JSONDecodeError:
            return r.status, raw, r.headers


def gen_body(input_ids: list[int], max_new: int, session_id: str | None = None, ignore_eos: bool = True) -> dict:
    """A /generate body (token ids; greedy)."""
    body = {"input_ids": input_ids, "sampling_params": {"max_new_tokens": max_new, "ignore_eos": ignore_eos,
                                                        "temperature": 0}}
    if session_id is not None:
        body["session_id"] = session_id
    return body


async def generate(http: aiohttp.ClientSession, base: str, input_ids: list[int], max_new: int,
                   session_id: str | None = None, headers: dict | None = None, ignore_eos: bool = True) -> dict:
    """One /generate call; returns its JSON answer (asserts 200)."""
    st, obj, _ = await post(http, base + "/generate", gen_body(input_ids, max_new, session_id, ignore_eos), headers)
    assert st == 200, (st, obj)
    return obj


async def pressure(http: aiohttp.ClientSession, url: str, n: int, n_in: int, n_out: int, seed: int,
                   ignore_eos: bool = True) -> list[dict]:
    """``n`` concurrent calls of ``n_in`` fresh random ids and ``n_out`` new tokens straight at ``url``: more KV
    than the pool holds, so the radix cache evicts. Returns every answer."""
    return list(await asyncio.gather(*(generate(http, url, ids(n_in, seed + i), n_out, ignore_eos=ignore_eos)
                                       for i in range(n))))


async def engine_metrics(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """An engine's /metrics: sample name -> value summed over label sets (sglang:* only)."""
    async with http.get(url + "/metrics") as r:
        text = await r.text()
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.startswith("sglang:"):
                out[s.name] = out.get(s.name, 0.0) + s.value
    return out


async def get_json(http: aiohttp.ClientSession, url: str) -> Any:
    async with http.get(url) as r:
        assert r.status == 200, (url, r.status)
        return orjson.loads(await r.read())
