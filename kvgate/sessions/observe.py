"""Reading what a relayed response says about the session, without holding up the relay (pure).

The relay hands every chunk to a ResponseObserver as it passes through. For a JSON response it keeps
the bytes up to a cap; for an SSE stream it keeps only the last complete ``data:`` events, because
SGLang's stream chunks carry cumulative meta_info and output_ids (SGLang's srt/entrypoints/http_server.py).
At the end ``result()`` gives the last meta_info and output_ids seen.

Token usage, for every route and stream form: /generate's meta_info; the OpenAI routes' ``usage`` (the
final chunk with ``stream_options.include_usage``, or every chunk with ``continuous_usage_stats``);
/v1/responses' ``usage`` (input_tokens, output_tokens). An OpenAI stream without any usage block is
counted: one completion token per streamed content chunk (SGLang streams each decoded token as it is
detokenized, stream_interval 1), prompt tokens unknown (0); ``usage_source`` then says "counted".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from kvgate.sessions.inference import chat_output_text, response_units


@dataclass
class Observed:
    """meta_info (prompt_tokens, completion_tokens, cached_tokens, finish_reason ...) and output_ids.

    For a batch response, the per-sequence lists are summed into one meta_info. ``output`` is what
    session inference needs (kvgate.sessions.inference.response_units): the output ids, or the output text for
    text prompts and the OpenAI routes; None when the observer was not asked for it.
    """

    meta_info: dict[str, Any] | None = None
    output_ids: list[int] | None = None
    finish_type: str | None = None
    output: list[int] | str | None = None
    usage_source: str | None = None  # meta_info | usage | counted


def _usage_meta(usage: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI (prompt_/completion_tokens) or Responses (input_/output_tokens) usage block as meta_info."""
    meta = {"prompt_tokens": usage.get("prompt_tokens", usage.get("input_tokens", 0)),
            "completion_tokens": usage.get("completion_tokens", usage.get("output_tokens", 0))}
    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details")
    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
        meta["cached_tokens"] = details["cached_tokens"]
    return meta


def _from_obj(obj: Any) -> Observed:
    if isinstance(obj, list):  # batch /generate answer: one object per sequence
        parts = [_from_obj(o) for o in obj]
        metas = [p.meta_info for p in parts if p.meta_info]
        if not metas:
            return Observed()
        merged = {k: sum(m.get(k, 0) or 0 for m in metas if isinstance(m.get(k, 0), int))
                  for k in ("prompt_tokens", "completion_tokens", "cached_tokens", "num_retractions")}
        types = {p.finish_type for p in parts}
        return Observed(merged, None, "abort" if "abort" in types else next(iter(types)), usage_source="meta_info")
    if not isinstance(obj, dict):
        return Observed()
    meta = obj.get("meta_info")
    if isinstance(meta, dict):
        fr = meta.get("finish_reason")
        ftype = fr.get("type") if isinstance(fr, dict) else None
        out_ids = obj.get("output_ids")
        return Observed(meta, out_ids if isinstance(out_ids, list) else None, ftype, usage_source="meta_info")
    ftype = None
    choices = obj.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        ftype = choices[0].get("finish_reason")
    ftype = ftype if isinstance(ftype, str) else None
    usage = obj.get("usage")  # OpenAI-compatible routes
    if not isinstance(usage, dict) and isinstance(obj.get("response"), dict):
        usage = obj["response"].get("usage")  # a /v1/responses stream event (response.completed)
    if isinstance(usage, dict):
        return Observed(_usage_meta(usage), None, ftype, usage_source="usage")
    return Observed(None, None, ftype)


class ResponseObserver:
    """Fed the response body chunk by chunk; ``result()`` parses what it kept.

    is_sse: the response is text/event-stream. max_json_bytes: a JSON body larger than this is not
    parsed (its meta_info is skipped, the relay is unaffected). route / prompt_is_text: when ``route``
    is given, ``result().output`` carries the turn's output for session inference; OpenAI streams send
    deltas, so their text is accumulated (up to max_json_bytes) instead of keeping the last event.
    """

    def __init__(self, is_sse: bool, max_json_bytes: int = 16 * 1024 * 1024, route: str | None = None,
                 prompt_is_text: bool = False):
        self.is_sse = is_sse
        self.max_json_bytes = max_json_bytes
        self.route = route
        self.prompt_is_text = prompt_is_text
        self._buf = bytearray()
        self._last_event: bytes | None = None
        self._prev_event: bytes | None = None  # the one before: a stream may end with an error event
        self._overflow = False
        self._deltas = _OpenAIDeltas(max_json_bytes) if is_sse and route in _OPENAI_ROUTES else None

    def feed(self, chunk: bytes) -> None:
        """Take one relayed chunk (any size; events may straddle chunks)."""
        if self._overflow:
            return
        self._buf += chunk
        if not self.is_sse:
            if len(self._buf) > self.max_json_bytes:
                self._overflow = True
                self._buf.clear()
            return
        end = self._buf.rfind(b"\n\n")
        if end < 0:
            if len(self._buf) > self.max_json_bytes:
                self._overflow = True
                self._buf.clear()
            return
        complete = bytes(self._buf[:end])
        del self._buf[:end + 2]
        events = complete.split(b"\n\n")
        if self._deltas is not None:
            for event in events:
                data = _event_data(event)
                if data is not None and data != b"[DONE]":
                    self._deltas.add(data)
        kept = []
        for event in reversed(events):
            data = _event_data(event)
            if data is not None and data != b"[DONE]":
                kept.append(data)
                if len(kept) == 2:
                    break
        if kept:
            self._prev_event = kept[1] if len(kept) == 2 else self._last_event
            self._last_event = kept[0]

    def result(self) -> Observed:
        """Parse what was kept; never raises (unparsable or unexpected -> empty Observed)."""
        try:
            return self._result()
        except Exception:  # a response kvgate cannot read must never fail the request it came with
            return Observed()

    def _result(self) -> Observed:
        if self.is_sse:
            out = Observed()
            for event in (self._last_event, self._prev_event):
                if event:
                    try:
                        out = _from_obj(orjson.loads(event))
                    except orjson.JSONDecodeError:
                        continue
                    if out.meta_info is not None:
                        break
            obj = None
            if self._deltas is not None and out.meta_info is None:
                d = self._deltas
                if d.usage is not None:
                    out.meta_info, out.usage_source = _usage_meta(d.usage), "usage"
                elif d.tokens:
                    out.meta_info, out.usage_source = {"completion_tokens": d.tokens}, "counted"
        else:
            if self._overflow or not self._buf:
                return Observed()
            try:
                obj = orjson.loads(self._buf)  # orjson reads a bytearray as is: no copy
            except orjson.JSONDecodeError:
                return Observed()
            out = _from_obj(obj)
        if self.is_sse and self._last_event and self._deltas is None and self.route is not None:
            try:
                obj = orjson.loads(self._last_event)
            except orjson.JSONDecodeError:
                obj = None
        if self.route is not None:
            if self._deltas is not None:
                out.output = self._deltas.output(self.route)
                out.finish_type = out.finish_type or self._deltas.finish
            else:
                out.output = response_units(self.route, obj, self.prompt_is_text)
        return out


