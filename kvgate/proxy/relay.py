"""Relaying one request to the upstream router and its response back, chunk by chunk (I/O edge).

Hop-by-hop headers are dropped both ways (RFC 9110 section 7.6.1); everything else passes as is,
byte for byte (header values that are not UTF-8 included: the request head is built from the raw bytes
the client sent, see forward_head, and kvgate's own server writes the upstream's response header bytes as
they came, see _response_lines). aiohttp writes the heads on its paths (``http_server: aiohttp``, https
upstreams): there a header byte that is not UTF-8 is dropped, as aiohttp does. The upstream client
(kvgate.proxy.connection_pool for http upstreams, aiohttp's for https) never decompresses, so bodies and
Content-Encoding pass through untouched. A response whose body is all there with its head goes to the client
in one write; others are
streamed chunk by chunk as they arrive (SSE). An upstream that
breaks HTTP (bad status line, bad Content-Length, bad chunk) is answered 502 naming it; a response
observer that raises is switched off for that response and never stops the bytes.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import re
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Iterable, Mapping

import aiohttp
import orjson
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from multidict import CIMultiDict
from yarl import URL

from kvgate.proxy import server
from kvgate.proxy.connection_pool import ConnectFailed, ConnectionPool, Disconnected, Exchange, ResponseError
from kvgate.proxy.wire import safe_header
from kvgate.sessions.observe import ResponseObserver

log = logging.getLogger("kvgate.proxy.relay")

HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection", "te",
    "trailer", "trailers", "transfer-encoding", "upgrade",
})
# Recomputed by the HTTP layer on the way out. Expect: kvgate has already answered the client's
# "100-continue" and read the whole body; passed on, it would make the upstream request wait for a
# 100 Continue the upstream need not send.
# X-Kvgate-Admin-Key: kvgate's own credential (docs/guarantees.md), never sent on to the router or an engine.
_RECOMPUTED_REQUEST = frozenset({"host", "content-length", "expect", "x-kvgate-admin-key"})

# Header limits no lower than the router's (kvgate.proxy.server says where they come from).
from kvgate.proxy.server import MAX_FIELD_BYTES, MAX_LINE_BYTES  # noqa: E402

# A body larger than this goes to the upstream in pieces of this size, so the event loop serves other
# clients between pieces (one write of 66 MB held it for a third of a second).
SEND_PIECE_BYTES = 1 << 20

# aiohttp's IDEMPOTENT_METHODS: resent once on a pooled connection found closed (see relay()).
_RETRIED_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "TRACE", "PUT", "DELETE"})

# What the upstream failing HTTP looks like from aiohttp's client: a parse error of the status line,
# headers or body framing, a payload error, or a response aiohttp could not read.
_PROTOCOL_ERRORS = (HttpProcessingError, aiohttp.ClientResponseError, aiohttp.ClientPayloadError, ValueError)


def _without_hop_by_hop(headers: Mapping[str, str], drop: frozenset = frozenset()) -> CIMultiDict:
    """``headers`` less hop-by-hop ones, those the Connection header names, and ``drop`` (lower-case)."""
    named = {h.strip().lower() for h in headers.get("Connection", "").split(",") if h.strip()}
    out = CIMultiDict()
    for k, v in headers.items():
        lk = k.lower()
        if lk in HOP_BY_HOP or lk in named or lk in drop:
            continue
        out.add(k, v)
    return out


def forward_headers(headers: Mapping[str, str], extra: Mapping[str, str] | None = None) -> CIMultiDict:
    """Request headers for the upstream: hop-by-hop, Host and Content-Length removed, ``extra`` set."""
    out = _without_hop_by_hop(headers, _RECOMPUTED_REQUEST)
    for k, v in (extra or {}).items():
        out[k] = v
    return out


def response_headers(headers: Mapping[str, str]) -> CIMultiDict:
    """Upstream response headers to relay: hop-by-hop removed (Content-Length kept)."""
    return _without_hop_by_hop(headers)


_DROP_REQUEST_BYTES = frozenset(h.encode() for h in HOP_BY_HOP | _RECOMPUTED_REQUEST)
_HOP_BY_HOP_BYTES = frozenset(h.encode() for h in HOP_BY_HOP)


def _connection_named(raw_headers: Iterable[tuple[bytes, bytes]]) -> frozenset:
    named = set()
    for k, v in raw_headers:
        if k.lower() == b"connection":
            named.update(t.strip().lower() for t in v.split(b",") if t.strip())
    return frozenset(named)


def forward_head(raw_headers: Iterable[tuple[bytes, bytes]], extra: Mapping[str, str] | None = None) -> bytes:
    """The request's header lines for the upstream, as bytes (``Name: value\\r\\n`` each): what
    forward_headers() keeps, from the raw header bytes the client sent (so bytes that are not UTF-8 pass
    unchanged), in the client's order; then ``extra``, which replaces headers of the same name."""
    drop = _DROP_REQUEST_BYTES
    extra_lines = b""
    if extra:
        drop = drop | {k.lower().encode("ascii") for k in extra}
        check = safe_header
        extra_lines = "".join(f"{check(k)}: {check(v)}\r\n" for k, v in extra.items()).encode("utf-8", "surrogateescape")
    out = []
    connection = False
    for k, v in raw_headers:
        lk = k.lower()
        if lk in drop:
            connection = connection or lk == b"connection"
            continue
        out += (k, b": ", v, b"\r\n")
    named = _connection_named(raw_headers) - drop if connection else None
    if named:  # rare: the headers a Connection header names are hop-by-hop too; filter again
        drop = drop | named
        out = []
        for k, v in raw_headers:
            if k.lower() not in drop:
                out += (k, b": ", v, b"\r\n")
    out.append(extra_lines)
    return b"".join(out)


