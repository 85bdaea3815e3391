"""The official OpenAI Python SDK through kvgate (session lifecycle + admission on) -> real smg -> engines.

Each call is made twice, through kvgate and straight at smg (same fleet), and the answers must match: the
calls decode greedily (temperature 0), so the simulated engine gives the same prompt the same output. The
engine behind smg is a ScriptedWorker: a simulated engine that also replays SGLang-shaped tool-call streams
and serves /v1/responses. The sync client runs in a thread: the engines and kvgate share this event loop.
"""

from __future__ import annotations

import asyncio
import math

import openai
import pytest

from kvgate.admission.reservation import estimate_reservation
from kvgate.sim.sim_engine import SimEngine
from scripted_worker import CALL_ARGS, RESPONSE, TOOL_ANSWER, TOOL_STREAM
from sdk_fleet import Fleet, fleet, metric as _metric, settled as _settled  # noqa: F401 (fleet is a fixture)

pytestmark = pytest.mark.router

SYSTEM = "You are a coding agent. Read the task, call tools, and report what you changed. " * 6
MODEL = "kvgate-sim"
TOOLS = [{"type": "function", "function": {
    "name": "list_files", "description": "List files under a path.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "recursive": {"type": "boolean"}},
                   "required": ["path"]}}}]


def _clients(f: Fleet, **opts):
    """(through kvgate, straight at smg) sync clients with the same options."""
    opts = {"api_key": "unused", "max_retries": 0, **opts}
    return openai.OpenAI(base_url=f.kv + "/v1", **opts), openai.OpenAI(base_url=f.router + "/v1", **opts)


def _async_clients(f: Fleet, **opts):
    opts = {"api_key": "unused", "max_retries": 0, **opts}
    return openai.AsyncOpenAI(base_url=f.kv + "/v1", **opts), openai.AsyncOpenAI(base_url=f.router + "/v1", **opts)


def _messages(task: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task}]


def _answer(resp) -> dict:
    """What must not change through kvgate: every choice and the token counts (ids, times and the
    cached-token count, which depends on what ran before, may)."""
    d = resp.model_dump()
    choices = sorted(d["choices"], key=lambda c: c["index"])
    return {"choices": choices, "tokens": (d["usage"]["prompt_tokens"], d["usage"]["completion_tokens"])}


def _streamed(chunks) -> dict:
    """An OpenAI stream folded per choice index: text, finish reason, and the usage chunk's counts."""
    by_index: dict[int, dict] = {}
    usage = None
    for ch in chunks:
        if ch.usage is not None:
            usage = (ch.usage.prompt_tokens, ch.usage.completion_tokens)
        for c in ch.choices:
            slot = by_index.setdefault(c.index, {"text": "", "finish": None})
            piece = c.delta.content if hasattr(c, "delta") else c.text
            slot["text"] += piece or ""
            slot["finish"] = c.finish_reason or slot["finish"]
    return {"choices": by_index, "usage": usage}


async def test_sync_client_chat_and_completions_streamed_and_not_match_smg(fleet):
    f = await fleet()
    via, direct = _clients(f)
    extra = {"session_id": "sync-1"}

    def run(client):
        out = {}
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, temperature=0, messages=_messages("Fix the failing test."), max_tokens=12, extra_body=extra)
        out["header"] = raw.headers.get("x-kvgate-session-id")
        out["chat"] = _answer(raw.parse())
        out["chat_stream"] = _streamed(client.chat.completions.create(
            model=MODEL, temperature=0, messages=_messages("Fix the flaky test."), max_tokens=9, stream=True,
            stream_options={"include_usage": True}, extra_body=extra))
        out["completion"] = _answer(client.completions.create(
            model=MODEL, temperature=0, prompt=SYSTEM + "Task: rename the module.", max_tokens=7, extra_body=extra))
        out["completion_stream"] = _streamed(client.completions.create(
            model=MODEL, temperature=0, prompt=SYSTEM + "Task: add a docstring.", max_tokens=5, stream=True,
            stream_options={"include_usage": True}, extra_body=extra))
        return out

    got = await asyncio.to_thread(run, via)
    want = await asyncio.to_thread(run, direct)
    assert got["header"] == "sync-1" and want["header"] is None
    for key in ("chat", "chat_stream", "completion", "completion_stream"):
        assert got[key] == want[key], key
    chat = got["chat"]["choices"][0]
    assert chat["finish_reason"] == "length" and chat["message"]["role"] == "assistant"
    assert len(chat["message"]["content"]) == 12  # the simulator's byte tokens: one character each
    assert got["chat"]["tokens"][1] == 12
    assert got["chat_stream"]["usage"][1] == 9 and len(got["chat_stream"]["choices"][0]["text"]) == 9
    assert got["completion"]["tokens"] == (len(SYSTEM) + len("Task: rename the module."), 7)
    assert got["completion_stream"]["choices"][0]["finish"] == "length"
    assert got["completion_stream"]["usage"] == (len(SYSTEM) + len("Task: add a docstring."), 5)

    s = await _settled(f, "sync-1", 4)
    assert (s.source, s.completion_tokens) == ("body", 12 + 9 + 7 + 5)
    assert s.prompt_tokens == sum(x["tokens"][0] for x in (got["chat"], got["completion"])) + \
        got["chat_stream"]["usage"][0] + got["completion_stream"]["usage"][0]
    # smg 1.13 forwards session_id on chat and /v1/completions: 4 calls through kvgate + the same 4 direct
    assert f.engine.stats()["sessions"] == {"sync-1": 8}
    assert f.gw.gate.coord.counters["admit"] == 4 and f.gw.gate.ledger.reserved == 0
    assert _metric(f, 'agentic_kv_session_id_injected_total{source="body"}') == 4


