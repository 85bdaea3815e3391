"""kvgate's HTTP/1.1 server for its clients, on an asyncio Protocol and httptools (I/O edge).

The client side's counterpart of kvgate.proxy.connection_pool: one small Protocol object per connection, the request
parsed by httptools (llhttp) as it arrives, one task per request (cancelled when the client goes away,
which closes the upstream call), and the answer written as bytes the relay built (no header objects on the
hot path). kvgate's own endpoints still return aiohttp ``web.Response`` objects; they are serialised here.

What it guarantees (aiohttp's server gave the same):
- Header limits: a request line over MAX_LINE_BYTES is answered 400, a header line over
  MAX_FIELD_BYTES or a head over MAX_HEAD_BYTES 431; a malformed request 400. Each is one INFO log line
  (logger ``kvgate.proxy.server``) and the connection is closed after the answer.
- Request bodies: Content-Length or chunked, read as they arrive (the handler reads them), never
  decompressed; ``Expect: 100-continue`` answered ``100 Continue`` when the handler starts (417 for
  other expectations). Reading is paused while BODY_HIGH_WATER bytes wait for the handler.
- Keep-alive (HTTP/1.1 by default, HTTP/1.0 with ``Connection: keep-alive``), pipelined requests answered
  in order, HEAD answered without a body, a streamed answer of unknown length chunked (HTTP/1.1) or
  ended by closing the connection (HTTP/1.0).
- A connection idle for KEEPALIVE_S is closed (one loop-wide sweep, no timer per connection).
- ``cleanup()``: stop listening, close idle connections, let requests in flight finish for up to
  SHUTDOWN_TIMEOUT_S, then cancel them and close every connection.
"""

from __future__ import annotations

import asyncio
import collections
import errno
import logging
import math
import os
from dataclasses import dataclass
from email.utils import formatdate
from http import HTTPStatus
from collections.abc import Mapping
from typing import Any, Awaitable, Callable, Iterable
from urllib.parse import unquote

import aiohttp.http_writer
import httptools
from aiohttp import web
from multidict import CIMultiDict, MultiDictProxy

log = logging.getLogger("kvgate.proxy.server")

# Header limits no lower than the router's. Measured on smg 1.13 (hyper): a 400 KB header and a 9 KB URL
# pass, a 1 MB header is 431 and a 64 KiB URL is 414. aiohttp's defaults (8190 bytes) were lower.
MAX_LINE_BYTES = 128 * 1024   # request or status line, so the router answers an over-long URL itself
MAX_FIELD_BYTES = 512 * 1024  # one header line

# aiohttp's keepalive_timeout: an idle keep-alive connection is closed after this many seconds.
KEEPALIVE_S = 75.0
# aiohttp's shutdown_timeout: how long cleanup() lets requests in flight finish before cancelling them.
SHUTDOWN_TIMEOUT_S = 60.0
# The request line and headers together; a larger head is answered 431 (the parser would hold it all).
MAX_HEAD_BYTES = 2 << 20
# Body bytes buffered before reading from the client pauses until the handler takes them.
BODY_HIGH_WATER = 1 << 18
# How often the loop-wide sweep looks for idle connections, heads and bodies that stopped arriving, and
# requests waiting too long for the body budget (and refreshes the Date header), seconds.
SWEEP_S = 1.0
# A body of unknown length (chunked) takes the in-flight body budget in steps of this many bytes.
BUDGET_STEP = 1 << 20
# After the last answer on a connection kvgate closes (a refusal before the body was read, Connection: close,
# a malformed request), the client's remaining bytes are read and dropped for at most this long before the
# connection closes, so the answer is not lost to a reset (nginx's lingering_close; its lingering_timeout is 5 s).
LINGER_S = 5.0
# How often, at most, the file-descriptor shortage is logged, seconds.
FD_LOG_EVERY_S = 60.0


@dataclass(frozen=True, slots=True)
class Limits:
    """What one client may send kvgate's server (bytes, seconds, a count); each is a config key of the same
    name with ``http_`` in front (docs/configuration.md). docs/guarantees.md puts each beside smg 1.13's and
    nginx's, as measured by scripts/probe_limits.py. A request over a limit is answered and its connection
    closed, with one INFO log line: 400 (request line, trailer section), 431 (header count, a header line, the
    whole head), 413 (a body declared or sent over ``max_body_bytes``), 408 (a head or a body that stopped
    arriving), 503 (the in-flight body budget stayed full for ``body_budget_wait_s``)."""

    request_line_bytes: int = MAX_LINE_BYTES
    header_line_bytes: int = MAX_FIELD_BYTES
    head_bytes: int = MAX_HEAD_BYTES
    header_count: int = 1000
    trailer_bytes: int = 1 << 20
    header_timeout_s: float = 60.0
    body_timeout_s: float = 60.0
    # Request body bytes held in memory at once, all connections together (a larger body than this goes
    # alone); past it, a body waits (its connection's reading paused) for at most body_budget_wait_s.
    inflight_body_bytes: int = 1 << 30
    body_budget_wait_s: float = 60.0


_NO_BODY_STATUS = frozenset({204, 304})
_STATUS_LINES: dict[int, bytes] = {}


def status_line(status: int, reason: bytes = b"") -> bytes:
    """``HTTP/1.1 <status> <reason>\\r\\n``; an empty reason is the standard phrase (cached)."""
    if reason:
        return b"HTTP/1.1 %d %s\r\n" % (status, reason)
    line = _STATUS_LINES.get(status)
    if line is None:
        try:
            phrase = HTTPStatus(status).phrase.encode("ascii")
        except ValueError:
            phrase = b""
        line = _STATUS_LINES[status] = b"HTTP/1.1 %d %s\r\n" % (status, phrase)
    return line


def header_lines(headers: Iterable[tuple[str, str]], first: str | None = None) -> bytes:
    """``Name: value\\r\\n`` lines for str headers, after a ``first`` line (a status line) when given; bytes
    that came in as surrogate escapes go out as they came. Raises ValueError for a CR or LF in a line
    (header injection; aiohttp's check, run only when the text has more of them than line ends, or a NUL)."""
    items = list(headers)
    lines = [f"{k}: {v}\r\n" for k, v in items]
    if first is not None:
        lines.insert(0, first + "\r\n")
    text = "".join(lines)
    if text.count("\r") != len(lines) or text.count("\n") != len(lines) or "\x00" in text:
        check = aiohttp.http_writer._safe_header
        if first is not None:
            check(first)
        for k, v in items:
            check(k)
            check(v)
    try:
        return text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # a lone surrogate that did not come from the wire: aiohttp drops it too
        return text.encode("utf-8", "ignore")


