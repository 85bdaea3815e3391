"""A worker for smg that is a simulated engine except where a test scripts the answer.

Every request is relayed to an in-process simulated engine (kvgate.sim), so smg registers and routes to it
like to any engine, except:
  - POST /v1/chat/completions with ``tools``: replays TOOL_STREAM (stream) or TOOL_ANSWER (non-stream),
    the shapes SGLang's OpenAI server writes (srt/entrypoints/openai/protocol.py: ChatCompletionStreamResponse,
    ToolCall with an optional ``index`` that older tool parsers leave null);
  - POST /v1/responses: a Responses API object in SGLang's shape (protocol.py ResponsesResponse), which the
    simulator does not serve;
  - the next ``fail_next[path]`` requests to ``path`` answer 503 (to make a client retry).
What reached the worker is kept in ``received`` (path, parsed JSON body).
"""

from __future__ import annotations

import aiohttp
import orjson
from aiohttp import web

TOOL_ID = "chatcmpl-tool-7f3a"
CALL_ARGS = '{"path": "/repo/tests", "recursive": true}'


def _tool_chunk(delta: dict, finish=None) -> dict:
    return {"id": TOOL_ID, "object": "chat.completion.chunk", "created": 1767225600, "model": "kvgate-sim",
            "choices": [{"index": 0, "delta": {"role": None, "content": None, "reasoning_content": None,
                                               "tool_calls": None, **delta},
                         "logprobs": None, "finish_reason": finish, "matched_stop": None}],
            "usage": None}


def _call_delta(index, call_id=None, name=None, arguments="") -> dict:
    return {"tool_calls": [{"id": call_id, "index": index, "type": "function",
                            "function": {"name": name, "arguments": arguments}}]}


# One assistant turn: a sentence, then one call to list_files whose arguments arrive in pieces; the
# middle pieces carry "index": null. Then the usage chunk (stream_options.include_usage) and [DONE].
TOOL_STREAM: list[dict] = [
    _tool_chunk({"role": "assistant", "content": ""}),
    _tool_chunk({"content": "I will list the tests."}),
    _tool_chunk(_call_delta(0, "call_0", "list_files", "")),
    _tool_chunk(_call_delta(None, arguments='{"path": ')),
    _tool_chunk(_call_delta(None, arguments='"/repo/tests", ')),
    _tool_chunk(_call_delta(0, arguments='"recursive": true}')),
    _tool_chunk({}, finish="tool_calls"),
    {"id": TOOL_ID, "object": "chat.completion.chunk", "created": 1767225600, "model": "kvgate-sim",
     "choices": [], "usage": {"prompt_tokens": 412, "completion_tokens": 31, "total_tokens": 443,
                              "prompt_tokens_details": None, "reasoning_tokens": 0}},
]

TOOL_ANSWER = {
    "id": TOOL_ID, "object": "chat.completion", "created": 1767225600, "model": "kvgate-sim",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "I will list the tests.",
                                         "reasoning_content": None,
                                         "tool_calls": [{"id": "call_0", "index": 0, "type": "function",
                                                         "function": {"name": "list_files",
                                                                      "arguments": CALL_ARGS}}]},
                 "logprobs": None, "finish_reason": "tool_calls", "matched_stop": None}],
    "usage": {"prompt_tokens": 412, "completion_tokens": 31, "total_tokens": 443}}

RESPONSE = {
    "id": "resp_5e1c", "object": "response", "created_at": 1767225600, "model": "kvgate-sim",
    "status": "completed", "error": None, "incomplete_details": None, "instructions": None,
    "max_output_tokens": 16, "parallel_tool_calls": True, "previous_response_id": None,
    "reasoning": None, "temperature": 1.0, "text": None, "tool_choice": "auto", "tools": [], "top_p": 1.0,
    "truncation": "disabled", "user": None, "metadata": {},
    "output": [{"id": "msg_5e1c", "type": "message", "role": "assistant", "status": "completed",
                "content": [{"type": "output_text", "text": "The tests pass.", "annotations": []}]}],
    "usage": {"input_tokens": 9, "output_tokens": 4, "total_tokens": 13,
              "input_tokens_details": {"cached_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0}},
}


class ScriptedWorker:
    """``await start(sim_url)``; ``url``; ``received``; ``fail_next``; ``await close()``."""

    def __init__(self):
        self.received: list[tuple[str, dict | None]] = []
        self.fail_next: dict[str, int] = {}
        self.url = ""
        self._sim = ""
        self._runner: web.AppRunner | None = None
        self._http: aiohttp.ClientSession | None = None

    async def start(self, sim_url: str) -> "ScriptedWorker":
        self._sim = sim_url
        self._http = aiohttp.ClientSession(auto_decompress=False)
        app = web.Application(client_max_size=1 << 28)
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        return self

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._http is not None:
            await self._http.close()

    def bodies(self, path: str) -> list[dict | None]:
        return [b for p, b in self.received if p == path]

    async def handle(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        body = None
        if raw:
            try:
                body = orjson.loads(raw)
            except orjson.JSONDecodeError:
                body = None
        if request.method == "POST":
            self.received.append((request.path, body))
            if self.fail_next.get(request.path, 0) > 0:
                self.fail_next[request.path] -= 1
                return web.json_response({"object": "error", "message": "The server is busy.",
                                          "type": "ServiceUnavailable", "code": 503}, status=503)
        if request.method == "POST" and request.path == "/v1/chat/completions" and isinstance(body, dict) \
                and body.get("tools"):
            if not body.get("stream"):
                return web.Response(body=orjson.dumps(TOOL_ANSWER), content_type="application/json")
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await resp.prepare(request)
            for chunk in TOOL_STREAM:
                if chunk["usage"] is not None and not (body.get("stream_options") or {}).get("include_usage"):
                    continue
                await resp.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        if request.method == "POST" and request.path == "/v1/responses":
            return web.Response(body=orjson.dumps(RESPONSE), content_type="application/json")
        return await self._relay(request, raw)

    async def _relay(self, request: web.Request, raw: bytes) -> web.StreamResponse:
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("content-type", "accept")}
        async with self._http.request(request.method, self._sim + request.path_qs, data=raw or None,
                                      headers=headers) as up:
            resp = web.StreamResponse(status=up.status, headers={
                k: v for k, v in up.headers.items() if k.lower() in ("content-type", "cache-control")})
            await resp.prepare(request)
            async for chunk in up.content.iter_any():
                await resp.write(chunk)
            await resp.write_eof()
            return resp