def _head_from_multidict(headers: Mapping[str, str]) -> bytes:
    return server.header_lines(headers.items())


def _multidict_from_head(fields: bytes) -> CIMultiDict:
    out = CIMultiDict()
    for line in fields.split(b"\r\n"):
        if line:
            k, _, v = line.partition(b": ")
            out.add(k.decode("ascii"), v.decode("utf-8", "surrogateescape"))
    return out


def _response_fields(raw: list[tuple[bytes, bytes]]) -> tuple[CIMultiDict, bytes, bool]:
    """Upstream response header bytes -> (headers to relay: hop-by-hop removed, Content-Length kept, values
    decoded as aiohttp does, with surrogateescape; the Content-Type bytes; whether Content-Encoding is set)."""
    named = _connection_named(raw)
    ctype = b""
    encoded = False
    keep = []
    for k, v in raw:
        lk = k.lower()
        if lk in _HOP_BY_HOP_BYTES or lk in named:
            continue
        if lk == b"content-type":
            if not ctype:
                ctype = v
        elif lk == b"content-encoding":
            encoded = True
        keep.append((k.decode("latin-1"), v.decode("utf-8", "surrogateescape")))
    return CIMultiDict(keep), ctype, encoded


#: The response header names dropped for each set of names kvgate adds (admission, session): made once per set.
_REPLACED: dict[tuple[str, ...], frozenset[bytes]] = {}


def _response_lines(raw: list[tuple[bytes, bytes]], add_headers) -> tuple[bytes, bool, bytes, bool]:
    """For kvgate's own server: the upstream's response header lines to relay, as bytes (hop-by-hop and
    those ``add_headers`` replace removed; the rest byte for byte, in the upstream's order), then
    ``add_headers``. Returns (lines, whether a Content-Length is among them, the Content-Type bytes,
    whether Content-Encoding is set)."""
    replaced = _HOP_BY_HOP_BYTES
    extra = b""
    if add_headers:
        names = tuple([k for k, _ in add_headers])
        replaced = _REPLACED.get(names)
        if replaced is None:
            replaced = _HOP_BY_HOP_BYTES | {k.lower().encode("latin-1") for k in names}
            if len(_REPLACED) < 64:  # kvgate's own header sets: a handful
                _REPLACED[names] = replaced
        extra = server.header_lines(add_headers)
    ctype = b""
    encoded = has_length = False
    out = []
    named = None
    for k, v in raw:
        lk = k.lower()
        if lk in replaced:
            if lk == b"connection" and v.lower() != b"keep-alive":
                # Only names not dropped anyway matter (a "Connection: keep-alive" names none).
                named = (named or set()) | ({t.strip().lower() for t in v.split(b",")} - replaced - {b""})
            continue
        if lk == b"content-type":
            if not ctype:
                ctype = v
        elif lk == b"content-length":
            has_length = True
        elif lk == b"content-encoding":
            encoded = True
        out += (k, b": ", v, b"\r\n")
    if named:  # rare: the headers a Connection header names are hop-by-hop too; filter again
        out = []
        for k, v in raw:
            if k.lower() not in named and k.lower() not in replaced:
                out += (k, b": ", v, b"\r\n")
        has_length = has_length and b"content-length" not in named
    out.append(extra)
    return b"".join(out), has_length, ctype, encoded