def chunk_frame(data: bytes) -> bytes:
    """``data`` as one chunk of a chunked body (RFC 9112 section 7.1)."""
    return b"%x\r\n%s\r\n" % (len(data), data)


class Headers(Mapping):
    """A request's headers as str, read-only and case-insensitive, looked up in its raw (name, value) byte
    pairs (a request has few headers: a scan allocates nothing kept, where a multidict per request would
    stay with every waiting request). Values are decoded as UTF-8 with surrogate escapes, as aiohttp does;
    ``get`` and ``[]`` give the first of several."""

    __slots__ = ("_raw",)
    case_insensitive = True

    def __init__(self, flat: tuple):
        self._raw = flat  # name, value, name, value ...

    def get(self, name: str, default=None):
        lname = name.lower().encode("latin-1")
        raw = self._raw
        for i in range(0, len(raw), 2):
            if raw[i].lower() == lname:
                return raw[i + 1].decode("utf-8", "surrogateescape")
        return default

    def __getitem__(self, name: str) -> str:
        v = self.get(name)
        if v is None:
            raise KeyError(name)
        return v

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self.get(name) is not None

    def getall(self, name: str, default=None) -> list[str]:
        lname = name.lower().encode("latin-1")
        out = [v.decode("utf-8", "surrogateescape") for k, v in _pairs(self._raw) if k.lower() == lname]
        if not out and default is None:
            raise KeyError(name)
        return out or default

    def __iter__(self):
        return (k.decode("utf-8", "surrogateescape") for k in self._raw[::2])

    def without(self, names: Iterable[str]) -> "Headers":
        """These headers less ``names`` (case-insensitive)."""
        drop = {n.lower().encode("latin-1") for n in names}
        raw = self._raw
        return Headers(tuple(x for i in range(0, len(raw), 2) if raw[i].lower() not in drop
                             for x in (raw[i], raw[i + 1])))

    def __len__(self) -> int:
        return len(self._raw) // 2

    def items(self):
        return [(k.decode("utf-8", "surrogateescape"), v.decode("utf-8", "surrogateescape"))
                for k, v in _pairs(self._raw)]


def _pairs(flat: tuple) -> tuple:
    return tuple(zip(flat[::2], flat[1::2]))


class BadRequest(Exception):
    """A request kvgate answers itself and then closes the connection: ``status``, a short reason and, for a
    refusal the client may retry (503), ``retry_after_s``: the whole seconds of the answer's Retry-After."""

    def __init__(self, status: int, message: str, retry_after_s: int | None = None):
        super().__init__(message)
        self.status = status
        self.retry_after_s = retry_after_s

    def response(self) -> web.Response:
        """The plain-text answer, with Retry-After when set."""
        headers = {"Retry-After": str(self.retry_after_s)} if self.retry_after_s is not None else None
        return web.Response(status=self.status, text=f"{self.status} {HTTPStatus(self.status).phrase}: {self}\n",
                            headers=headers)


def budget_retry_after_s(body_budget_wait_s: float) -> int:
    """Retry-After of the body-budget 503, whole seconds (at least 1): the wait the body just had without room,
    rounded up (an earlier retry would likely wait as long again)."""
    return max(1, math.ceil(body_budget_wait_s))


