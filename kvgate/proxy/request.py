"""One request on a kvgate server connection: what the gateway and the relay read (head, body), and the
answer's writer (I/O edge: it awaits the body's arrival and the client's socket).

The connection (kvgate.proxy.server) feeds the body in with ``feed``/``end``/``fail`` and is told back
through its public methods (``body_taken``, ``answered``, ``refuse_body``, ``drain``); the framing rules
are kvgate.proxy.wire's. ``StreamResponse`` and ``write_response`` let code written against aiohttp's
server (kvgate's own endpoints, the relay's aiohttp-client path) answer on it.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, AsyncIterator
from urllib.parse import unquote

from aiohttp import web
from multidict import CIMultiDict, MultiDictProxy

from kvgate.proxy.conn_state import Pause, Phase
from kvgate.proxy.wire import (NO_BODY_STATUS, SERIALISED, BadRequest, Headers, has_body, header_lines, pairs,
                               response_head)

if TYPE_CHECKING:
    from kvgate.proxy.body_budget import Ticket
    from kvgate.proxy.server import _Conn

_NO_MATCH: dict[str, str] = {}
_LOST, _OPEN = Phase.LOST, Phase.OPEN
_BODY = Pause.BODY.value
_GONE = "the client closed the connection"


class Request:
    """One request on a connection: what the gateway and the relay read, and the answer's writer.

    method, raw_path (path and query as sent, str; bytes that are not UTF-8 as surrogate escapes),
    raw_headers ((name, value) byte pairs in the client's order), version ((1, 1) or (1, 0)), match_info
    (the route's variables), max_body (the largest body this request may have, bytes). ``headers`` and
    ``query`` are built on first read. The body is read with ``read_body`` / ``read`` / ``pieces``. The
    answer: ``answer`` (a whole one, one write) or ``start`` + ``write`` + ``write_eof`` (streamed); each
    raises ConnectionResetError once the client is gone.

    What the connection sets: ``expect`` (the Expect value, lower-case bytes), ``early`` (a refusal from the
    head alone, answered when its turn comes), ``ticket`` (its share of the in-flight body budget),
    ``body_done``.
    """

    __slots__ = ("method", "raw_path", "_fields", "version", "keep_alive", "match_info", "_conn", "max_body",
                 "_query", "_chunks", "_buffered", "body_done", "_waiter", "expect", "_length", "sent",
                 "_chunked", "head_only", "_error", "_headers", "_path", "ticket", "received", "early",
                 "__weakref__")

    def __init__(self, conn: "_Conn", method: str, raw_path: str, fields: tuple, version: tuple[int, int],
                 keep_alive: bool, expect: bytes | None, length: int | None, max_body: int):
        self._conn = conn
        self.method = method
        self.raw_path = raw_path
        self._fields = fields  # name, value, name, value ... (flat: one tuple, not one per header)
        self.version = version
        self.keep_alive = keep_alive
        self.match_info: dict[str, str] = _NO_MATCH
        self.max_body = max_body
        self._query: MultiDictProxy | None = None
        self._headers: Headers | None = None
        self._path: str | None = None
        self._chunks: list[bytes] | tuple = ()  # a list once body bytes arrive
        self._buffered = 0
        self.body_done = False
        self._waiter: asyncio.Future | None = None
        self.expect = expect
        self._length = length
        self.sent = 0  # 0: nothing written, 1: head written (streaming), 2: answered in full
        self._chunked = False
        self.head_only = method == "HEAD"
        self._error: BadRequest | None = None  # the body's framing broke: reading it raises this
        self.ticket: Ticket | None = None  # its share of the in-flight body budget (a request with a body)
        self.received = 0  # body bytes received
        self.early: BadRequest | None = None  # refused from its head alone: answered when its turn comes

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
        return pairs(self._fields)

    @property
    def connection(self) -> "_Conn":
        """The connection this request came on (kvgate.proxy.server)."""
        return self._conn

    @property
    def transport(self) -> asyncio.Transport | None:
        return self._conn.transport

    @property
    def content_length(self) -> int | None:
        return self._length

    async def read_body(self, max_bytes: int, join_max: int, yield_every: int):
        """The body exactly as received: bytes up to ``join_max`` bytes, else the list of its pieces and
        its size as (parts, size). The event loop is given back every ``yield_every`` bytes. Raises
        HTTPRequestEntityTooLarge (413) past ``max_bytes`` or past this request's own ``max_body``."""
        if self.max_body < max_bytes:
            max_bytes = self.max_body
        chunks = self._chunks
        if self.body_done and len(chunks) == 1 and self._error is None:
            # the common case, the whole body arrived in one piece: the loop below, in short
            body = chunks[0]
            n = len(body)
            if n <= max_bytes and n <= join_max and n < yield_every:
                self._chunks = ()  # (_taken, inline)
                self._buffered = 0
                conn = self._conn
                if conn.ctl.bits & _BODY:
                    conn.body_taken()
                return body
        parts: list[bytes] = []
        size = since_yield = 0
        while True:
            chunks = self._chunks
            if chunks:
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
            if self.body_done and self._error is None:
                break
            await self._wait_body()
        if size > join_max:
            return parts, size
        if not parts:
            return b""
        return parts[0] if len(parts) == 1 else b"".join(parts)

    async def read(self) -> bytes:
        """The whole body as bytes (kvgate's own endpoints). Raises HTTPRequestEntityTooLarge (413) past the
        request's ``max_body``, as aiohttp's ``request.read()`` does past its client_max_size."""
        limit = self.max_body
        return await self.read_body(limit, limit, limit)

    async def pieces(self) -> AsyncIterator[bytes]:
        """The body's pieces as they arrive, none kept here: at most the connection's high-water mark is
        buffered before its reading pauses. Only for a body of declared length (``content_length``), which
        the server has already held to ``max_body``. Raises BadRequest when the body's framing breaks or it
        stops arriving, ConnectionResetError when the client goes."""
        while True:
            chunks = self._chunks
            if chunks:
                self._taken()
                for chunk in chunks:
                    yield chunk
                continue
            if self.body_done and self._error is None:
                return
            await self._wait_body()

    def _taken(self) -> None:
        self._chunks = ()
        self._buffered = 0
        conn = self._conn
        if conn.ctl.bits & _BODY:  # its reading paused for the bytes just taken
            conn.body_taken()

    async def _wait_body(self) -> None:
        if self._error is not None:
            raise self._error
        if self._conn.ctl.phase is _LOST:
            raise ConnectionResetError(_GONE)
        self._waiter = w = self._conn.loop.create_future()
        try:
            await w
        finally:
            self._waiter = None

    # --- what the connection feeds in ---

    def feed(self, chunk: bytes) -> int:
        """Body bytes arrived. Returns the bytes now buffered, not yet taken by the handler."""
        if self._chunks:
            self._chunks.append(chunk)
        else:
            self._chunks = [chunk]
        n = len(chunk)
        self._buffered += n
        self.received += n
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)
        return self._buffered

    def drop_body(self) -> None:
        """Forget the body bytes buffered (a refused body)."""
        self._chunks = ()
        self._buffered = 0

    def end(self) -> None:
        """The whole body has arrived."""
        self.body_done = True
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def fail(self, err: BadRequest) -> None:
        """The body cannot be read (broken framing, a timeout, no room): the handler's read raises ``err``
        and the connection closes after the answer."""
        self._error = err
        self.keep_alive = False
        self.wake()

    def wake(self) -> None:
        """Wake a handler waiting for body bytes (it reads what is there, or finds the client gone)."""
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    # --- the answer ---

    def _head(self, status: int, reason: bytes, lines: bytes, length: int | None, stream: bool) -> bytes:
        head, self._chunked, keep = response_head(status, reason, lines, length, stream, self.version,
                                                  self.keep_alive and self._conn.ctl.phase is _OPEN, self.head_only)
        if not keep:
            self.keep_alive = False
        return head

    def answer(self, status: int, reason: bytes, lines: bytes, body: bytes, has_length: bool) -> None:
        """Write a whole answer in one write: status line, ``lines`` (header lines as bytes), framing and
        connection headers, ``body``. has_length: ``lines`` already carry a Content-Length."""
        conn = self._conn
        phase = conn.ctl.phase
        if phase is _LOST:
            raise ConnectionResetError(_GONE)
        bodied = status >= 200 and status not in NO_BODY_STATUS  # wire.has_body
        head_only = self.head_only
        length = None if has_length or not bodied or (head_only and not body) else len(body)
        # (response_head called here, not through _head: one call fewer on every whole answer; a whole
        # answer is never chunked)
        head, _, keep = response_head(status, reason, lines, length, False, self.version,
                                      self.keep_alive and phase is _OPEN, head_only)
        if not keep:
            self.keep_alive = False
        self.sent = 2
        if body and not head_only and bodied:
            conn.transport.write(head + body)
        else:
            conn.transport.write(head)
        conn.answered(self)

    def start(self, status: int, reason: bytes, lines: bytes, has_length: bool) -> None:
        """Write the head of a streamed answer; the body follows with ``write`` and ``write_eof``."""
        conn = self._conn
        if conn.ctl.phase is _LOST:
            raise ConnectionResetError(_GONE)
        conn.transport.write(self._head(status, reason, lines, None, not has_length and has_body(status)))
        self.sent = 1

    async def write(self, data: bytes) -> None:
        """Send part of a streamed body; waits while the client's socket is full."""
        conn = self._conn
        if conn.ctl.phase is _LOST:
            raise ConnectionResetError(_GONE)
        if not data or self.head_only:
            return
        conn.transport.write(b"%x\r\n%s\r\n" % (len(data), data) if self._chunked else data)
        if conn.write_paused:
            await conn.drain()

    async def write_eof(self) -> None:
        """End a streamed body."""
        conn = self._conn
        if conn.ctl.phase is _LOST:
            raise ConnectionResetError(_GONE)
        if self._chunked:
            conn.transport.write(b"0\r\n\r\n")
        self.sent = 2
        if conn.write_paused:
            await conn.drain()
        conn.answered(self)

    def write_response(self, resp, date: str) -> None:
        """Answer with an aiohttp Response (kvgate's own endpoints, kvgate-made errors, HTTP exceptions);
        ``date``: the Date header's value when it has none. A body aiohttp holds as a Payload (a Response built
        from a str or a file object) is read with its public ``decode``: latin-1 maps each byte to one character
        and back, so the bytes go out exactly (a file object is read at once: kvgate's handlers send none)."""
        body = getattr(resp, "body", None)
        if body is None:
            body = b""
        elif not isinstance(body, (bytes, bytearray)):
            body = body.decode("latin-1").encode("latin-1")
        headers = resp.headers
        items = [(k, v) for k, v in headers.items() if k.lower() not in SERIALISED]
        if "Content-Type" not in headers and body:
            items.append(("Content-Type", "application/octet-stream"))
        if "Date" not in headers:
            items.append(("Date", date))
        reason = resp.reason.encode("utf-8", "surrogateescape") if resp.reason else b""
        if not self.body_done:
            self.keep_alive = False  # the body was not read: the connection cannot carry another request
        self.answer(resp.status, reason, header_lines(items), bytes(body), False)


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