class _OneWriteResponse(web.StreamResponse):
    """A StreamResponse whose head is written with its first body bytes (one write for a small answer)."""

    _send_headers_immediately = False


# A value that can go into a header as it is: visible ASCII, inner spaces, at most 256 characters.
_HEADER_SAFE = re.compile(r"[\x21-\x7e](?:[\x20-\x7e]{0,254}[\x21-\x7e])?")


def _header_value(raw: list[tuple[bytes, bytes]], name: bytes) -> str | None:
    """The first value of header ``name`` (lower-case bytes) in raw (name, value) pairs, as text, or None."""
    for k, v in raw:
        if k.lower() == name:
            return v.decode("latin-1")
    return None


def header_safe(value: str) -> str:
    """``value`` made fit for an HTTP header: unchanged when it is visible ASCII of at most 256 characters,
    else ``sha256:`` and the first 32 hex digits of the SHA-256 of its UTF-8 bytes. Stable (the same id
    always gives the same value, so smg's consistent hashing keeps one session on one engine), never raises.

    A session id is data from the client: a newline or control character in it must not decide whether
    the request goes out (aiohttp refuses such headers), nor may a 10 MB id hit a header size limit.
    """
    if _HEADER_SAFE.fullmatch(value):
        return value
    return "sha256:" + hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def error_response(status: int, message: str, kind: str, upstream: str) -> web.Response:
    """A kvgate-made JSON error in SGLang's error shape, naming the upstream."""
    body = {"error": {"message": message, "type": kind, "code": status, "upstream": upstream}}
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json",
                        headers={"X-Kvgate-Error": kind})


#: smg 1.13's response header naming the worker that served a call (in a PD fleet: the decode worker)
ROUTED_WORKER = b"x-smg-routed-worker-id"


def no_worker_picked(status: int, headers: list[tuple[bytes, bytes]]) -> bool:
    """smg's answer when its policy picked no worker (503 with X-SMG-Error-Code: no_available_workers, e.g. a
    named index it does not count): nothing was sent to a worker, so the call may go again. For relay()'s
    ``hold``."""
    return status == 503 and (_header_value(headers, b"x-smg-error-code") or "").strip() == "no_available_workers"


@dataclass
class RelayOutcome:
    """What happened: upstream status (None if it never answered), what the observer saw, and why it ended."""

    status: int | None
    observer: ResponseObserver | None
    # "complete" | "upstream_error" | "client_gone" | "unreachable" | "timeout" | "protocol_error" | "held"
    ended: str
    # False only when the connection was never made, so no byte of the request went out (safe to resend).
    sent: bool = True
    observer_fault: bool = False  # the observer raised; it was switched off, the bytes went on
    # the value of the response header relay() was asked to read (worker_header), e.g. smg 1.13's
    # x-smg-routed-worker-id: the worker the router sent the call to
    routed_worker: str | None = None