class Request:
    """One request on a connection: what the gateway and the relay read, and the answer's writer.

    method, raw_path (path and query as sent, str; bytes that are not UTF-8 as surrogate escapes),
    raw_headers ((name, value) byte pairs in the client's order), version ((1, 1) or (1, 0)), match_info
    (the route's variables). ``headers`` and ``query`` are built on first read. The body is read with
    ``read_body`` / ``read``. The answer: ``answer`` (a whole one, one write) or ``start`` + ``write`` +
    ``write_eof`` (streamed); each raises ConnectionResetError once the client is gone.
    """

    __slots__ = ("method", "raw_path", "_fields", "version", "keep_alive", "match_info", "_conn",
                 "_query", "_chunks", "_buffered", "_body_done", "_waiter", "_expect", "_length", "sent",
                 "_chunked", "_head_only", "_error", "_headers", "_path", "_held", "_received", "_early",
                 "_want", "__weakref__")

    def __init__(self, conn: "_Conn", method: str, raw_path: str, fields: tuple, version: tuple[int, int],
                 keep_alive: bool, expect: bytes | None, length: int | None):
        self._conn = conn
        self.method = method
        self.raw_path = raw_path
        self._fields = fields  # name, value, name, value ... (flat: one tuple, not one per header)
        self.version = version
        self.keep_alive = keep_alive
        self.match_info: dict[str, str] = _NO_MATCH
        self._query: MultiDictProxy | None = None
        self._headers: Headers | None = None
        self._path: str | None = None
        self._chunks: list[bytes] | tuple = ()  # a list once body bytes arrive
        self._buffered = 0
        self._body_done = False
        self._waiter: asyncio.Future | None = None
        self._expect = expect
        self._length = length
        self.sent = 0  # 0: nothing written, 1: head written (streaming), 2: answered in full
        self._chunked = False
        self._head_only = method == "HEAD"
        self._error: BadRequest | None = None  # the body's framing broke: reading it raises this
        self._held = 0  # bytes of the in-flight body budget this request holds
        self._received = 0  # body bytes received
        self._early: BadRequest | None = None  # refused from its head alone (413): answered when its turn comes
        self._want = 0  # budget bytes it waits for (0: not waiting)

    # --- what the handler reads ---

    @property
    def path(self) -> str:
        """The path without the query, percent-decoded (aiohttp's ``request.path``)."""
        p = self._path
        if p is None:
            p = self.raw_path.partition("?")[0]
            p = self._path = unquote(p, errors="surrogateescape") if "%" in p else p
        return p

    @property
    def query_string(self) -> str:
        return self.raw_path.partition("?")[2]

    @property
    def query(self) -> MultiDictProxy:
        if self._query is None:
            from yarl import URL
            self._query = URL.build(query_string=self.query_string, encoded=True).query
        return self._query

    @property
    def headers(self) -> Headers:
        """The headers as str, case-insensitive (see Headers); made on first read."""
        h = self._headers
        if h is None:
            h = self._headers = Headers(self._fields)
        return h

    @property
    def raw_headers(self) -> tuple:
        """((name, value) byte pairs) in the client's order, values without trailing whitespace."""
        return _pairs(self._fields)

    @property
    def transport(self) -> asyncio.Transport | None:
        return self._conn.transport

    @property
    def content_length(self) -> int | None:
        return self._length

    async def read_body(self, max_bytes: int, join_max: int, yield_every: int):
        """The body exactly as received: bytes up to ``join_max`` bytes, else the list of its pieces and
        its size as (parts, size). The event loop is given back every ``yield_every`` bytes. Raises
        HTTPRequestEntityTooLarge (413) past ``max_bytes``."""
        parts: list[bytes] = []
        size = since_yield = 0
        while True:
            chunks = self._chunks
            if chunks:
                self._chunks = ()
                self._taken()
                for chunk in chunks:
                    parts.append(chunk)
                    size += len(chunk)
                    since_yield += len(chunk)
                if size > max_bytes:
                    self._conn.refuse_body()
                    raise web.HTTPRequestEntityTooLarge(max_size=max_bytes, actual_size=size)
                if since_yield >= yield_every:
                    since_yield = 0
                    await asyncio.sleep(0)
                continue
            if self._body_done and self._error is None:
                break
            await self._wait_body()
        if size > join_max:
            return parts, size
        if not parts:
            return b""
        return parts[0] if len(parts) == 1 else b"".join(parts)

    async def read(self) -> bytes:
        """The whole body as bytes (kvgate's own endpoints). Raises HTTPRequestEntityTooLarge (413) past the
        server's client_max_size, as aiohttp's ``request.read()`` does."""
        limit = self._conn.server.client_max_size
        return await self.read_body(limit, limit, limit)

    def _taken(self) -> None:
        self._buffered = 0
        conn = self._conn
        if conn.paused_for_body:
            conn.paused_for_body = False
            conn.resume()

    async def _wait_body(self) -> None:
        if self._error is not None:
            raise self._error
        if self._conn.lost:
            raise ConnectionResetError("the client closed the connection")
        self._waiter = w = self._conn.loop.create_future()
        try:
            await w
        finally:
            self._waiter = None

    def _fail(self, err: "BadRequest") -> None:
        """The body cannot be read (broken framing, a timeout, no room): the handler's read raises ``err``
        and the connection closes after the answer."""
        self._error = err
        self.keep_alive = False
        self._wake()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    # --- the answer ---

    def _head(self, status: int, reason: bytes, lines: bytes, length: int | None, stream: bool) -> bytes:
        """The response head. length: the Content-Length to add (None: the lines carry the framing or
        there is no body); stream: the body follows in pieces of unknown total length."""
        conn = self._conn
        keep = self.keep_alive and not conn.closing
        extra = b""
        if length is not None:
            extra = b"Content-Length: %d\r\n" % length
        elif stream and not self._head_only:
            if self.version >= (1, 1):
                self._chunked = True
                extra = b"Transfer-Encoding: chunked\r\n"
            else:
                keep = False  # HTTP/1.0: the body ends when the connection does
        if not keep:
            self.keep_alive = False
            extra += b"Connection: close\r\n"
        elif self.version < (1, 1):
            extra += b"Connection: keep-alive\r\n"
        return b"".join((status_line(status, reason), lines, extra, b"\r\n"))

    def answer(self, status: int, reason: bytes, lines: bytes, body: bytes, has_length: bool) -> None:
        """Write a whole answer in one write: status line, ``lines`` (header lines as bytes), framing and
        connection headers, ``body``. has_length: ``lines`` already carry a Content-Length."""
        conn = self._conn
        if conn.lost:
            raise ConnectionResetError("the client closed the connection")
        no_body = status in _NO_BODY_STATUS or status < 200
        length = None if has_length or no_body or (self._head_only and not body) else len(body)
        head = self._head(status, reason, lines, length, False)
        self.sent = 2
        if body and not self._head_only and not no_body:
            conn.transport.write(head + body)
        else:
            conn.transport.write(head)
        conn.answered(self)

    def start(self, status: int, reason: bytes, lines: bytes, has_length: bool) -> None:
        """Write the head of a streamed answer; the body follows with ``write`` and ``write_eof``."""
        conn = self._conn
        if conn.lost:
            raise ConnectionResetError("the client closed the connection")
        no_body = status in _NO_BODY_STATUS or status < 200
        conn.transport.write(self._head(status, reason, lines, None, not (has_length or no_body)))
        self.sent = 1

    async def write(self, data: bytes) -> None:
        """Send part of a streamed body; waits while the client's socket is full."""
        conn = self._conn
        if conn.lost:
            raise ConnectionResetError("the client closed the connection")
        if not data or self._head_only:
            return
        conn.transport.write(chunk_frame(data) if self._chunked else data)
        if conn.write_paused:
            await conn.drain()

    async def write_eof(self) -> None:
        """End a streamed body."""
        conn = self._conn
        if conn.lost:
            raise ConnectionResetError("the client closed the connection")
        if self._chunked:
            conn.transport.write(b"0\r\n\r\n")
        self.sent = 2
        if conn.write_paused:
            await conn.drain()
        conn.answered(self)


_NO_MATCH: dict[str, str] = {}
# Common header names and values: one bytes object each, shared by every request that waits, not one per request.
_COMMON = {b: b for n in ("Host", "Content-Type", "Content-Length", "User-Agent", "Accept", "Accept-Encoding",
                          "Connection", "Authorization", "X-Session-ID", "X-Request-Id", "keep-alive", "close",
                          "application/json", "*/*", "gzip, deflate", "gzip, deflate, br", "chunked",
                          "text/event-stream") for b in (n.encode(), n.lower().encode())}
# One str per common method, not one per request.
_METHODS = {m.encode(): m for m in ("GET", "POST", "HEAD", "PUT", "DELETE", "OPTIONS", "PATCH")}


