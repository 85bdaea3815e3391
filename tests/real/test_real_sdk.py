"""The official OpenAI SDK's chat through kvgate and straight at smg 1.13, on real engines: the same greedy
answer, streamed and not. Both engines load the same random weights (--load-format dummy, --random-seed 0), so a
greedy answer does not depend on which engine the router picks."""

from __future__ import annotations

import asyncio

import openai

MODEL = "kvgate-tiny"
MESSAGES = [{"role": "system", "content": "You are a coding agent. Read the task and call tools. " * 4},
            {"role": "user", "content": "List the files under src/ and say which one holds the tests."}]


def _chat(base: str, stream: bool) -> tuple[str, str, tuple[int, int]]:
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=300)
    if not stream:
        r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=24, temperature=0)
        return r.choices[0].message.content, r.choices[0].finish_reason, (r.usage.prompt_tokens,
                                                                           r.usage.completion_tokens)
    text, finish, usage = [], None, None
    for ch in client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=24, temperature=0,
                                             stream=True, stream_options={"include_usage": True}):
        if ch.usage is not None:
            usage = (ch.usage.prompt_tokens, ch.usage.completion_tokens)
        for c in ch.choices:
            text.append(c.delta.content or "")
            finish = c.finish_reason or finish
    return "".join(text), finish, usage


async def test_openai_sdk_chat_same_answer_through_kvgate_as_straight_to_smg(fleet, kvgate_factory):
    gw, kv = await kvgate_factory(upstream=fleet.smg, agentic_session_lifecycle=True,
                                  agentic_program_admission=True, admission_poll_interval_s=0.2)
    answers = {}
    for stream in (False, True):
        for name, base in (("kvgate", kv), ("smg", fleet.smg)):
            # the sync client in a thread: kvgate runs on this event loop
            answers[name, stream] = await asyncio.to_thread(_chat, base, stream)
    direct, streamed = answers["smg", False], answers["smg", True]
    assert direct[1] == "length" and direct[2][1] == 24 and len(direct[0]) > 0
    assert answers["kvgate", False] == direct
    assert answers["kvgate", True] == streamed == direct  # a stream folds to the same answer
    # kvgate inferred a session for the unnamed chat (and admitted each call)
    assert gw.lifecycle.registry.as_json(0.0)["counts"]["active"] >= 1