class Upstream:
    """The pooled client to the router (and to engines kvgate places sessions on). ``close()`` it on shutdown.

    base: router base URL; connect_timeout_s / read_timeout_s (0 = no read timeout) in seconds; pool_size:
    most upstream connections in use at once (0 = no limit). Plain-http upstreams go through kvgate's own
    HTTP/1.1 pool (kvgate.proxy.connection_pool: pre-built request heads, httptools parsing); others (https) through
    aiohttp's client, with the same guarantees.
    """

    def __init__(self, base: str, connect_timeout_s: float, read_timeout_s: float, pool_size: int = 0):
        self.base = base.rstrip("/")
        self.timeout = aiohttp.ClientTimeout(total=None, connect=connect_timeout_s,
                                             sock_read=read_timeout_s or None)
        self._pool_size = pool_size
        self._session: aiohttp.ClientSession | None = None
        self._observer_fault_logged = False
        self.pool = ConnectionPool(connect_timeout_s, read_timeout_s, pool_size)
        # base URL -> (path prefix bytes, "Host: ...\r\n" bytes), or None for a base the pool cannot serve
        self._targets: dict[str, tuple[bytes, bytes] | None] = {}

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self._pool_size, ttl_dns_cache=300),
                timeout=self.timeout, auto_decompress=False,
                # Transparent: add no headers the client did not send.
                skip_auto_headers=("User-Agent", "Accept-Encoding", "Accept", "Content-Type"),
                max_line_size=MAX_LINE_BYTES, max_field_size=MAX_FIELD_BYTES,
            )
        return self._session

    async def close(self) -> None:
        self.pool.close()
        if self._session is not None:
            await self._session.close()

    def can_hold(self) -> bool:
        """Whether relay() honours ``hold`` for the router (a plain-http router: kvgate's own pool)."""
        return self._target(self.base) is not None

    def _target(self, base: str) -> tuple[bytes, bytes] | None:
        """(path prefix, Host header line) for a plain-http ``base``; None for others (aiohttp serves them)."""
        try:
            return self._targets[base]
        except KeyError:
            pass
        url = URL(base)
        target = None
        if url.scheme == "http" and url.raw_host and not url.user:
            port = url.port or 80
            host = url.raw_host if ":" not in url.raw_host else f"[{url.raw_host}]"
            host_value = host if url.explicit_port is None else f"{host}:{port}"
            self.pool.set_address(base, url.raw_host, port)
            target = (url.raw_path.rstrip("/").encode("ascii"), f"Host: {host_value}\r\n".encode("ascii"))
        self._targets[base] = target
        return target

    async def relay(self, request: web.Request, path_qs: str, headers: CIMultiDict | bytes, body: bytes | BodyParts,
                    observe: Callable[[bool], ResponseObserver] | None, add_headers: Iterable[tuple[str, str]] = (),
                    on_headers: Callable[[int], None] | None = None,
                    base: str | None = None, worker_header: bytes | None = None,
                    hold: Callable[[int, list], bool] | None = None) -> tuple[web.StreamResponse, RelayOutcome]:
        """Send ``body`` to base+``path_qs`` and stream the answer to ``request``'s client.

        headers: the request headers to send, as forward_head() bytes or a forward_headers() multidict.
        base: another base URL than the router's (an engine kvgate placed a session on); same pool.
        worker_header: a response header name (lower-case bytes) whose value goes to outcome.routed_worker.
        hold: a test of the answer's status and raw header pairs; an answer it holds is not sent to the
        client (the caller sends the call again): the outcome's ``ended`` is "held" and the response None.
        Honoured for plain-http upstreams only (see can_hold()).

        observe: None, or a factory (is_sse -> ResponseObserver) for responses kvgate reads as they pass.
        Returns the response object (already prepared and finished, or an error Response to return)
        and the outcome. When the client goes away the handler is cancelled (handler_cancellation)
        or a write fails: either way the upstream connection is closed, which cancels the upstream request.
        """
        base = base or self.base
        target = self._target(base)
        if target is None:
            if isinstance(headers, bytes):
                headers = _multidict_from_head(headers)
            seen: list[str | None] | None = [] if worker_header is not None else None
            resp, outcome = await self._relay_aiohttp(request, path_qs, headers, body, observe, add_headers,
                                                      on_headers, base, worker_header, seen)
            if seen:
                outcome.routed_worker = seen[0]
            return resp, outcome
        method = request.method
        fields = headers if isinstance(headers, bytes) else _head_from_multidict(headers)
        size = len(body)
        # The raw path and query, not re-encoded: what the client sent is what the upstream gets.
        head = b"".join((method.encode("ascii"), b" ", target[0], path_qs.encode("utf-8", "surrogateescape"),
                         b" HTTP/1.1\r\n", target[1], fields, b"Content-Length: %d\r\n\r\n" % size))
        streamed = isinstance(body, BodyStream)
        retry = method in _RETRIED_METHODS and not streamed  # a body sent as it arrives cannot be sent twice
        if retry and not isinstance(body, bytes):
            body = b"".join(body.parts)  # resent once when a pooled connection turns out closed: must be whole
        # A response that arrives whole is answered from the connection's data callback, at once.
        answer = functools.partial(self._answer_arrived, request, path_qs, observe, add_headers) \
            if on_headers is None and hold is None and type(request) is server.Request else None
        try:
            up = await self.pool.exchange(base, head, body if isinstance(body, bytes) else
                                          body.pieces if streamed else body.parts, size,
                                          method, retry, SEND_PIECE_BYTES, answer)
        except asyncio.TimeoutError:
            return self._error(504, f"kvgate: upstream {base} timed out", "upstream_timeout", base,
                               RelayOutcome(None, None, "timeout"), add_headers)
        except ConnectFailed as exc:
            return self._error(502, f"kvgate: upstream {base} unreachable: {exc}", "upstream_unreachable", base,
                               RelayOutcome(None, None, "unreachable", sent=False), add_headers)
        except (Disconnected, OSError) as exc:
            return self._error(502, f"kvgate: upstream {base} unreachable: {exc}", "upstream_unreachable", base,
                               RelayOutcome(None, None, "unreachable"), add_headers)
        except ResponseError as exc:
            # The upstream answered something that is not HTTP/1.1 (bad status line, bad Content-Length,
            # bad chunk framing, a body on a 204 ...): its fault, so a 502 naming it, never a 500.
            log.warning("upstream %s broke HTTP answering %s: %s", base, path_qs, exc)
            return self._error(502, f"kvgate: upstream {base} sent a malformed response: {exc}",
                               "upstream_protocol_error", base, RelayOutcome(None, None, "protocol_error"),
                               add_headers)
        try:
            early = up.early
            if early is not None:
                if isinstance(early, Exception):  # raised answering from the data callback, nothing sent
                    raise early
                out = None, early
            elif hold is not None and hold(up.status, up.headers):
                out = None, RelayOutcome(up.status, None, "held")
            else:
                out = await self._stream(request, path_qs, up, observe, add_headers, on_headers, base)
            if worker_header is not None:
                out[1].routed_worker = _header_value(up.headers, worker_header)
            return out
        finally:
            up.release()

    async def _stream(self, request: web.Request, path_qs: str, up: Exchange, observe, add_headers, on_headers,
                      base: str) -> tuple[web.StreamResponse, RelayOutcome]:
        """Relay the response whose head ``up`` holds to ``request``'s client."""
        status = up.status
        if isinstance(up.failed, ResponseError):  # broken before a byte went to the client: still a clean 502
            log.warning("upstream %s broke HTTP answering %s: %s", base, path_qs, up.failed)
            return self._error(502, f"kvgate: upstream {base} sent a malformed response: {up.failed}",
                               "upstream_protocol_error", base, RelayOutcome(None, None, "protocol_error"),
                               add_headers)
        if on_headers is not None:
            on_headers(status)
        if type(request) is server.Request:
            return await self._stream_own(request, path_qs, up, observe, add_headers, base)
        out_headers, ctype, encoded = _response_fields(up.headers)
        for k, v in add_headers:
            out_headers[k] = v
        observer, fault = self._observer(observe, ctype, encoded, path_qs)
        reason = up.reason.decode("utf-8", "surrogateescape") or None
        if up.complete:
            # The whole body is here: head and body go to the client in one write.
            chunk = await up.read()
            resp = _OneWriteResponse(status=status, reason=reason, headers=out_headers)
            if chunk and observer is not None:
                observer, fault = self._feed(observer, fault, chunk, path_qs)
            try:
                await resp.prepare(request)
                await resp.write_eof(chunk)
            except (ConnectionResetError, aiohttp.ClientConnectionResetError):
                return resp, RelayOutcome(status, observer, "client_gone", observer_fault=fault)
            return resp, RelayOutcome(status, observer, "complete", observer_fault=fault)
        resp = web.StreamResponse(status=status, reason=reason, headers=out_headers)
        await resp.prepare(request)
        return resp, await self._relay_rest(up, observer, fault, status, base, path_qs, resp.write, resp.write_eof,
                                            request, (ConnectionResetError, aiohttp.ClientConnectionResetError))

    async def _stream_own(self, request: server.Request, path_qs: str, up: Exchange, observe, add_headers,
                          base: str) -> tuple[None, RelayOutcome]:
        """_stream() for kvgate's own server: the head is written from the upstream's header bytes, with no
        header objects. Returns (None: answered on the connection, outcome)."""
        if up.complete:
            return None, self._answer_whole(request, path_qs, up, observe, add_headers)
        status = up.status
        lines, has_length, ctype, encoded = _response_lines(up.headers, add_headers)
        observer, fault = self._observer(observe, ctype, encoded, path_qs)
        try:
            request.start(status, up.reason, lines, has_length)
        except ConnectionResetError:
            return None, RelayOutcome(status, observer, "client_gone", observer_fault=fault)
        return None, await self._relay_rest(up, observer, fault, status, base, path_qs, request.write,
                                            request.write_eof, request, ConnectionResetError)

    def _answer_whole(self, request: server.Request, path_qs: str, up, observe, add_headers) -> RelayOutcome:
        """Answer ``request`` with ``up``'s response, all of which has arrived (an Exchange, or the pool's
        connection itself from its data callback: ``status``, ``reason``, ``headers``, ``take()``): head and
        body in one write."""
        status = up.status
        lines, has_length, ctype, encoded = _response_lines(up.headers, add_headers)
        observer, fault = self._observer(observe, ctype, encoded, path_qs)
        chunk = up.take()
        if chunk and observer is not None:
            observer, fault = self._feed(observer, fault, chunk, path_qs)
        try:
            request.answer(status, up.reason, lines, chunk, has_length)
        except ConnectionResetError:
            return RelayOutcome(status, observer, "client_gone", observer_fault=fault)
        return RelayOutcome(status, observer, "complete", observer_fault=fault)

    def _answer_arrived(self, request: server.Request, path_qs: str, observe, add_headers,
                        up) -> RelayOutcome | Exception:
        """_answer_whole() from the pool's data callback (ConnectionPool.exchange's on_complete): never raises. An
        error before anything was written is returned, for the relay's coroutine to raise where the handler
        would have (the server answers 500, as for any handler error); one after the answer went out is
        logged, and the answer stands."""
        try:
            return self._answer_whole(request, path_qs, up, observe, add_headers)
        except Exception as exc:
            if not request.sent:
                return exc
            log.exception("answering %s from the upstream's data callback failed after the answer", path_qs)
            return RelayOutcome(up.status, None, "complete")

    def _observer(self, observe, ctype: bytes, encoded: bool, path_qs: str) -> tuple[ResponseObserver | None, bool]:
        """(the response's observer or None, whether making it failed): none for an encoded body (kvgate
        never decompresses), and a failing factory never touches the response."""
        if observe is None or encoded:
            return None, False
        try:
            return observe(ctype.startswith(b"text/event-stream")), False
        except Exception as exc:
            return None, self._observer_fault(exc, path_qs)

    async def _relay_rest(self, up: Exchange, observer, fault: bool, status: int, base: str, path_qs: str,
                          write, write_eof, request, gone) -> RelayOutcome:
        """Stream the rest of ``up``'s body to the client whose head went out already: ``write(chunk)`` and
        ``write_eof()`` (coroutines) on either server's response; ``gone``: the exceptions that mean the
        client left; ``request``: whose connection is cut when the upstream cuts the body."""
        while True:
            try:
                chunk = await up.read()
            except (ResponseError, asyncio.TimeoutError) as exc:
                # Upstream cut or broke the body mid-way: the client sees the cut too (no fake completion).
                log.warning("upstream %s cut the response to %s mid-way: %s", base, path_qs, exc)
                _abort_client(request)
                return RelayOutcome(status, observer, "upstream_error", observer_fault=fault)
            if not chunk:
                break
            if observer is not None:
                observer, fault = self._feed(observer, fault, chunk, path_qs)
            try:
                await write(chunk)
            except gone:
                return RelayOutcome(status, observer, "client_gone", observer_fault=fault)
        try:
            await write_eof()
        except gone:
            return RelayOutcome(status, observer, "client_gone", observer_fault=fault)
        return RelayOutcome(status, observer, "complete", observer_fault=fault)

    @staticmethod
    def _error(status: int, message: str, kind: str, base: str, outcome: RelayOutcome,
               add_headers: Iterable[tuple[str, str]]) -> tuple[web.Response, RelayOutcome]:
        err = error_response(status, message, kind, base)
        for k, v in add_headers:  # the admission decision is reported on kvgate's own errors too
            err.headers[k] = v
        return err, outcome

    async def _relay_aiohttp(self, request: web.Request, path_qs: str, headers: CIMultiDict, body: bytes | BodyParts,
                             observe, add_headers, on_headers, base: str, worker_header: bytes | None = None,
                             seen: list | None = None) -> tuple[web.StreamResponse, RelayOutcome]:
        """relay() through aiohttp's client: for upstreams the pool does not serve (https)."""
        # The raw path and query, not re-encoded: what the client sent is what the router gets.
        url = URL(base + path_qs, encoded=True)
        data: bytes | AsyncIterator[bytes | memoryview] = body
        if request.method in _RETRIED_METHODS and not isinstance(body, BodyStream):
            # aiohttp resends these once when a pooled connection turns out closed (RFC 9112 9.3.1): the
            # body must be bytes it can send again, not pieces already consumed.
            data = body if isinstance(body, bytes) else b"".join(body.parts)
        elif isinstance(body, (BodyParts, BodyStream)) or len(body) > SEND_PIECE_BYTES:
            headers = CIMultiDict(headers)
            headers["Content-Length"] = str(len(body))  # so the pieces are not sent chunked
            data = _pieces(body)
        resp: web.StreamResponse | None = None
        observer = None
        fault = False
        try:
            async with self.session.request(request.method, url, headers=headers, data=data,
                                            allow_redirects=False) as up:
                if seen is not None:
                    seen.append(up.headers.get(worker_header.decode("latin-1")))
                if on_headers is not None:
                    on_headers(up.status)
                out_headers = response_headers(up.headers)
                for k, v in add_headers:
                    out_headers[k] = v
                ctype = up.headers.get("Content-Type", "")
                if observe is not None and "Content-Encoding" not in up.headers:
                    try:
                        observer = observe(ctype.startswith("text/event-stream"))
                    except Exception as exc:
                        fault = self._observer_fault(exc, path_qs)
                make = server.StreamResponse if type(request) is server.Request else web.StreamResponse
                resp = make(status=up.status, reason=up.reason, headers=out_headers)
                await resp.prepare(request)
                chunks = up.content.iter_any()
                while True:
                    try:
                        chunk = await chunks.__anext__()
                    except StopAsyncIteration:
                        break
                    except (*_PROTOCOL_ERRORS, aiohttp.ClientConnectionError, asyncio.TimeoutError) as exc:
                        # Upstream cut or broke the body mid-way: the client sees the cut too (no fake completion).
                        log.warning("upstream %s cut the response to %s mid-way: %s", base, path_qs, exc)
                        _abort_client(request)
                        return resp, RelayOutcome(up.status, observer, "upstream_error", observer_fault=fault)
                    if observer is not None:
                        observer, fault = self._feed(observer, fault, chunk, path_qs)
                    try:
                        await resp.write(chunk)
                    except (ConnectionResetError, aiohttp.ClientConnectionResetError):
                        return resp, RelayOutcome(up.status, observer, "client_gone", observer_fault=fault)
                try:
                    await resp.write_eof()
                except (ConnectionResetError, aiohttp.ClientConnectionResetError):
                    return resp, RelayOutcome(up.status, observer, "client_gone", observer_fault=fault)
                return resp, RelayOutcome(up.status, observer, "complete", observer_fault=fault)
        except asyncio.TimeoutError:
            err = error_response(504, f"kvgate: upstream {base} timed out", "upstream_timeout", base)
            outcome = RelayOutcome(None, None, "timeout", observer_fault=fault)
        except (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
            err = error_response(502, f"kvgate: upstream {base} unreachable: {exc}", "upstream_unreachable", base)
            outcome = RelayOutcome(None, None, "unreachable", sent=not isinstance(exc, aiohttp.ClientConnectorError),
                                   observer_fault=fault)
        except (*_PROTOCOL_ERRORS, aiohttp.ClientError) as exc:
            # The upstream answered something that is not HTTP/1.1 (bad status line, bad Content-Length,
            # bad chunk framing, a body on a 204 ...): its fault, so a 502 naming it, never a 500.
            log.warning("upstream %s broke HTTP answering %s: %s: %s", base, path_qs, type(exc).__name__, exc)
            if resp is not None and resp.prepared:  # headers already relayed: cut, as for a cut body
                _abort_client(request)
                return resp, RelayOutcome(resp.status, observer, "upstream_error", observer_fault=fault)
            err = error_response(502, f"kvgate: upstream {base} sent a malformed response: {type(exc).__name__}",
                                 "upstream_protocol_error", base)
            outcome = RelayOutcome(None, None, "protocol_error", observer_fault=fault)
        for k, v in add_headers:  # the admission decision is reported on kvgate's own errors too
            err.headers[k] = v
        return err, outcome

    def _feed(self, observer: ResponseObserver, fault: bool, chunk: bytes, path_qs: str):
        """Feed ``chunk`` to the response observer. Returns (observer, fault): the observer switched off
        (None) and fault True when it raised; the relay never depends on what an observer makes of a chunk."""
        try:
            observer.feed(chunk)
            return observer, fault
        except Exception as exc:
            return None, self._observer_fault(exc, path_qs)

    def _observer_fault(self, exc: Exception, path_qs: str) -> bool:
        """Note an observer's exception: logged with its traceback the first time only. Returns True."""
        if not self._observer_fault_logged:
            self._observer_fault_logged = True
            log.error("response observer failed on %s; responses are relayed without it (logged once)", path_qs,
                      exc_info=exc)
        return True


class BodyStream:
    """A request body kvgate does not read, sent on as it arrives (never held whole): ``len()`` is its
    declared size in bytes, ``pieces`` its bytes as they come from the client (kvgate.proxy.request's
    Request.pieces). It can be sent once: a request carrying it is never resent."""

    __slots__ = ("pieces", "size")

    def __init__(self, pieces: AsyncIterator[bytes], size: int):
        self.pieces = pieces
        self.size = size

    def __len__(self) -> int:
        return self.size


@dataclass(frozen=True)
class BodyParts:
    """A large request body kept as the pieces it arrived in: joining them copies it in one go on the
    event loop (66 MB: over 100 ms here, page faults included) while every other client waits.
    ``len()`` is its size in bytes; the relay sends the pieces one by one."""

    parts: tuple[bytes, ...]
    size: int

    def __len__(self) -> int:
        return self.size


async def read_body(request: web.Request, max_bytes: int, join_max: int,
                    stream_over: int | None = None) -> bytes | BodyParts | BodyStream:
    """The request body exactly as received (the server never decompresses it): bytes up to ``join_max``
    bytes, else BodyParts. Unlike ``request.read()`` it gives the event loop back every SEND_PIECE_BYTES
    and never copies a large body whole. Raises HTTPRequestEntityTooLarge (413) past ``max_bytes``, as
    aiohttp's client_max_size does.

    stream_over: on kvgate's own server, a body declared larger than this many bytes (and within
    ``max_bytes``, which the server held it to from its head) is not read here: a BodyStream the relay sends
    on as it arrives (for bodies kvgate neither reads nor rewrites)."""
    if type(request) is server.Request:
        length = request.content_length
        if stream_over is not None and length is not None and stream_over < length <= max_bytes:
            return BodyStream(request.pieces(), length)
        got = await request.read_body(max_bytes, join_max, SEND_PIECE_BYTES)
        if type(got) is tuple:
            return BodyParts(tuple(got[0]), got[1])
        return got
    parts: list[bytes] = []
    size = since_yield = 0
    while chunk := await request.content.readany():
        parts.append(chunk)
        size += len(chunk)
        since_yield += len(chunk)
        if size > max_bytes:
            raise web.HTTPRequestEntityTooLarge(max_size=max_bytes, actual_size=size)
        if since_yield >= SEND_PIECE_BYTES:
            since_yield = 0
            await asyncio.sleep(0)
    if size > join_max:
        return BodyParts(tuple(parts), size)
    return parts[0] if len(parts) == 1 else b"".join(parts)


async def _pieces(body: bytes | BodyParts | BodyStream) -> AsyncIterator[bytes | memoryview]:
    if isinstance(body, BodyStream):
        async for piece in body.pieces:
            yield piece
        return
    if isinstance(body, BodyParts):
        for part in body.parts:
            yield part
        return
    view = memoryview(body)
    for i in range(0, len(view), SEND_PIECE_BYTES):
        yield view[i:i + SEND_PIECE_BYTES]


def _abort_client(request: web.Request) -> None:
    transport = request.transport
    if transport is not None:
        transport.close()
