"""Which KV a real SGLang 0.5.23 engine evicts first with sessions open, closed and never named.

The rule (SGLang 0.5.23, mem_cache/unified_cache/components/full.py ``_session_ref_eviction_strategy``): leaves
are evicted in the order of (referenced by an open session, the reference count, the --radix-eviction-policy key),
lowest first; ``lru``'s key is the node's last access, ``priority``'s is (request priority, last access)
(mem_cache/evict_policy.py). A close (mem_cache/unified_cache/session_ref_tracker.py ``release_radix_session``)
drops the session's references: its KV becomes ordinary cache, evicted in LRU order with the prompts that never
named a session, not ahead of them.

Each round puts three prefixes in one engine's radix cache, oldest first, then sends just enough fresh tokens to
evict one of them (the pool's free slots + about half a prefix): the open session's prefix goes last even when it
is the oldest; between the closed session's (3 turns, closed through kvgate) and the plain prompt's, the older
one goes. Read by cached_tokens when each prefix is sent again.
"""

from __future__ import annotations

import aiohttp
import pytest

from kvgate.tools import sglang_engine as eng

from .helpers import generate, get_json, ids, post

PREFIX = 600
SLACK = 300  # fresh tokens beyond the free slots: evicts one 600-token leaf, never two


async def _round(http, kv, gw, engine, order: str, seed: int) -> dict[str, int]:
    """Put the prefixes in ``order`` (letters o: open session, c: closed session, p: plain prompt), pressure,
    and return each prefix's cached tokens when sent again."""
    prompts = {k: ids(PREFIX, seed + i) for i, k in enumerate("ocp")}
    sid = {"o": f"open-{seed}", "c": f"closed-{seed}"}
    for k in order:
        if k == "p":
            await generate(http, engine, prompts["p"], 1)
        elif k == "o":
            await generate(http, kv, prompts["o"], 1, headers={"X-Session-ID": sid["o"]})
        else:  # three turns, each extending the last (its output kept), then closed by the client
            head = prompts["c"][:400]
            for extra in (prompts["c"][400:500], prompts["c"][500:]):
                a = await generate(http, kv, head, 1, headers={"X-Session-ID": sid["c"]})
                head = head + a["output_ids"] + extra
            await generate(http, kv, head, 1, headers={"X-Session-ID": sid["c"]})
            prompts["c"] = head
            st, _, _ = await post(http, kv + "/close_session", {"session_id": sid["c"]})
            assert st == 200
            await gw.lifecycle.settled(sid["c"], 60)
            s = gw.lifecycle.registry.get(sid["c"])
            assert s.state == "closed" and s.close_results == {engine: "ok"}
    info = await get_json(http, engine + "/get_server_info")
    pool = info.get("max_total_num_tokens") or info["internal_states"][0]["max_total_num_tokens"]
    held = sum(len(p) + 1 for p in prompts.values())  # each prompt and its one output token
    await generate(http, engine, ids(pool - held + SLACK, seed + 99), 1)
    # All three sent again in one batch: the engine matches each against its radix cache in one scheduling round,
    # before any of them allocates (one by one, re-computing an evicted prefix would evict an older one first).
    st, again, _ = await post(http, engine + "/generate", {
        "input_ids": [prompts[k] for k in "ocp"],
        "sampling_params": {"max_new_tokens": 1, "ignore_eos": True, "temperature": 0}})
    assert st == 200, again
    return {k: a["meta_info"]["cached_tokens"] for k, a in zip("ocp", again)}


async def _measure(engine: str, kvgate_factory) -> dict[str, dict[str, int]]:
    gw, kv = await kvgate_factory(upstream=engine, engines=[engine], agentic_session_lifecycle=True,
                                  session_placement="kvgate", session_idle_close_s=0, close_timeout_s=30.0)
    results = {}
    async with aiohttp.ClientSession() as http:
        for order, seed in (("opc", 100), ("ocp", 200)):
            eng.flush_cache(engine, 60)
            results[order] = await _round(http, kv, gw, engine, order, seed)
    return results


def _check(results: dict[str, dict[str, int]]) -> None:
    full = PREFIX - 1  # SGLang matches at most len - 1 tokens
    # open (oldest), plain, closed: the plain prompt is the oldest KV no open session holds: it goes first
    assert results["opc"]["o"] >= full and results["opc"]["p"] == 0 and results["opc"]["c"] >= full, results
    # open (oldest), closed, plain: now the closed session's KV is the oldest unreferenced: it goes first
    assert results["ocp"]["o"] >= full and results["ocp"]["c"] == 0 and results["ocp"]["p"] >= full, results


async def test_eviction_order_under_priority_policy(fleet, kvgate_factory):
    """The tier's shared engines run --radix-eviction-policy priority (every request at the default priority)."""
    results = await _measure(fleet.urls[0], kvgate_factory)
    print(f"priority: cached tokens after pressure (prefix {PREFIX}): {results}")
    _check(results)


@pytest.mark.exclusive_engines
async def test_eviction_order_under_lru_policy(real_fleet, kvgate_factory):
    spec = eng.EngineSpec(max_total_tokens=4000, extra=["--radix-eviction-policy", "lru"])  # the last flag wins
    with real_fleet.exclusive([spec], "lru") as (engine,):
        results = await _measure(engine.url, kvgate_factory)
    print(f"lru: cached tokens after pressure (prefix {PREFIX}): {results}")
    _check(results)
