"""What the simulated SGLang engine accepts in a request, and how it refuses the rest (pure checks, and the
JSON answers the HTTP surface in kvgate.sim.http_api sends).

Field names and error shapes follow SGLang's srt/entrypoints/http_server.py and
srt/sampling/sampling_params.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import orjson
from aiohttp import web

# srt/sampling/sampling_params.py SamplingParams.__init__ arguments
SAMPLING_KEYS = frozenset({
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k",
    "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens",
    "n", "json_schema", "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens",
    "spaces_between_special_tokens", "no_stop_trim", "custom_params", "stream_interval",
    "logit_bias", "sampling_seed",
})


class HTTPError(Exception):
    """Maps to an HTTP error response with SGLang's {"error":{"message":...}} body."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


class ValidationError(HTTPError):
    """A request field of the wrong type: SGLang's HTTP server answers pydantic's error list in its OpenAI error
    shape, 400 (srt/entrypoints/http_server.py's validation handler; [CPU 0.5.23] on /generate and the OpenAI
    routes alike)."""

    def __init__(self, field: str, kind: str, msg: str, value: Any):
        detail = {"type": kind, "loc": ("body", field), "msg": msg, "input": value}
        super().__init__(400, f"1 validation error:\n  {detail!r}")

    def body(self) -> dict:
        return {"object": "error", "message": self.message, "type": "Bad Request", "param": None, "code": 400}


def _check_session_id(body: dict) -> None:
    """A top-level session_id must be a string or null (protocol.py and io_struct.py: Optional[str]); kvgate's
    session_id probe relies on this answer. Raises ValidationError."""
    sid = body.get("session_id")
    if sid is not None and not isinstance(sid, str):
        raise ValidationError("session_id", "string_type", "Input should be a valid string", sid)


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


def _err(status: int, message: str) -> web.Response:
    return _json({"error": {"message": message}}, status)


async def _body(request: web.Request) -> dict:
    raw = await request.read()
    if not raw:
        return {}
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise HTTPError(400, f"Invalid JSON body: {e}")
    if not isinstance(data, dict):
        raise HTTPError(400, "Request body must be a JSON object")
    return data


async def _params(request: web.Request) -> dict:
    """GET query args merged with a JSON body (for GET/POST endpoints)."""
    out = dict(request.query)
    if request.can_read_body:
        out.update(await _body(request))
    return out


@dataclass
class GenSpec:
    """One normalised generate request."""

    input_ids: list
    max_new_tokens: int
    ignore_eos: bool
    rid: Optional[str]
    session_id: Optional[str]
    priority: int
    dp_rank: Optional[int]
    legacy_session: Optional[dict] = None
    temperature: float = 1.0
    sampling_seed: Optional[int] = None
    kv_transferred: bool = False   # PD decode: the prompt's KV came from a prefill worker


def _check_sampling(sp: Any) -> dict:
    if sp is None:
        return {}
    if not isinstance(sp, dict):
        raise HTTPError(400, "sampling_params must be an object")
    bad = sorted(k for k in sp if k not in SAMPLING_KEYS)
    if bad:
        raise HTTPError(400, f"SamplingParams.__init__() got an unexpected keyword argument "
                             f"'{bad[0]}'")
    mnt = sp.get("max_new_tokens", 128)
    if mnt is None:
        mnt = 128
    if not isinstance(mnt, int) or isinstance(mnt, bool) or mnt < 0:
        raise HTTPError(400, "max_new_tokens must be a non-negative integer")
    _sampling(sp.get("temperature"), sp.get("top_k"), sp.get("sampling_seed"))
    return sp


def _parallel_n(n: Any) -> int:
    """The number of samples a request asks for (``sampling_params.n`` or OpenAI ``n``): an int; below 2 means one
    sample, as in io_struct.py GenerateReqInput._handle_parallel_sampling, which only expands when n > 1. Raises
    HTTPError 400 on a non-integer."""
    if n is None:
        return 1
    if isinstance(n, bool) or not isinstance(n, int):
        raise HTTPError(400, "n must be an integer")
    return max(n, 1)


def _sampling(temperature: Any, top_k: Any, seed: Any) -> tuple[float, Optional[int]]:
    """(temperature, sampling_seed) of a request; temperature 0 means greedy. SGLang
    sampling/sampling_params.py: temperature defaults to 1.0, and a temperature below 1e-6 or top_k 1 is
    greedy (top_k becomes 1). Raises HTTPError 400 on a bad type or a negative temperature."""
    t = 1.0 if temperature is None else temperature
    if isinstance(t, bool) or not isinstance(t, (int, float)) or t < 0:
        raise HTTPError(400, "temperature must be a non-negative number")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise HTTPError(400, "sampling_seed must be an integer")
    if t < 1e-6 or top_k == 1:
        t = 0.0
    return float(t), seed
