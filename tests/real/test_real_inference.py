"""Sessions without client ids on real engines: kvgate infers them from the prompt's prefix, keeps each on one
engine, and GRPO siblings (one task prompt, different continuations) stay two sessions."""

from __future__ import annotations

import aiohttp

from .helpers import generate, ids

TURNS = 3


async def test_unnamed_turns_are_linked_into_sessions_on_one_engine(fleet, kvgate_factory):
    gw, kv = await kvgate_factory(upstream=fleet.smg, agentic_session_lifecycle=True, session_placement="kvgate",
                                  discovery_interval_s=0.5)
    await gw.directory.first_refresh.wait()
    task = ids(256, 5)  # four 64-id blocks: what inference hashes
    prompts = [task + ids(64, 6), task + ids(64, 7)]  # two siblings of one task
    seen: list[list[tuple[int, int]]] = [[], []]
    async with aiohttp.ClientSession() as http:
        for turn in range(TURNS):
            for i in range(2):  # one after the other: each finds what the last one left in the radix cache
                a = await generate(http, kv, prompts[i], 16)
                seen[i].append((len(prompts[i]), a["meta_info"]["cached_tokens"]))
                prompts[i] = prompts[i] + a["output_ids"] + ids(64, 100 * i + turn)
    sessions = gw.lifecycle.registry.as_json(0.0)["sessions"]
    assert sorted((s["source"], s["turns"]) for s in sessions) == [("inferred", TURNS), ("inferred", TURNS)]
    # Each session stays on one engine, and every later turn found its own last prompt and output. Sibling A's
    # first turn found nothing; sibling B's found the shared task prompt where it went to A's engine, nothing
    # on the other (placement indexes whole earlier prompts, so B's first prompt, which differs from A's in its
    # last block, is placed by free KV and load, not by A's prefix).
    (a1, a_c1), *a_rest = seen[0]
    (b1, b_c1), *b_rest = seen[1]
    by_sid = {s["session_id"]: s for s in sessions}
    engine = {sid: gw.placement.engine_of(sid)[0] for sid in by_sid}
    assert len(engine) == 2 and all(engine.values())
    a_sid, b_sid = sorted(by_sid, key=lambda sid: by_sid[sid]["first_seen_unix"])
    assert a_c1 == 0
    if engine[a_sid] == engine[b_sid]:
        assert len(task) <= b_c1 < b1
    else:
        assert b_c1 == 0
    for turns in (seen[0], seen[1]):
        for (p_prev, _), (p, c) in zip(turns, turns[1:]):
            assert p_prev <= c < p, turns
    m = gw.metrics.render()[0].decode()
    assert 'agentic_kv_session_inference_total{result="new"} 2.0' in m
    assert f'agentic_kv_session_inference_total{{result="decisive"}} {2.0 * (TURNS - 1)}' in m
