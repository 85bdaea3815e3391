"""Agent SDKs through kvgate on a real SGLang 0.5.23 CPU engine, with no session id anywhere: the openai Agents SDK
running a 3-turn tool-using agent, and a litellm agent that drops an answer it cannot parse and asks again. Each
agent must be one inferred session, its cached tokens growing turn over turn, and closed on every engine at the end
(the idle close: these clients send no end signal).

The tier's tiny model has random weights: it never writes a tool call, and SGLang's tool-call parsers have nothing
to parse. So the model's answers are scripted: ``ToolShim`` sits between kvgate and the engine, sends each chat
call on to the real engine (which prefills the whole prompt, caches it and reports cached_tokens), and replaces the
engine's message with a deterministic one (a tool call, an unparsable reply, or the final answer), keeping the
engine's usage. Everything else is real: the SDKs build and echo the messages, kvgate infers the sessions from them,
the engine caches what the SDKs send.
"""

from __future__ import annotations

import hashlib
import json
import os

import aiohttp
import orjson
import pytest
from aiohttp import web

agents = pytest.importorskip("agents", reason="the openai Agents SDK (pip install openai-agents)")
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no network fetch at import
litellm = pytest.importorskip("litellm", reason="litellm (pip install litellm)")

MODEL = "kvgate-tiny"
IDLE_S = 1.0


def _call(tag: str, turn: int, name: str, args: dict) -> dict:
    cid = "call_" + hashlib.sha256(f"{tag}-{turn}".encode()).hexdigest()[:12]
    return {"role": "assistant", "content": None,
            "tool_calls": [{"id": cid, "index": 0, "type": "function",
                            "function": {"name": name, "arguments": json.dumps(args)}}]}


def script(messages: list[dict]) -> tuple[dict, str]:
    """The scripted answer to a chat call, from what the conversation holds so far; (message, finish_reason)."""
    tag = str(messages[0].get("content"))[:40]
    tools_done = sum(1 for m in messages if m.get("role") == "tool")
    if tag.startswith("[litellm"):
        asked_again = any(m.get("role") == "user" and "not valid" in str(m.get("content")) for m in messages)
        if tools_done:
            return {"role": "assistant", "content": '{"answer": "tests live in tests/"}'}, "stop"
        if asked_again:
            return _call(tag, 1, "list_files", {"path": "src"}), "tool_calls"
        return {"role": "assistant", "content": "Sure! Here is my plan: first I will"}, "stop"  # not JSON
    if tools_done == 0:
        return _call(tag, 0, "list_files", {"path": "src"}), "tool_calls"
    if tools_done == 1:
        return _call(tag, 1, "read_file", {"path": "src/test_app.py"}), "tool_calls"
    return {"role": "assistant", "content": "The tests are in src/test_app.py."}, "stop"


