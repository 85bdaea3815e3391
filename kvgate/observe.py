"""Reading what a relayed response says about the session, without holding up the relay (pure).

The relay hands every chunk to a ResponseObserver as it passes through. For a JSON response it keeps
the bytes up to a cap; for an SSE stream it keeps only the last complete ``data:`` event, because
SGLang's stream chunks carry cumulative meta_info and output_ids (sglang-engine-api.md, Stream).
At the end ``result()`` gives the last meta_info and output_ids seen.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson


@dataclass
class Observed:
    """meta_info (prompt_tokens, completion_tokens, cached_tokens, finish_reason ...) and output_ids.

    For a batch response, the per-sequence lists are summed into one meta_info.
    """

    meta_info: dict[str, Any] | None = None
    output_ids: list[int] | None = None
    finish_type: str | None = None


def _from_obj(obj: Any) -> Observed:
    if isinstance(obj, list):  # batch /generate answer: one object per sequence
        parts = [_from_obj(o) for o in obj]
        metas = [p.meta_info for p in parts if p.meta_info]
        if not metas:
            return Observed()
        merged = {k: sum(m.get(k, 0) or 0 for m in metas if isinstance(m.get(k, 0), int))
                  for k in ("prompt_tokens", "completion_tokens", "cached_tokens")}
        types = {p.finish_type for p in parts}
        return Observed(merged, None, "abort" if "abort" in types else next(iter(types)))
    if not isinstance(obj, dict):
        return Observed()
    meta = obj.get("meta_info")
    if isinstance(meta, dict):
        fr = meta.get("finish_reason")
        ftype = fr.get("type") if isinstance(fr, dict) else None
        out_ids = obj.get("output_ids")
        return Observed(meta, out_ids if isinstance(out_ids, list) else None, ftype)
    usage = obj.get("usage")  # OpenAI-compatible routes
    if isinstance(usage, dict):
        meta = {"prompt_tokens": usage.get("prompt_tokens", 0),
                "completion_tokens": usage.get("completion_tokens", 0)}
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            meta["cached_tokens"] = details["cached_tokens"]
        ftype = None
        choices = obj.get("choices")
        if isinstance(choices, list) and choices and isinstance(choices[0], dict):
            ftype = choices[0].get("finish_reason")
        return Observed(meta, None, ftype if isinstance(ftype, str) else None)
    return Observed()


class ResponseObserver:
    """Fed the response body chunk by chunk; ``result()`` parses what it kept.

    is_sse: the response is text/event-stream. max_json_bytes: a JSON body larger than this is not
    parsed (its meta_info is skipped, the relay is unaffected).
    """

    def __init__(self, is_sse: bool, max_json_bytes: int = 16 * 1024 * 1024):
        self.is_sse = is_sse
        self.max_json_bytes = max_json_bytes
        self._buf = bytearray()
        self._last_event: bytes | None = None
        self._overflow = False

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
        for event in reversed(complete.split(b"\n\n")):
            data = _event_data(event)
            if data is not None and data != b"[DONE]":
                self._last_event = data
                break

    def result(self) -> Observed:
        """Parse what was kept; never raises (unparsable -> empty Observed)."""
        try:
            if self.is_sse:
                return _from_obj(orjson.loads(self._last_event)) if self._last_event else Observed()
            if self._overflow or not self._buf:
                return Observed()
            return _from_obj(orjson.loads(bytes(self._buf)))
        except orjson.JSONDecodeError:
            return Observed()


def _event_data(event: bytes) -> bytes | None:
    lines = [ln[5:].strip() for ln in event.split(b"\n") if ln.startswith(b"data:")]
    return b"\n".join(lines) if lines else None
