"""Every turn of a session lands on one real engine when kvgate places sessions, on all three generate routes:
cached_tokens grows turn by turn (behind smg 1.13's round_robin, which alternates engines, turn 2 would find
nothing cached)."""

from __future__ import annotations

import aiohttp
import pytest

from .helpers import generate, ids, post

TURNS = 3
MODEL = "kvgate-tiny"


def _openai_cached(obj: dict) -> int:
    # SGLang reports it only with --enable-cache-report (the launcher sets it); null otherwise
    return obj["usage"]["prompt_tokens_details"]["cached_tokens"]


async def _generate_turns(http, kv, sid):
    prompt, out = ids(200, 1), []
    for turn in range(TURNS):
        a = await generate(http, kv, prompt, 16, headers={"X-Session-ID": sid})
        out.append((len(prompt), a["meta_info"]["cached_tokens"]))
        prompt = prompt + a["output_ids"] + ids(60, 100 + turn)  # the turn's output, then a tool's observation
    return out


async def _chat_turns(http, kv, sid):
    messages, out = [{"role": "system", "content": "You are an agent. " * 30}], []
    for turn in range(TURNS):
        messages.append({"role": "user", "content": f"Observation {turn}: the tool printed {turn * 7} lines. " * 6})
        st, a, _ = await post(http, kv + "/v1/chat/completions",
                              {"model": MODEL, "messages": messages, "max_tokens": 16, "temperature": 0},
                              {"X-Session-ID": sid})
        assert st == 200, a
        out.append((a["usage"]["prompt_tokens"], _openai_cached(a)))
        messages.append({"role": "assistant", "content": a["choices"][0]["message"]["content"]})
    return out


async def _completion_turns(http, kv, sid):
    prompt, out = "The agent reads the task, calls a tool and waits. " * 12, []
    for turn in range(TURNS):
        st, a, _ = await post(http, kv + "/v1/completions",
                              {"model": MODEL, "prompt": prompt, "max_tokens": 16, "temperature": 0},
                              {"X-Session-ID": sid})
        assert st == 200, a
        out.append((a["usage"]["prompt_tokens"], _openai_cached(a)))
        prompt = prompt + a["choices"][0]["text"] + f" Observation {turn}: the tool printed {turn} files. " * 4
    return out


@pytest.mark.parametrize("route,turns", [("/generate", _generate_turns), ("/v1/chat/completions", _chat_turns),
                                         ("/v1/completions", _completion_turns)],
                         ids=["generate", "chat", "completions"])
async def test_each_turn_of_a_session_finds_the_last_one_cached(fleet, kvgate_factory, route, turns):
    gw, kv = await kvgate_factory(upstream=fleet.smg, agentic_session_lifecycle=True, session_placement="kvgate",
                                  discovery_interval_s=0.5)
    await gw.directory.first_refresh.wait()
    assert sorted(gw.directory.urls) == sorted(fleet.urls)
    # (With KVGATE_REAL_ENGINES=1 every turn lands on the one engine whoever places it: this then checks each
    # route's cached-token figures only.)
    async with aiohttp.ClientSession() as http:
        seen = await turns(http, kv, "s-" + route.strip("/").replace("/", "-"))
    (p1, c1), (p2, c2), (p3, c3) = seen
    assert c1 == 0
    # Each turn's prompt extends the last one's: at least the last prompt is cached (text routes: the previous
    # answer is re-tokenised inside the new prompt, so the match may end a few tokens before the old prompt
    # does; token ids on /generate match past it, into the cached output).
    slack = 0 if route == "/generate" else 8
    assert p1 - slack <= c2 < p2 and p2 - slack <= c3 < p3, seen
    assert gw.placement.counts["sticky"] == TURNS - 1