class ToolShim:
    """An upstream for kvgate that forwards chat calls to a real engine and answers them with ``script``."""

    def __init__(self, engine: str):
        self.engine = engine
        self.cached: dict[str, list[int]] = {}  # system prompt head -> cached_tokens per call

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if request.path != "/v1/chat/completions":
            return web.Response(status=404)
        body = await request.json()
        fwd = {k: v for k, v in body.items() if k not in ("tools", "tool_choice", "parallel_tool_calls", "stream",
                                                            "stream_options")}
        fwd["max_tokens"] = 2
        async with self.http.post(self.engine + "/v1/chat/completions", json=fwd,
                                  timeout=aiohttp.ClientTimeout(total=300)) as r:
            answer = await r.json()
            assert r.status == 200, answer
        message, finish = script(body["messages"])
        answer["choices"][0]["message"] = message
        answer["choices"][0]["finish_reason"] = finish
        cached = ((answer.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        self.cached.setdefault(str(body["messages"][0].get("content"))[:40], []).append(cached)
        return web.Response(body=orjson.dumps(answer), content_type="application/json")

    async def start(self) -> str:
        self.http = aiohttp.ClientSession()
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        return f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"

    async def stop(self) -> None:
        await self.http.close()
        await self.runner.cleanup()


TOOLS = [{"type": "function", "function": {"name": "list_files", "description": "List files",
                                           "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                                                          "required": ["path"]}}}]


async def _run_agents_sdk(kv: str, i: int) -> str:
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)

    @function_tool
    def list_files(path: str) -> str:
        """List the files under a path."""
        return f"{path}/app.py {path}/test_app.py"

    @function_tool
    def read_file(path: str) -> str:
        """Read a file."""
        return f"def test_add(): assert add(1, 2) == 3  # {path}"

    client = AsyncOpenAI(base_url=kv + "/v1", api_key="unused", max_retries=0, timeout=300)
    agent = Agent(name=f"coder-{i}", instructions=f"[agents {i}] You are a careful coding agent. " * 12,
                  tools=[list_files, read_file], model=OpenAIChatCompletionsModel(model=MODEL, openai_client=client),
                  model_settings=ModelSettings(temperature=0, max_tokens=2))
    result = await Runner.run(agent, f"Find the tests of project {i}.", max_turns=6)
    return result.final_output


async def _run_litellm_agent(kv: str, i: int) -> dict:
    msgs: list = [{"role": "system", "content": f"[litellm {i}] Answer in JSON or call a tool. " * 12},
                  {"role": "user", "content": f"Where are the tests of project {i}?"}]
    for _ in range(5):
        resp = await litellm.acompletion(model="openai/" + MODEL, api_base=kv + "/v1", api_key="unused",
                                         messages=msgs, tools=TOOLS, temperature=0, max_tokens=2, num_retries=0)
        msg = resp.choices[0].message
        if msg.tool_calls:
            msgs.append(msg)  # as litellm agents keep it
            for c in msg.tool_calls:
                msgs.append({"role": "tool", "tool_call_id": c.id, "content": "src/app.py src/test_app.py"})
            continue
        try:
            return json.loads(msg.content)
        except json.JSONDecodeError:  # an answer it cannot parse: dropped, and asked again with feedback
            msgs.append({"role": "user", "content": "That was not valid JSON. Call a tool or answer in JSON."})
    raise AssertionError("the agent did not finish")


async def test_agent_sdks_each_agent_one_session_cached_tokens_grow_closed_at_end(fleet, kvgate_factory):
    engine = fleet.urls[0]
    shim = ToolShim(engine)
    up = await shim.start()
    try:
        # placement "router": every call goes through the shim (kvgate's upstream); closes go to the engine
        gw, kv = await kvgate_factory(upstream=up, engines=[engine], agentic_session_lifecycle=True,
                                      session_placement="router", session_idle_close_s=IDLE_S, close_timeout_s=30.0)
        outputs = [await _run_agents_sdk(kv, i) for i in range(2)]
        parsed = [await _run_litellm_agent(kv, i) for i in range(2)]
    finally:
        await shim.stop()
    assert outputs == ["The tests are in src/test_app.py."] * 2
    assert parsed == [{"answer": "tests live in tests/"}] * 2
    reg = gw.lifecycle.registry
    sessions = reg.as_json(gw.lifecycle.clock())["sessions"]
    print("cached tokens per call:", shim.cached)
    print("sessions:", [(s["session_id"], s["source"], s["turns"]) for s in sessions])
    assert sorted((s["source"], s["turns"]) for s in sessions) == [("inferred", 3)] * 4
    for calls in shim.cached.values():
        assert len(calls) == 3 and calls[0] < calls[1] < calls[2], shim.cached
    for s in sessions:
        await gw.lifecycle.settled(s["session_id"], 60)
        await gw.lifecycle.wait_until(lambda sid=s["session_id"]: reg.get(sid).state == "closed", 60)
        got = reg.get(s["session_id"])
        assert got.close_reason == "idle" and got.close_results == {engine: "ok"}
    assert gw.inference.stats()["reask"] == 2