async def test_async_client_n_greater_than_one_concurrently(fleet):
    f = await fleet()
    via, direct = _async_clients(f)

    async def run(client, tag):
        sid = {"session_id": f"{tag}-n"}
        chat, chat_stream, comp, comp_stream = await asyncio.gather(
            client.chat.completions.create(model=MODEL, temperature=0, messages=_messages("Name three fixes."),
                                           max_tokens=8, n=3, extra_body=sid),
            client.chat.completions.create(model=MODEL, temperature=0, messages=_messages("Name two fixes."),
                                           max_tokens=6, n=2, stream=True, stream_options={"include_usage": True},
                                           extra_body={"session_id": f"{tag}-ns"}),
            client.completions.create(model=MODEL, temperature=0, prompt=SYSTEM + "Two ideas:", max_tokens=4, n=2,
                                      extra_body={"session_id": f"{tag}-c"}),
            client.completions.create(model=MODEL, temperature=0, prompt=SYSTEM + "Three ideas:", max_tokens=3, n=3,
                                      stream=True, stream_options={"include_usage": True},
                                      extra_body={"session_id": f"{tag}-cs"}))
        return (_answer(chat), _streamed([c async for c in chat_stream]), _answer(comp),
                _streamed([c async for c in comp_stream]))

    got = await run(via, "kv")
    want = await run(direct, "direct")
    assert got == want
    chat, chat_stream, comp, comp_stream = got
    assert [c["index"] for c in chat["choices"]] == [0, 1, 2] and chat["tokens"][1] == 3 * 8
    assert len({c["message"]["content"] for c in chat["choices"]}) == 1  # same prompt, deterministic engine
    assert sorted(chat_stream["choices"]) == [0, 1] and chat_stream["usage"][1] == 2 * 6
    assert all(len(c["text"]) == 6 and c["finish"] == "length" for c in chat_stream["choices"].values())
    assert [c["index"] for c in comp["choices"]] == [0, 1] and comp["tokens"] == (len(SYSTEM) + 10, 8)
    assert sorted(comp_stream["choices"]) == [0, 1, 2] and comp_stream["usage"][1] == 3 * 3

    for sid, n, completion in (("kv-n", 3, 24), ("kv-ns", 2, 12), ("kv-c", 2, 8), ("kv-cs", 3, 9)):
        s = await _settled(f, sid, 1)
        assert s.completion_tokens == completion, sid
    # admission reserves for every sequence; the n copies share their prompt (SGLang prefills it once):
    # the prompt once + n x max_tokens
    def one(path, **body):
        return estimate_reservation(path, {"model": MODEL, **body}, expected_decode_cap=4096)
    assert sorted(t for _, t in f.reservations) == sorted([
        one("/v1/chat/completions", messages=_messages("Name three fixes."), max_tokens=8) + 2 * 8,
        one("/v1/chat/completions", messages=_messages("Name two fixes."), max_tokens=6) + 1 * 6,
        math.ceil(len(SYSTEM + "Two ideas:") / 3) + 2 * 4,  # text: ceil(characters / 3) + n x max_tokens
        math.ceil(len(SYSTEM + "Three ideas:") / 3) + 3 * 3])
    assert f.gw.gate.ledger.reserved == 0 and f.gw.gate.coord.counters["admit"] == 4


async def test_tool_call_stream_with_null_index_relays_whole_and_the_next_turn_links(fleet):
    f = await fleet()
    via, direct = _clients(f)
    msgs = _messages("List the tests, then run them.")

    def turn(client, messages):
        stream = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, stream=True,
                                                stream_options={"include_usage": True})
        return [c.model_dump(exclude_unset=True) for c in stream]

    got = await asyncio.to_thread(turn, via, msgs)
    want = await asyncio.to_thread(turn, direct, msgs)
    assert got == want and len(got) == len(TOOL_STREAM)
    calls = [c["choices"][0]["delta"]["tool_calls"][0] for c in got if c["choices"]
             and c["choices"][0]["delta"].get("tool_calls")]
    assert [c["index"] for c in calls] == [0, None, None, 0]  # the null indexes reached the client
    assert "".join(c["function"]["arguments"] for c in calls) == CALL_ARGS
    assert got[-1]["usage"]["completion_tokens"] == 31

    # The agent runs the tool and sends the next turn without naming a session: kvgate links it to the
    # first by prefix (the streamed tool call, read despite its null indexes, is part of the new prompt).
    echoed = {"role": "assistant", "content": "I will list the tests.",
              "tool_calls": [{"id": "call_0", "type": "function",
                              "function": {"name": "list_files", "arguments": CALL_ARGS}}]}
    msgs2 = msgs + [echoed, {"role": "tool", "tool_call_id": "call_0", "content": "test_a.py test_b.py"}]
    non_stream = await asyncio.to_thread(lambda: via.chat.completions.create(
        model=MODEL, messages=msgs2, tools=TOOLS))
    assert non_stream.model_dump(exclude_unset=True)["choices"] == TOOL_ANSWER["choices"]
    sessions = f.gw.lifecycle.registry.as_json(0.0)["sessions"]
    assert len(sessions) == 1 and sessions[0]["source"] == "inferred"
    await _settled(f, sessions[0]["session_id"], 2)
    assert _metric(f, 'agentic_kv_session_inference_total{result="decisive"}') == 1
    assert _metric(f, 'agentic_kv_faults_total{stage="session"}') == 0


