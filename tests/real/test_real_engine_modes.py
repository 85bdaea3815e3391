"""SGLang's data parallelism (``--dp-size 2``) on the CPU engine, with kvgate placing sessions: each session is
pinned to one DP rank (``routed_dp_rank``), where its prefix is cached; without the pin SGLang's DP controller
round-robins the turns over the ranks and each turn finds the other rank's radix tree empty.

These tests need an engine started otherwise than the shared ones: they run last (see conftest.py) and the
shared engines are stopped for them."""

from __future__ import annotations

import aiohttp
import pytest

from kvgate.tools.sglang_engine import EngineSpec

from .helpers import generate, ids

pytestmark = pytest.mark.exclusive_engines

TURNS = 3


async def _turns(http, base, sid, seed, headers=None):
    prompt, out = ids(200, seed), []
    for turn in range(TURNS):
        a = await generate(http, base, prompt, 8, headers=headers)
        out.append((len(prompt), a["meta_info"]["cached_tokens"], a["meta_info"]["dp_rank"]))
        prompt = prompt + a["output_ids"] + ids(40, seed * 10 + turn)
    return out


async def test_dp_ranks_each_session_on_one_rank(real_fleet, kvgate_factory):
    with real_fleet.exclusive([EngineSpec(max_total_tokens=4000, dp_size=2)], "dp") as (engine,):
        gw, kv = await kvgate_factory(upstream=engine.url, engines=[engine.url], agentic_session_lifecycle=True,
                                      session_placement="kvgate", admission_poll_interval_s=0.2)
        snaps = []
        gw.poller.listeners.append(snaps.append)
        await gw.directory.first_refresh.wait()
        while not snaps:
            await gw.poller.round_done.wait()
        # kvgate's capacity figures: one pool per rank, each the engine's max_total_num_tokens
        assert [p.capacity for p in snaps[-1].engines[engine.url].pools] == [4000, 4000]
        async with aiohttp.ClientSession() as http:
            placed = {sid: await _turns(http, kv, sid, seed, {"X-Session-ID": sid})
                      for sid, seed in (("a", 1), ("b", 2), ("c", 3))}
            direct = await _turns(http, engine.url, None, 4)
        ranks = {sid: gw.placement.engine_of(sid)[1] for sid in placed}
        assert sorted(set(ranks.values())) == [0, 1]  # sessions spread over the two ranks' pools
        for sid, turns in placed.items():
            assert [r for _, _, r in turns] == [ranks[sid]] * TURNS  # every turn on the session's rank
            (p1, c1, _), (p2, c2, _), (p3, c3, _) = turns
            assert c1 == 0 and p1 <= c2 < p2 and p2 <= c3 < p3, turns
        # Unpinned, the DP controller alternates the ranks: turn 2 finds nothing, turn 3 finds turn 1 only.
        assert [r for _, _, r in direct] in ([0, 1, 0], [1, 0, 1])
        assert direct[1][1] == 0 and direct[2][1] < direct[1][0]