class StreamResponse:
    """aiohttp's StreamResponse interface on a kvgate Request, for code written against it (the relay's
    aiohttp-client path): status, reason and a multidict of str headers; ``prepare``, ``write``,
    ``write_eof``."""

    __slots__ = ("status", "reason", "headers", "_request")

    def __init__(self, status: int = 200, reason: str | None = None, headers=None):
        self.status = status
        self.reason = reason
        self.headers = CIMultiDict(headers or {})
        self._request: Request | None = None

    @property
    def prepared(self) -> bool:
        return self._request is not None

    async def prepare(self, request: Request) -> None:
        self._request = request
        has_length = "Content-Length" in self.headers
        reason = (self.reason or "").encode("utf-8", "surrogateescape")
        request.start(self.status, reason, header_lines(self.headers.items()), has_length)

    async def write(self, data: bytes) -> None:
        await self._request.write(data)

    async def write_eof(self, data: bytes = b"") -> None:
        if data:
            await self._request.write(data)
        await self._request.write_eof()


Handler = Callable[[Request], Awaitable[Any]]


class _Conn(asyncio.Protocol):
    """One client connection: the httptools parser's callbacks, the request being read, the one being
    answered and any pipelined behind it.

    Reading pauses while any of these holds: a request waits for its turn behind the one being answered
    (pipelined), the handler has not taken BODY_HIGH_WATER body bytes, the answers already written wait in
    the transport (the client does not read them: no further request is read or answered until it does),
    or the request's body waits for room in the server's in-flight body budget."""

    __slots__ = ("server", "loop", "transport", "parser", "_url", "_fields", "_expect", "_length", "_chunked_in",
                 "_in_head", "_head_bytes", "_trailer_bytes", "_reading", "current", "_queue", "task", "lost",
                 "closing", "write_paused", "_drain_waiter", "paused_for_body", "_paused", "_refused",
                 "_limit_error", "_max_field", "_max_head", "_max_line", "_max_fields", "_upgrade", "_synthetic", "_stopped",
                 "_pending_error", "_next_waiting", "budget_wait", "_lingering", "_timed", "__weakref__")

    def __init__(self, server: "HttpServer"):
        self.server = server
        self.loop = server.loop
        self.transport: asyncio.Transport | None = None
        self.parser: httptools.HttpRequestParser | None = None  # made when bytes come, dropped between requests
        self._url = b""
        self._fields: list[bytes] = []  # name, value, name, value ...
        self._expect: bytes | None = None
        self._length: int | None = None
        self._chunked_in = False  # the request being read is chunked
        self._in_head = False
        self._head_bytes = 0
        self._trailer_bytes = 0
        self._reading: Request | None = None  # the request whose body is arriving
        self.current: Request | None = None  # the request being answered
        self._queue: list[Request] | None = None  # pipelined requests waiting their turn
        self.task: asyncio.Task | None = None
        self.lost = False
        self.closing = False  # no further request on this connection
        self.write_paused = False
        self._drain_waiter: asyncio.Future | None = None
        self.paused_for_body = False
        self._paused = False
        self._refused = False  # a body the handler refused (413): further bytes are dropped
        self._limit_error: BadRequest | None = None
        lim = server.limits
        self._max_field = lim.header_line_bytes
        self._max_head = lim.head_bytes
        self._max_line = lim.request_line_bytes
        self._max_fields = 2 * lim.header_count  # _fields holds a name and a value per header
        self._upgrade = False  # the request being read asked for Upgrade: its body is read as a plain one's
        self._synthetic = False  # the parser is reading the framing-only head that follows an Upgrade
        self._stopped = False  # nothing more is read: a malformed request or a refusal ends the connection
        self._pending_error: BadRequest | None = None  # answered once the requests before it are
        self._next_waiting = False  # the next request waits for the client to read the answers written
        self.budget_wait = False  # the body being read waits for room in the in-flight body budget
        self._lingering = False  # answered and half-closed: what the client still sends is dropped
        self._timed = False  # in the server's table of heads or bodies still arriving

    # --- asyncio.Protocol ---

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  (asyncio and uvloop set TCP_NODELAY)
        self.server._opened(self)

    def data_received(self, data: bytes) -> None:
        if self._stopped:
            return  # after a malformed request, a refusal or a Connection: close: dropped
        if self._in_head or self._reading is None:
            self._head_bytes += len(data)
            if self._head_bytes > self._max_head:
                self._bad(BadRequest(431, f"request head over {self._max_head} bytes"))
                return
        parser = self.parser
        if parser is None:
            parser = self.parser = httptools.HttpRequestParser(self)
        try:
            while True:
                try:
                    parser.feed_data(data)
                    break
                except httptools.HttpParserUpgrade as exc:
                    if not self._upgrade:  # CONNECT: answered (refused) from its head; nothing more is read
                        self._stopped = True
                        self.parser = None
                        return
                    # Upgrade: kvgate relays no other protocol, so the request is a plain one (as smg
                    # serves it) and its body is read on: a fresh parser is given the body's framing alone,
                    # then the bytes after the head.
                    self._upgrade = False
                    data = data[exc.args[0]:] if exc.args else b""
                    parser = self.parser = httptools.HttpRequestParser(self)
                    self._synthetic = True
                    length = self._reading._length if self._reading is not None else 0
                    framing = (b"Transfer-Encoding: chunked\r\n" if self._chunked_in and length is None
                               else b"Content-Length: %d\r\n" % (length or 0))
                    parser.feed_data(b"PUT / HTTP/1.1\r\n" + framing + b"\r\n")
            if self._reading is None and not self._in_head:
                # Between messages: a request waiting for its answer (admission) keeps no parser.
                self.parser = None
            elif not self._stopped:
                self.server._reading_now(self)
        except httptools.HttpParserCallbackError as exc:
            err = self._limit_error
            if err is None:
                raise RuntimeError("an HTTP parser callback failed") from exc.__context__
            self._bad(err)
        except httptools.HttpParserError as exc:
            self._bad(BadRequest(400, f"{type(exc).__name__}: {exc}"))

    def eof_received(self) -> bool:
        return False  # the client half-closed: close, which cancels a handler still running

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.closing = True
        self._stopped = True
        server = self.server
        server._closed(self)
        req = self._reading
        if req is not None:
            req._wake()
            if req._held or req._want:
                server._release(req)
        task = self.task
        if task is not None and not task.done():
            task.cancel()  # the client left: its handler ends, which closes the upstream call
        w = self._drain_waiter
        if w is not None and not w.done():
            w.set_exception(ConnectionResetError("the client closed the connection"))
            w.exception()  # retrieved: nobody may be waiting
        for q in self._queue or ():
            server._release(q)
        self._queue = None

    def pause_writing(self) -> None:
        # The answers written wait in the transport: read no further request until the client takes them.
        self.write_paused = True
        self.pause()

    def resume_writing(self) -> None:
        self.write_paused = False
        w = self._drain_waiter
        if w is not None and not w.done():
            w.set_result(None)
        if self._next_waiting:
            self._next_waiting = False
            self._next()
        self.resume()

    async def drain(self) -> None:
        if self.lost:
            raise ConnectionResetError("the client closed the connection")
        if not self.write_paused:
            return
        w = self._drain_waiter
        if w is None or w.done():
            w = self._drain_waiter = self.loop.create_future()
        await w

    def pause(self) -> None:
        if not self._paused and not self.lost:
            self._paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        """Read again unless a reason to pause remains (see the class)."""
        if (self._paused and not self.lost and not self.closing and not self._stopped and not self.write_paused
                and not self.paused_for_body and not self._queue and not self.budget_wait):
            self._paused = False
            self.transport.resume_reading()

    # --- httptools callbacks ---

    def on_message_begin(self) -> None:
        self._in_head = True
        if self._synthetic:
            return
        self._url = b""
        self._fields = []
        self._expect = None
        self._length = None
        self._chunked_in = False
        self._trailer_bytes = 0
        self._upgrade = False

    def _refusal(self, *answer) -> BadRequest:
        """Record the answer (status, reason) for a request refused inside a parser callback and return it to
        raise: httptools wraps the raise, so feed() reads the answer back from ``_limit_error``."""
        self._limit_error = err = BadRequest(*answer)
        return err

    def on_url(self, url: bytes) -> None:
        self._url += url
        if len(self._url) > self._max_line:
            raise self._refusal(400, f"request line over {self._max_line} bytes")

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self._in_head:  # a trailer (after a chunked body): counted, never kept (nginx drops them too)
            self._trailer_bytes += len(name) + len(value) + 4
            if self._trailer_bytes > self.server.limits.trailer_bytes:
                raise self._refusal(400, f"trailer section over {self.server.limits.trailer_bytes} bytes")
            return
        if len(name) + len(value) > self._max_field:
            raise self._refusal(431, f"a header line over {self._max_field} bytes")
        if len(self._fields) >= self._max_fields:
            raise self._refusal(431, f"more than {self._max_fields // 2} header lines")
        n = len(name)
        if n == 6 or n == 14 or n == 17 or n == 7:
            lname = name.lower()
            if lname == b"upgrade":
                self._upgrade = True
            elif lname == b"expect":
                self._expect = value.strip().lower()
            elif lname == b"content-length":
                try:
                    self._length = int(value)
                except ValueError:
                    pass  # llhttp refuses the request
            elif lname == b"transfer-encoding":
                self._chunked_in = b"chunked" in value.lower()
        value = value.rstrip(b" \t")
        self._fields += (_COMMON.get(name, name), _COMMON.get(value, value))

    def on_headers_complete(self) -> None:
        p = self.parser
        self._in_head = False
        self._head_bytes = 0
        server = self.server
        if self._timed:  # the head took more than one read
            self._timed = False
            server._heads.pop(self, None)
        if self._synthetic:  # the framing-only head after an Upgrade: the body that follows is the request's
            self._synthetic = False
            self._fields = []
            return
        url = self._url
        if not url.isascii():
            raise self._refusal(400, "a byte that is not ASCII in the URL")
        v = p.get_http_version()
        if v == "1.1":
            version = (1, 1)
        elif v == "1.0":
            version = (1, 0)
        else:  # HTTP/0.9 (no version) or 2.0 and above on an HTTP/1 connection: as smg answers them
            raise self._refusal(*_BAD_VERSION.get(v[:1], _BAD_VERSION["2"]))
        method = p.get_method()
        keep_alive = p.should_keep_alive()
        if method == b"CONNECT":  # kvgate tunnels nothing; smg answers CONNECT the same way
            raise self._refusal(*_CONNECT_ANSWER)
        if self._upgrade:  # an Upgrade header: llhttp stops at the head only when Connection names it too
            self._upgrade = p.should_upgrade()
        if self._chunked_in and version == (1, 0):
            # RFC 9112 6.1: Transfer-Encoding on HTTP/1.0 is faulty framing; smg and nginx answer 400
            raise self._refusal(400, "Transfer-Encoding on an HTTP/1.0 request")
        if url[0] != 0x2F and url != b"*":  # not origin-form (/...): absolute-form
            url = _origin_form(url)
        req = Request(self, _METHODS.get(method) or method.decode("ascii"), url.decode("ascii"), tuple(self._fields),
                      version, keep_alive, self._expect, self._length)
        self._fields = []
        self._reading = req
        length = self._length
        if length is not None and length > server.client_max_size:
            # Refused from its head: the body is not read, the answer goes when its turn comes, then the close.
            req._early = BadRequest(413, f"a body of {length} bytes is over the limit of {server.client_max_size}")
            self._refused = True
        elif length or self._chunked_in:
            n = length if length is not None else BUDGET_STEP
            held = server.body_held
            if not server._budget_queue and (held + n <= server.body_budget or held == 0):  # room: at once
                server.body_held = held + n
                req._held = n
            else:
                server._reserve(self, req, n)
        if self.current is None:
            self._dispatch(req)
        else:  # pipelined behind the request being answered: read no more until its turn
            if self._queue is None:
                self._queue = []
            self._queue.append(req)
            self.pause()

    def on_body(self, body: bytes) -> None:
        req = self._reading
        if req is None or self._refused:
            return
        if req._chunks:
            req._chunks.append(body)
        else:
            req._chunks = [body]
        n = len(body)
        req._buffered += n
        req._received += n
        if req._received > req._held and req._length is None and not req._want:
            # chunked: the next step of the body budget (reading pauses while the budget is full)
            self.server._reserve(self, req, req._received - req._held + BUDGET_STEP)
        if req._buffered > BODY_HIGH_WATER and not self.paused_for_body:
            self.paused_for_body = True
            self.pause()
        if req._waiter is not None:
            req._wake()

    def on_message_complete(self) -> None:
        if self._upgrade:
            return  # the head of an Upgrade request: its body is read next (data_received)
        req = self._reading
        if req is not None:
            req._body_done = True
            self._reading = None
            if self._timed:  # the body took more than one read
                self._timed = False
                self.server._bodies.pop(self, None)
            if req._waiter is not None:
                req._wake()

    # --- requests ---

    def refuse_body(self) -> None:
        """The handler refused the body being read (413): drop what else arrives, close after the answer."""
        self._refused = True
        self.closing = True
        req = self._reading
        if req is not None:
            req._chunks = ()

    def granted(self, req: Request) -> None:
        """The body budget has room for ``req`` now: read its body (and send the 100 Continue it waits for)."""
        self.budget_wait = False
        if req is self.current and req._expect == b"100-continue" and req.version >= (1, 1) and not req._body_done \
                and not self.lost:
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        self.resume()

    def budget_timeout(self, req: Request) -> None:
        """``req`` waited body_budget_wait_s for room in the body budget: 503, then the connection closes."""
        self.budget_wait = False
        err = BadRequest(503, "kvgate's in-flight request body budget stayed full",
                         retry_after_s=budget_retry_after_s(self.server.limits.body_budget_wait_s))
        log.info("request body from %s waited too long for the body budget, answered 503", self._peer())
        self._stopped = True
        self.closing = True
        if req is self.current:  # the handler's read raises it
            req._fail(err)
        else:
            req._early = err

    def _dispatch(self, req: Request) -> None:
        """Start answering ``req``: its handler runs in a task of its own (cancelled when the client goes),
        and _done writes what it returned. No wrapper coroutine: a waiting request keeps only the
        handler's own."""
        self.current = req
        self.server._busy(self)
        server = self.server
        early = req._early
        if early is not None:
            self._answer(req, early.response())
            return
        expect = req._expect
        if expect is not None and req.version >= (1, 1):
            if expect != b"100-continue":
                early = web.HTTPExpectationFailed(text=f"Unknown Expect: {expect.decode('latin-1')}")
            elif not req._body_done and not req._want:  # waiting for the body budget: sent once granted
                self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        if early is not None:
            self._answer(req, early)
            return
        try:
            coro = server.route(req)(req)
        except Exception:
            log.exception("error routing %s %s", req.method, req.raw_path)
            self._answer(req, web.Response(status=500, text="500 Internal Server Error"))
            return
        task = self.task = self.loop.create_task(coro)
        task.add_done_callback(self._done)

    def answered(self, req: Request) -> None:
        """``req``'s answer is written whole (queued on the transport, in order): the connection reads and
        answers its next request now instead of once the handler's task ends. Without this, a client that
        sends its next request as soon as it has the answer (every keep-alive client at one connection)
        found the handler still finishing its bookkeeping and was held as a pipelined request: reading
        paused and resumed (two epoll changes) and its dispatch waited a loop turn. The handler's task
        finishes detached: a client that leaves no longer cancels it, shutdown still waits for it, and
        what it raises is logged."""
        task = self.task
        if (req is not self.current or task is None or task.done() or self.lost or self.closing
                or not req.keep_alive or not req._body_done or self.server.closing):
            return  # answered from _done (the task ended), or the connection closes after this answer
        self.server._finishing[task] = req
        self._finished(req)

    def _done(self, task: asyncio.Task) -> None:
        req = self.current
        if task is not self.task or req is None:  # detached (answered) or ended after its connection moved on
            done = self.server._finishing.pop(task, None)
            if done is not None and not task.cancelled() and task.exception() is not None:  # logged, never lost
                log.error("error handling %s %s after its answer", done.method, done.raw_path,
                          exc_info=task.exception())
            return
        if task.cancelled():  # the client left, or shutdown cancelled it
            if not self.lost:
                self.closing = True
                self.transport.close()  # cancelled by shutdown: the connection goes too
            self._finished(req)
            return
        exc = task.exception()
        if exc is None:
            resp = task.result()
        elif isinstance(exc, web.HTTPException):
            resp = exc
        elif isinstance(exc, BadRequest):  # the body's framing broke while the handler read it (logged once)
            resp = exc.response()
        elif isinstance(exc, Exception):
            log.error("error handling %s %s", req.method, req.raw_path, exc_info=exc)
            resp = None if req.sent else web.Response(status=500, text="500 Internal Server Error")
            if req.sent:
                self.closing = True
        else:  # KeyboardInterrupt, SystemExit: not ours to answer
            self.closing = True
            resp = None
        self._answer(req, resp)

    def _answer(self, req: Request, resp) -> None:
        """Write ``resp`` unless the handler answered on the request itself; then the next request."""
        if not self.lost:
            try:
                if req.sent == 0 and resp is not None:
                    self._write_response(req, resp)
                elif req.sent == 1:  # a streamed answer the handler did not end: the client sees it cut
                    self.closing = True
                elif req.sent == 0:
                    self.closing = True
            except Exception:
                log.exception("error writing the answer to %s %s", req.method, req.raw_path)
                self.closing = True
        self._finished(req)

    def _write_response(self, req: Request, resp) -> None:
        """Serialise an aiohttp Response (kvgate's own endpoints, kvgate-made errors, HTTP exceptions)."""
        body = getattr(resp, "body", None)
        if body is None:
            body = b""
        elif not isinstance(body, (bytes, bytearray)):
            body = bytes(body._value) if hasattr(body, "_value") else bytes(body)
        headers = resp.headers
        items = [(k, v) for k, v in headers.items() if k.lower() not in _SERIALISED]
        if "Content-Type" not in headers and body:
            items.append(("Content-Type", "application/octet-stream"))
        if "Date" not in headers:
            items.append(("Date", self.server.date))
        reason = resp.reason.encode("utf-8", "surrogateescape") if resp.reason else b""
        if not req._body_done:
            self.closing = True  # the body was not read: the connection cannot carry another request
        req.answer(resp.status, reason, header_lines(items), bytes(body), False)

    def _finished(self, req: Request) -> None:
        self.task = None
        self.current = None
        if req._want or self.server._budget_queue:
            self.server._release(req)
        elif req._held:  # nobody waits for the room it gives back
            self.server.body_held -= req._held
            req._held = 0
        if self.lost:
            return
        if self.closing or not req.keep_alive or not req._body_done or self.server.closing:
            self._close_after(req)
            return
        if self.write_paused:  # the client has not read the answers written: the next request waits
            self._next_waiting = True
            self.server._idle_since(self)  # a client that never reads them is closed after keepalive_s
            return
        self._next()

    def _next(self) -> None:
        """Answer the next pipelined request, or the malformed one after them (then close), or go idle."""
        queue = self._queue
        if queue:
            nxt = queue.pop(0)
            if not queue:
                self._queue = None
                self.resume()
            self._dispatch(nxt)
            return
        err = self._pending_error
        if err is not None:
            self._pending_error = None
            self._write_error(err)
            return
        self.server._idle_since(self)

    def _close_after(self, req: Request) -> None:
        """Close once the answer is written: half-close, then drop what the client still sends for at most
        LINGER_S (until its own close), so it reads the answer first. Always, not only when a body is
        unread: a pipelined request behind a ``Connection: close`` one may still be in flight, and bytes
        arriving at a closed socket make the kernel reset the connection, which can discard the answer
        before the client reads it (nginx lingers when it sees such bytes; kvgate cannot see those in flight)."""
        self.closing = True
        self._stopped = True
        if self.transport.is_closing():
            return
        self._linger()

    def _linger(self) -> None:
        self._lingering = True
        self.parser = None
        self._reading = None
        try:
            self.transport.write_eof()
        except (OSError, RuntimeError, NotImplementedError):
            self.transport.close()
            return
        self._paused = False
        self.transport.resume_reading()
        self.server._lingering[self] = self.loop.time()

    def _peer(self) -> str:
        peer = self.transport.get_extra_info("peername") if self.transport is not None else None
        return peer[0] if peer else "?"

    def _bad(self, err: BadRequest) -> None:
        """Answer a request kvgate cannot read (after the ones before it), log one line, close."""
        log.info("bad request from %s: %s, answered %d", self._peer(), err, err.status)
        self._limit_error = None
        self._stopped = True
        self.parser = None
        self.pause()
        self.server._heads.pop(self, None)
        self.server._bodies.pop(self, None)
        req, self._reading = self._reading, None
        if req is not None and req is self.current:  # its body broke mid-way: the handler's read raises
            req._fail(err)
            return
        if req is not None and self._queue and req is self._queue[-1]:  # its body broke while it waited its turn
            self._queue.pop()
            self.server._release(req)
            if not self._queue:
                self._queue = None
        if self.current is not None or self._queue:  # the requests before it are answered first, in order
            self._pending_error = err
            return
        self._write_error(err)

    def _write_error(self, err: BadRequest) -> None:
        self.closing = True
        body = f"{err.status} {HTTPStatus(err.status).phrase}: {err}\n".encode("utf-8", "replace")
        retry = b"Retry-After: %d\r\n" % err.retry_after_s if err.retry_after_s is not None else b""
        self.transport.write(b"".join((status_line(err.status), retry, b"Content-Type: text/plain; charset=utf-8\r\n",
                                       b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body), body)))
        self._linger()  # the client may still be sending: it reads the answer rather than a reset

    def timed_out(self, what: str) -> None:
        """A head or a body stopped arriving for header_timeout_s / body_timeout_s: 408, then close."""
        err = BadRequest(408, f"the request {what} did not arrive in time")
        req = self._reading
        if req is not None and req is self.current:
            log.info("request %s from %s stopped arriving, answered 408", what, self._peer())
            self._stopped = True
            self.closing = True
            self.parser = None
            self._reading = None
            req._fail(err)
            return
        self._bad(err)

    def close(self) -> None:
        self.closing = True
        if self.transport is not None and not self.lost:
            self.transport.close()