async def test_sdk_timeout_cancels_each_attempt_and_frees_its_reservation(fleet):
    f = await fleet(engine_opts={"speed": 1.0})  # about 80 tokens a second: 4,000 tokens outlast the timeout
    aborts: list = []
    both_aborted = asyncio.Event()
    engine: SimEngine = f.engine.engine
    original = engine.abort

    def abort(rid, abort_all=False, message="Abort request"):
        out = original(rid, abort_all, message)
        aborts.append(rid)
        if len(aborts) >= 2:
            both_aborted.set()
        return out

    engine.abort = abort
    via, _ = _clients(f, timeout=2.0, max_retries=1)
    with pytest.raises(openai.APITimeoutError):
        await asyncio.to_thread(lambda: via.completions.create(
            model=MODEL, prompt=SYSTEM + "Write a long report.", max_tokens=4000,
            extra_body={"session_id": "slow", "ignore_eos": True}))
    s = await _settled(f, "slow", 2)  # the SDK's first attempt and its one retry
    assert s.completion_tokens == 0
    assert f.gw.gate.ledger.reserved == 0 and f.gw.gate.coord.counters["admit"] == 2
    assert _metric(f, "agentic_kv_client_disconnects_total") == 2
    await asyncio.wait_for(both_aborted.wait(), 10)  # smg passed each disconnect on: the engine stopped both
    assert len(set(aborts)) == 2


async def test_sdk_retries_a_503_and_gets_the_same_answer(fleet):
    f = await fleet(router_extra=["--disable-retries"])  # smg retries 5xx itself unless told not to
    via, direct = _clients(f, max_retries=2)
    want = await asyncio.to_thread(lambda: direct.completions.create(
        model=MODEL, temperature=0, prompt=SYSTEM + "Summarise.", max_tokens=6, extra_body={"session_id": "retry"}))
    f.worker.fail_next["/v1/completions"] = 2
    got = await asyncio.to_thread(lambda: via.completions.create(
        model=MODEL, temperature=0, prompt=SYSTEM + "Summarise.", max_tokens=6, extra_body={"session_id": "retry"}))
    assert _answer(got) == _answer(want) and len(got.choices[0].text) == 6
    bodies = f.worker.bodies("/v1/completions")
    assert len(bodies) == 4 and all(b == bodies[0] for b in bodies)  # 1 direct + 3 attempts, the same body
    assert bodies[0]["session_id"] == "retry"
    assert _metric(f, 'agentic_kv_requests_total{route="/v1/completions",status="503"}') == 2
    assert _metric(f, 'agentic_kv_requests_total{route="/v1/completions",status="200"}') == 1
    s = await _settled(f, "retry", 3)
    assert s.completion_tokens == 6 and f.gw.gate.ledger.reserved == 0


async def test_responses_api_through_kvgate_matches_smg(fleet):
    f = await fleet()
    via, direct = _async_clients(f)
    got = await via.responses.create(model=MODEL, input="Do the tests pass?", max_output_tokens=16,
                                     extra_headers={"X-Session-ID": "resp-1"})
    want = await direct.responses.create(model=MODEL, input="Do the tests pass?", max_output_tokens=16)
    assert got.model_dump(exclude_unset=True) == want.model_dump(exclude_unset=True) == RESPONSE
    assert got.output_text == "The tests pass." and got.usage.input_tokens == 9
    s = await _settled(f, "resp-1", 1)
    assert (s.prompt_tokens, s.completion_tokens) == (9, 4)
    # kvgate adds no session_id on /v1/responses: smg 1.13 answers 400 to one there (below)
    assert [b.get("session_id") for b in f.worker.bodies("/v1/responses")] == [None, None]
    assert _metric(f, 'agentic_kv_session_id_injected_total{source="header"}') == 0
    # a client's own session_id there gets the router's answer through kvgate as straight from smg
    answers = []
    for c in (via, direct):
        with pytest.raises(openai.BadRequestError) as err:
            await c.responses.create(model=MODEL, input="Do the tests pass?", max_output_tokens=16,
                                     extra_body={"session_id": "resp-2"})
        answers.append((err.value.status_code, "unknown field `session_id`" in str(err.value)))
    assert answers == [(400, True), (400, True)]