_OPENAI_ROUTES = ("/v1/completions", "/v1/chat/completions")


class _OpenAIDeltas:
    """Accumulates an OpenAI stream's choices[0] deltas: completion text, chat content and tool calls."""

    def __init__(self, cap: int):
        self.cap = cap
        self.size = 0
        self.text: list[str] = []
        self.calls: dict[int, dict[str, Any]] = {}
        self._last = 0
        self.finish: str | None = None
        self.usage: dict[str, Any] | None = None  # the last usage block seen (cumulative)
        self.tokens = 0  # streamed chunks that carried output, over every choice

    def add(self, data: bytes) -> None:
        if self.size > self.cap:
            return
        self.size += len(data)
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError:
            return
        if isinstance(obj, dict) and isinstance(obj.get("usage"), dict):
            self.usage = obj["usage"]
        choices = obj.get("choices") if isinstance(obj, dict) else None
        for c in choices if isinstance(choices, list) else ():
            if isinstance(c, dict) and _carries_output(c):
                self.tokens += 1
        c0 = _first_choice(choices)
        if c0 is None:
            return
        if isinstance(c0.get("finish_reason"), str):
            self.finish = c0["finish_reason"]
        if isinstance(c0.get("text"), str):
            self.text.append(c0["text"])
        delta = c0.get("delta")
        if not isinstance(delta, dict):
            return
        if isinstance(delta.get("content"), str):
            self.text.append(delta["content"])
        calls = delta.get("tool_calls")
        for call in calls if isinstance(calls, list) else ():
            if isinstance(call, dict):
                self._add_call(call)

    def _add_call(self, call: dict[str, Any]) -> None:
        """One tool-call delta. ``index`` names the call it extends; SGLang's ToolCall.index is optional
        (protocol.py) and some tool parsers stream it as null or leave it out: such a delta extends the
        last call, unless it carries an id not seen yet, which starts the next one."""
        index = call.get("index")
        call_id = call.get("id") if isinstance(call.get("id"), str) else None
        if not isinstance(index, int) or isinstance(index, bool):
            known = call_id is not None and any(s["id"] == call_id for s in self.calls.values())
            if not self.calls:
                index = 0
            elif call_id is not None and not known:
                index = max(self.calls) + 1
            else:
                index = self._last
        self._last = index
        slot = self.calls.setdefault(index, {"id": None, "type": "function",
                                             "function": {"name": "", "arguments": ""}})
        if call_id:
            slot["id"] = call_id
        fn = call.get("function") if isinstance(call.get("function"), dict) else {}
        if isinstance(fn.get("name"), str):
            slot["function"]["name"] += fn["name"]
        if isinstance(fn.get("arguments"), str):
            slot["function"]["arguments"] += fn["arguments"]

    def output(self, route: str) -> str:
        text = "".join(self.text)
        if route == "/v1/completions":
            return text
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if self.calls:
            message["tool_calls"] = [self.calls[i] for i in sorted(self.calls)]
        return chat_output_text(message)


def _first_choice(choices: Any) -> dict[str, Any] | None:
    """The stream's first choice in this chunk: the one with ``index`` 0 (or without an index). With
    ``n > 1`` each chunk carries one choice of any index; only the first sequence is the turn's output."""
    if not isinstance(choices, list):
        return None
    for c in choices:
        if isinstance(c, dict) and c.get("index", 0) in (0, None):
            return c
    return None


def _carries_output(choice: dict[str, Any]) -> bool:
    """A stream chunk's choice that carries output (text, content, reasoning or a tool call delta)."""
    if isinstance(choice.get("text"), str) and choice["text"]:
        return True
    delta = choice.get("delta")
    if not isinstance(delta, dict):
        return False
    return any(isinstance(delta.get(k), str) and delta[k] for k in ("content", "reasoning_content")) or \
        bool(delta.get("tool_calls"))


def _event_data(event: bytes) -> bytes | None:
    lines = [ln[5:].strip() for ln in event.split(b"\n") if ln.startswith(b"data:")]
    return b"\n".join(lines) if lines else None
