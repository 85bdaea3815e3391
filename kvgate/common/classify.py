"""Request classification: which route a request is, and its JSON body when it has one (pure).

First step of the request path: request in -> classify -> resolve session -> admit -> forward ->
release and record.
"""

from __future__ import annotations

from typing import Any

import orjson

from kvgate.common.prefix_hash import BlockDigests

# Generation routes that carry a top-level session_id in SGLang >= 0.5.15
# (srt/managers/io_struct.py GenerateReqInput; the OpenAI protocol classes accept it too).
GENERATE_ROUTES = frozenset({"/generate", "/v1/completions", "/v1/chat/completions", "/v1/responses"})

# Routes that mark a training-step boundary: the engines' radix cache is flushed or replaced.
STEP_BOUNDARY_ROUTES = frozenset({
    "/update_weights_from_disk", "/update_weights_from_distributed", "/update_weights_from_tensor",
    "/flush_cache", "/release_memory_occupation",
})

# Known routes get their own metrics label; everything else is "other" to bound label cardinality.
KNOWN_ROUTES = GENERATE_ROUTES | STEP_BOUNDARY_ROUTES | frozenset({
    "/health", "/health_generate", "/readiness", "/liveness", "/v1/models", "/get_model_info", "/model_info",
    "/get_server_info", "/server_info", "/workers", "/v1/embeddings", "/v1/rerank", "/close_session",
    "/v1/loads", "/get_loads", "/metrics",
})


_RELEASED = object()  # Classified.body after release_body(): parsed again from the raw bytes on the next read


class Classified:
    """A classified request.

    route: the path if known, else "other" (a metrics label).
    is_generate: a POST to one of GENERATE_ROUTES.
    body: the parsed JSON object when the request is a generate call with a JSON-object body, else None
      (a body that is not a JSON object is forwarded untouched and the upstream answers it).
    raw: the body's bytes, kept so a released body can be parsed again (None: release_body keeps it).
    """

    __slots__ = ("method", "path", "route", "is_generate", "_body", "raw", "_digests")

    def __init__(self, method: str, path: str, route: str, is_generate: bool, body: dict[str, Any] | None,
                 raw: bytes | None = None) -> None:
        self.method, self.path, self.route, self.is_generate = method, path, route, is_generate
        self._body = body
        self.raw = raw
        self._digests: BlockDigests | None = None

    def block_digests(self) -> BlockDigests:
        """This request's prompt block hashes, shared by every reader of its parsed body (admission's prefix
        blocks, placement's prefix keys): the prompt is hashed once."""
        if self._digests is None:
            self._digests = BlockDigests()
        return self._digests

    @property
    def body(self) -> dict[str, Any] | None:
        if self._body is _RELEASED:
            self._body = parse_json_object(self.raw)
        return self._body  # type: ignore[return-value]

    @body.setter
    def body(self, value: dict[str, Any] | None) -> None:
        self._body = value

    def release_body(self) -> None:
        """Drop the parsed body while the request waits (a 64K-token prompt parsed is ~2.3 MB of int objects,
        its raw bytes 0.4 MB); it is parsed again from ``raw`` when next read. No-op without raw bytes."""
        if self._body is not None and self.raw is not None:
            self._body = _RELEASED
            self._digests = None  # it holds the parsed prompt

    def __repr__(self) -> str:
        return (f"Classified(method={self.method!r}, path={self.path!r}, route={self.route!r}, "
                f"is_generate={self.is_generate!r}, body={self.body!r})")


def route_label(path: str) -> str:
    """Return ``path`` when it is a known route, else "other"."""
    return path if path in KNOWN_ROUTES else "other"


def parse_json_object(raw: bytes) -> dict[str, Any] | None:
    """Parse ``raw`` as a JSON object; None when it is empty, not JSON, or not an object."""
    if not raw:
        return None
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    return obj if isinstance(obj, dict) else None


def classify(method: str, path: str, raw_body: bytes, parse: bool = True) -> Classified:
    """Classify a request from its method, path and raw body bytes. Never raises on bad bodies.

    parse=False leaves ``body`` None (the caller decides whether the body is worth parsing).
    """
    is_generate = method == "POST" and path in GENERATE_ROUTES
    body = parse_json_object(raw_body) if is_generate and parse else None
    keep = raw_body if is_generate and isinstance(raw_body, (bytes, bytearray)) else None  # for release_body
    return Classified(method, path, route_label(path), is_generate, body, keep)


def inject_top_level(raw: bytes, key: str, value: str | int) -> bytes:
    """Return ``raw`` (a JSON object's bytes) with ``"key": value`` added as its first member.

    Everything else stays byte-for-byte as the client sent it (no re-serialisation, so numbers,
    key order and whitespace are preserved and a 512 MiB body costs one copy). The caller has
    checked that ``raw`` parses to an object without ``key``. Raises ValueError if ``raw`` has no "{".
    """
    start = raw.index(b"{")
    rest = raw[start + 1:]
    member = orjson.dumps(key) + b":" + orjson.dumps(value)
    sep = b"" if rest.lstrip().startswith(b"}") else b","
    return raw[:start + 1] + member + sep + rest


def with_session_id(raw: bytes, body: dict[str, Any], session_id: str) -> bytes | None:
    """Return the request body carrying ``session_id`` at the top level, or None to send ``raw`` unchanged.

    None when the body already carries that id, or when it uses the older ``session_params`` API
    (SGLang answers 400 "session_id and session_params cannot both be set.", io_struct.py).
    A body without the key gets it injected byte-preserving; a body with another value under the
    key is re-serialised (inserting would leave a duplicate key whose last copy wins).
    """
    if "session_params" in body or body.get("session_id") == session_id:
        return None
    if "session_id" in body:
        return orjson.dumps({**body, "session_id": session_id})
    return inject_top_level(raw, "session_id", session_id)