def _origin_form(url: bytes) -> bytes:
    """An absolute-form target (``http://host/path?q``, RFC 9112 3.2.2, what a client using kvgate as its
    HTTP proxy sends) as the origin-form kvgate routes and forwards (``/path?q``); others unchanged."""
    low = url[:8].lower()
    if not (low.startswith(b"http://") or low.startswith(b"https://")):
        return url
    rest = url[url.index(b"//") + 2:]
    for i, c in enumerate(rest):
        if c == 0x2F:  # /
            return rest[i:]
        if c == 0x3F:  # ?
            return b"/" + rest[i:]
    return b"/"


# How smg 1.13 answers a request line it does not serve (scripts/probe_limits.py): 400 for a request line
# without a version (HTTP/0.9) and for HTTP/2.0 on an HTTP/1 connection; 404 for CONNECT (no route).
_BAD_VERSION = {"0": (400, "a request line without an HTTP/1.x version"),
                "2": (400, "HTTP/2 on an HTTP/1 connection")}
_CONNECT_ANSWER = (404, "CONNECT: kvgate tunnels nothing")


# Framing and connection headers: the server sets them itself.
_SERIALISED = frozenset({"content-length", "transfer-encoding", "connection", "keep-alive"})


class HttpServer:
    """kvgate's HTTP/1.1 server: ``route(request)`` picks the handler (it may set ``request.match_info``);
    ``await handler(request)`` answers on the Request, or returns an aiohttp Response to serialise.
    ``listen()`` adds a listening socket; ``cleanup()`` stops.

    client_max_size: the largest request body in bytes (one declared larger is answered 413 from its head,
    its body unread); limits: the rest of what a client may send (Limits); keepalive_s, shutdown_timeout_s
    in seconds. on_cleanup: awaited last by cleanup().
    """

    def __init__(self, route: Callable[[Request], Handler], client_max_size: int, keepalive_s: float = KEEPALIVE_S,
                 shutdown_timeout_s: float = SHUTDOWN_TIMEOUT_S,
                 on_cleanup: Callable[[], Awaitable[None]] | None = None, limits: Limits | None = None):
        self.route = route
        self.client_max_size = client_max_size
        self.limits = limits or Limits()
        # connections whose head (started when the value was) or body (last byte then) is still arriving,
        # oldest first; connections that answered and drop what the client still sends
        self._heads: dict[_Conn, float] = {}
        self._bodies: dict[_Conn, float] = {}
        self._lingering: dict[_Conn, float] = {}
        # the in-flight body budget: bytes held by requests now, and the requests waiting for room, in order
        self.body_held = 0
        self.body_budget = self.limits.inflight_body_bytes
        self._budget_queue: collections.deque[tuple[_Conn, Request, float]] = collections.deque()
        self._fd_logged = -FD_LOG_EVERY_S
        self.keepalive_s = keepalive_s
        self.shutdown_timeout_s = shutdown_timeout_s
        self.on_cleanup = on_cleanup
        self.loop = asyncio.get_running_loop()
        self.closing = False
        self._servers: list[asyncio.AbstractServer] = []
        self._conns: dict[_Conn, None] = {}
        # handlers whose answer is written whole, finishing their bookkeeping (_Conn.answered)
        self._finishing: dict[asyncio.Task, Request] = {}
        self._idle: dict[_Conn, float] = {}  # idle connections, oldest first (insertion order)
        self._sweeper: asyncio.TimerHandle | None = None
        self.date = formatdate(usegmt=True)

    async def listen(self, host: str | None, port: int, backlog: int = 1024, reuse_port: bool | None = None) -> int:
        """Listen on host:port (port 0: a free one). Returns the bound port."""
        srv = await self.loop.create_server(lambda: _Conn(self), host, port, backlog=backlog,
                                            reuse_port=reuse_port)
        self._servers.append(srv)
        if self._sweeper is None:
            self._sweeper = self.loop.call_later(SWEEP_S, self._sweep)
        return srv.sockets[0].getsockname()[1]

    @property
    def connections(self) -> int:
        return len(self._conns)

    # --- connection bookkeeping (called by _Conn) ---

    def _opened(self, conn: _Conn) -> None:
        if self.closing:
            conn.close()
            return
        self._conns[conn] = None
        self._idle[conn] = self.loop.time()

    def _closed(self, conn: _Conn) -> None:
        self._conns.pop(conn, None)
        self._idle.pop(conn, None)
        self._heads.pop(conn, None)
        self._bodies.pop(conn, None)
        self._lingering.pop(conn, None)

    def _busy(self, conn: _Conn) -> None:
        self._idle.pop(conn, None)

    def _idle_since(self, conn: _Conn) -> None:
        self._idle[conn] = self.loop.time()

    def _reading_now(self, conn: _Conn) -> None:
        """After a read that left ``conn`` inside a head or a body: start the head's clock (once), restart
        the body's (its last byte came now). Requests that arrive in one read never get here."""
        conn._timed = True
        if conn._in_head:
            if conn not in self._heads:
                self._heads[conn] = self.loop.time()
        elif conn._reading is not None:
            bodies = self._bodies
            bodies.pop(conn, None)  # to the end: oldest progress first
            bodies[conn] = self.loop.time()

    def _reserve(self, conn: _Conn, req: Request, n: int) -> None:
        """Take ``n`` bytes of the in-flight body budget for ``req``, or queue it (its connection stops
        reading) until there is room. A body larger than the whole budget goes when nothing else holds any."""
        if not self._budget_queue and (self.body_held + n <= self.body_budget or self.body_held == 0):
            self.body_held += n
            req._held += n
            return
        req._want = n
        conn.budget_wait = True
        conn.pause()
        self._budget_queue.append((conn, req, self.loop.time()))

    def _release(self, req: Request) -> None:
        """``req`` is done (answered, or its connection gone): give back what it holds, let waiters in."""
        if req._want:
            req._want = 0
            q = self._budget_queue
            for i, item in enumerate(q):
                if item[1] is req:
                    del q[i]
                    break
        if req._held:
            self.body_held -= req._held
            req._held = 0
        self._grant()

    def _grant(self) -> None:
        q = self._budget_queue
        budget = self.body_budget
        while q:
            conn, req, _ = q[0]
            if self.body_held + req._want > budget and self.body_held != 0:
                return
            q.popleft()
            self.body_held += req._want
            req._held += req._want
            req._want = 0
            conn.granted(req)

    def _sweep(self) -> None:
        """Once a second: close connections idle longer than keepalive_s; answer 408 to heads and bodies
        that stopped arriving and 503 to bodies that waited too long for the budget; close lingering
        connections; note a shortage of file descriptors; refresh the Date value. Each table is kept oldest
        first, so the sweep stops at the first entry still in time."""
        self.date = formatdate(usegmt=True)
        now = self.loop.time()
        _close_expired(self._idle, now - self.keepalive_s)
        lim = self.limits
        for table, limit, what in ((self._heads, lim.header_timeout_s, "head"),
                                   (self._bodies, lim.body_timeout_s, "body")):
            late = now - limit
            while table:
                conn = next(iter(table))
                if table[conn] > late:
                    break
                del table[conn]
                if conn.lost:
                    continue
                if conn._paused:  # kvgate stopped reading it (its turn, the budget): not the client's delay
                    table[conn] = now
                    continue
                conn.timed_out(what)
        q = self._budget_queue
        late = now - lim.body_budget_wait_s
        while q and q[0][2] <= late:
            conn, req, _ = q.popleft()
            req._want = 0
            conn.budget_timeout(req)
        _close_expired(self._lingering, now - LINGER_S)
        self._check_fds(now)
        self._sweeper = self.loop.call_later(SWEEP_S, self._sweep)

    def _check_fds(self, now: float) -> None:
        """Log (at most every FD_LOG_EVERY_S) when no file descriptor is left for a new connection: the
        event loop then drops new clients at accept (uvloop closes them without a word)."""
        try:
            os.close(os.open(os.devnull, os.O_RDONLY))  # the descriptor an accept would need
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE) and now - self._fd_logged >= FD_LOG_EVERY_S:
                self._fd_logged = now
                import resource
                soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
                log.error("out of file descriptors (%s; %d client connections open, limit %d): new clients cannot "
                          "be accepted and are dropped; raise the limit (ulimit -n) or lower the load",
                          os.strerror(exc.errno), len(self._conns), soft)

    async def cleanup(self) -> None:
        """Stop listening; close idle connections; wait up to shutdown_timeout_s for requests in flight,
        then cancel them; close every connection; then ``on_cleanup``."""
        self.closing = True
        for srv in self._servers:
            srv.close()
        await asyncio.sleep(0)  # connections accepted just before the close are made
        for conn in list(self._idle):
            conn.close()
        self._idle.clear()
        tasks = [c.task for c in self._conns if c.task is not None and not c.task.done()]
        tasks += [t for t in self._finishing if not t.done()]
        for c in self._conns:
            c.closing = True
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=self.shutdown_timeout_s)
            for t in pending:
                t.cancel()
            if pending:
                await asyncio.wait(pending)
        for conn in list(self._conns):
            conn.close()
        self._conns.clear()
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for srv in self._servers:
            await srv.wait_closed()
        self._servers.clear()
        if self.on_cleanup is not None:
            await self.on_cleanup()


def _close_expired(table: "dict[_Conn, float]", deadline: float) -> None:
    """Close the connections of ``table`` (oldest first) whose time is at or before ``deadline``."""
    while table:
        conn = next(iter(table))
        if table[conn] > deadline:
            return
        del table[conn]
        conn.close()
