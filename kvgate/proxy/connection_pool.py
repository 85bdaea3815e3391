"""Pooled keep-alive HTTP/1.1 connections to the upstreams, built on asyncio Protocols (I/O edge).

The relay's client: one request at a time per connection, the request head written as bytes the caller
built (no header objects), the response parsed by httptools (llhttp, the parser Node.js uses) as it
arrives. Bodies pass as bytes, never decompressed. What the relay reads: ``Exchange.status``,
``reason``, ``headers`` (raw (name, value) byte pairs), then ``await Exchange.read()`` until it returns
b"". Idle connections are kept per upstream base URL and dropped once the peer closes them or they sat
idle KEEPALIVE_S (aiohttp's default keep-alive).

Errors, in the terms the relay answers with:
- ConnectFailed: no connection was made, so no byte of the request went out (safe to send elsewhere).
- Disconnected: the connection closed or reset before the response head was complete.
- ResponseError: the upstream broke HTTP/1.1 (bad status line, Content-Length, chunk framing ...).
- asyncio.TimeoutError: the connect timeout, or no byte for read_timeout_s while a response was awaited.
"""

from __future__ import annotations

import asyncio
import collections
import socket
from typing import AsyncIterable, Callable, Iterable

import httptools

# aiohttp's TCPConnector keepalive_timeout: a connection idle this long is closed rather than reused, which
# stays below common servers' own idle limits (nginx 75 s) so a reused connection is rarely one they drop.
KEEPALIVE_S = 15.0
# Body bytes buffered from the upstream before reading from it pauses until the relay catches up.
READ_HIGH_WATER = 1 << 18
# A response head larger than this is refused (ResponseError): the parser would otherwise hold it all in memory.
# Well above what routers send (smg answers a 1 MB request header with 431).
MAX_HEAD_BYTES = 8 << 20
_QUICKACK = getattr(socket, "TCP_QUICKACK", None)  # Linux only


class ConnectFailed(OSError):
    """The connection to the upstream could not be made; nothing was sent."""


class Disconnected(ConnectionError):
    """The upstream closed or reset the connection before its response head was complete."""


class ResponseError(Exception):
    """The upstream's response is not valid HTTP/1.1 (the httptools parser's error, or a cut body)."""


class _Conn(asyncio.Protocol):
    """One upstream connection and the response being read on it (httptools callbacks)."""

    __slots__ = ("transport", "parser", "key", "idle_since", "closed", "_loop", "_read_timeout", "_timer",
                 "_waiter", "_write_waiter", "status", "reason", "headers", "framed", "head_done", "done",
                 "exc", "got_bytes", "_chunks", "_buffered", "_paused", "head_only", "keep_alive", "_sock",
                 "_head_bytes", "on_complete", "early")

    def __init__(self, loop: asyncio.AbstractEventLoop, key: str, read_timeout: float):
        self._loop = loop
        self.key = key
        self._read_timeout = read_timeout
        self.transport: asyncio.Transport | None = None
        self._sock = None
        self.parser = httptools.HttpResponseParser(self)
        self.idle_since = 0.0
        self.closed = False
        self._timer: asyncio.TimerHandle | None = None
        self._waiter: asyncio.Future | None = None
        self._write_waiter: asyncio.Future | None = None
        self._reset(False)

    def _reset(self, head_only: bool) -> None:
        self.status = 0
        self.reason = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.framed = False  # Content-Length or chunked: the body's end is known without the connection's
        self.head_done = False
        self.done = False
        self.exc: BaseException | None = None
        self.got_bytes = False
        self._head_bytes = 0
        self._chunks: list[bytes] = []
        self._buffered = 0
        self._paused = False
        self.head_only = head_only  # a HEAD request: the response ends with its head
        self.keep_alive = False
        # Called with this connection as soon as the whole response is in, before the waiting relay
        # resumes; what it returns is the exchange's ``early`` (see ConnectionPool.exchange).
        self.on_complete: Callable[[_Conn], object] | None = None
        self.early = None

    # --- asyncio.Protocol ---

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        if _QUICKACK is not None:
            self._sock = transport.get_extra_info("socket")

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        if self.done or self.exc is not None:
            # Bytes after a complete response (none were asked for), or after an error: not reusable.
            self.closed = True
            if self.exc is None and not self.head_done:
                self.exc = ResponseError("bytes from the upstream with no request outstanding")
            self.transport.close()
            self._wake()
            return
        if not self.head_done:
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD_BYTES:
                self.exc = ResponseError(f"response head over {MAX_HEAD_BYTES} bytes")
                self.closed = True
                self.transport.close()
                self._wake()
                return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self.exc = ResponseError("the upstream switched protocols")
        except httptools.HttpParserError as exc:
            if not (self.done and self.head_only):  # a HEAD response's body bytes are not read (see below)
                self.exc = ResponseError(str(exc) or type(exc).__name__)
            self.closed = True
            self.transport.close()
        if self.head_done and not self.done:
            # A response still streaming (SSE): ACK what arrived at once. On a reused connection Linux delays
            # ACKs to ride on the next request, and an upstream with Nagle on (smg) then holds its next small
            # piece until the delayed-ACK timer: about 40 ms per stream.
            if self._sock is not None:
                try:
                    self._sock.setsockopt(socket.IPPROTO_TCP, _QUICKACK, 1)
                except OSError:
                    self._sock = None
            if self._buffered > READ_HIGH_WATER and not self._paused:
                self._paused = True
                self.transport.pause_reading()
        hook = self.on_complete
        if hook is not None and self.done and self.exc is None:
            self.on_complete = None
            self.early = hook(self)
        self._wake()

    def eof_received(self) -> bool:
        self._lost(None)
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost(exc)
        if self._write_waiter is not None and not self._write_waiter.done():
            self._write_waiter.set_exception(Disconnected(f"connection lost while sending: {exc}"))

    def pause_writing(self) -> None:
        if self._write_waiter is None or self._write_waiter.done():
            self._write_waiter = self._loop.create_future()

    def resume_writing(self) -> None:
        w = self._write_waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.done or self.exc is not None:
            return
        if self.head_done and not self.framed:
            self.done = True  # a close-delimited body ends with the connection
        elif self.head_done:
            self.exc = ResponseError(f"the upstream closed the connection mid-body ({exc or 'EOF'})")
        else:
            self.exc = Disconnected(f"the upstream closed the connection before answering ({exc or 'EOF'})")
        self._wake()

    # --- httptools callbacks ---

    def on_message_begin(self) -> None:
        if self.done:  # a second response to one request: the upstream is broken, the connection unusable
            raise httptools.HttpParserError("a response with no request outstanding")

    def on_status(self, reason: bytes) -> None:
        self.reason += reason

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.head_done:
            return  # a trailer after a chunked body: not relayed (aiohttp's client drops them too)
        lname = name.lower()
        if lname == b"content-length" or (lname == b"transfer-encoding" and b"chunked" in value.lower()):
            self.framed = True
        self.headers.append((name, value.rstrip(b" \t")))

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if 100 <= status < 200 and status != 101:
            # Informational (100 Continue, 103 Early Hints): the final response follows; aiohttp skips them too.
            self.reason, self.headers, self.framed = b"", [], False
            return
        self.status = status
        self.head_done = True
        self.keep_alive = self.parser.should_keep_alive()
        if self.head_only:
            # A HEAD response has no body whatever its Content-Length says (httptools cannot be told), so the
            # response ends here and the connection is not reused: any bytes after the head are not read.
            self.done = True
            self.keep_alive = False
            raise httptools.HttpParserError("HEAD response complete")

    def on_body(self, body: bytes) -> None:
        self._chunks.append(body)
        self._buffered += len(body)

    def on_message_complete(self) -> None:
        if self.head_done:
            self.done = True

    # --- the relay's side ---

    def take(self) -> bytes:
        """The body bytes buffered now (b"" when none); reading resumes if it was paused."""
        chunks = self._chunks
        if not chunks:
            return b""
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        self._chunks = []
        self._buffered = 0
        if self._paused and not self.closed:
            self._paused = False
            self.transport.resume_reading()
        return data

    def _wake(self) -> None:
        w = self._waiter
        if w is not None:
            self._waiter = None
            if not w.done():
                w.set_result(None)

    def _on_timeout(self) -> None:
        self._timer = None
        w = self._waiter
        if w is not None and not w.done():
            self._waiter = None
            w.set_exception(asyncio.TimeoutError())

    async def _wait(self) -> None:
        self._waiter = w = self._loop.create_future()
        if self._read_timeout:
            self._timer = self._loop.call_later(self._read_timeout, self._on_timeout)
        try:
            await w
        finally:
            self._waiter = None
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

    async def drain(self) -> None:
        """Wait until the transport's write buffer is below its high-water mark."""
        w = self._write_waiter
        if w is not None and not w.done():
            await w
        if self.closed and self.exc is not None and not self.head_done:
            raise self.exc

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class Exchange:
    """One request's response on a pooled connection: status, reason, headers, then ``read()``.

    ``release()`` (always, in a finally) gives the connection back to the pool when the response was read
    to its end and the upstream keeps it alive; else it is closed, which cancels the upstream's work.
    """

    __slots__ = ("_pool", "_conn", "status", "reason", "headers", "early")

    def __init__(self, pool: "ConnectionPool", conn: _Conn):
        self._pool = pool
        self._conn = conn
        self.status = conn.status
        self.reason = conn.reason
        self.headers = conn.headers
        self.early = conn.early  # what exchange()'s on_complete returned, or None

    @property
    def failed(self) -> BaseException | None:
        """The error already seen on this response (before any of its body was read), or None."""
        return self._conn.exc

    @property
    def complete(self) -> bool:
        """The whole body is already buffered: ``read()`` returns it, then b""."""
        return self._conn.done

    async def read(self) -> bytes:
        """The body bytes that arrived since the last call (at least one byte), or b"" at the end.
        Raises ResponseError when the upstream breaks the body's framing or cuts it, TimeoutError when it
        sends nothing for read_timeout_s."""
        c = self._conn
        while True:
            if c._chunks:
                return self.take()
            if c.exc is not None:
                raise c.exc
            if c.done:
                return b""
            await c._wait()

    def take(self) -> bytes:
        """The body bytes buffered now (b"" when none), without waiting: all of it once ``complete``."""
        return self._conn.take()

    def release(self) -> None:
        c, self._conn = self._conn, None
        if c is None:
            return
        self._pool._release(c)


class ConnectionPool:
    """Idle keep-alive connections per upstream base URL (scheme http only).

    connect_timeout_s, read_timeout_s (0 = none) in seconds; limit: most connections in use at once over
    every upstream (0 = no limit; a request over it waits for one to free, as aiohttp's connector does).
    """

    def __init__(self, connect_timeout_s: float, read_timeout_s: float, limit: int = 0):
        self._connect_timeout = connect_timeout_s
        self._read_timeout = read_timeout_s or 0.0
        self._idle: dict[str, collections.deque[_Conn]] = {}
        self._addr: dict[str, tuple[str, int]] = {}
        self._limit = asyncio.Semaphore(limit) if limit > 0 else None
        self._open: set[_Conn] = set()
        self.connections_made = 0  # for tests and figures: how many TCP connections were opened

    def set_address(self, key: str, host: str, port: int) -> None:
        """Where connections for ``key`` (a base URL) go."""
        self._addr[key] = (host, port)

    async def exchange(self, key: str, head: bytes, body: bytes | Iterable[bytes | memoryview] | AsyncIterable[bytes],
                       size: int, method: str, retry: bool, piece_bytes: int,
                       on_complete: Callable[[_Conn], object] | None = None) -> Exchange:
        """Send ``head`` (request line and headers, ending with the blank line) and ``body`` (``size``
        bytes: one bytes object, or pieces sent one by one with the event loop given back between them, or
        pieces that arrive as the client sends them, an async iterable)
        to ``key``'s upstream and wait for the response head. retry: resend once on a new connection when
        the connection closes before any response byte (only for a bytes body and a method safe to send
        twice, RFC 9112 section 9.3.1). Raises ConnectFailed, Disconnected, ResponseError, TimeoutError.

        on_complete: called with the connection (its ``status``, ``reason``, ``headers`` and ``take()``, as an
        Exchange has them) as soon as the whole response has arrived without error, inside the connection's
        data callback, before this coroutine resumes; what it returns becomes the exchange's ``early``. A small
        answer then reaches the client a loop turn (and the relay's coroutine frames) sooner. It must not
        raise."""
        if self._limit is not None:
            await self._limit.acquire()  # outside the try: a wait cancelled here holds nothing to release
        try:
            conn = await self._get(key, method == "HEAD")
            try:
                await self._send_and_wait_head(conn, head, body, size, piece_bytes, on_complete)
            except Disconnected:
                conn.close()
                self._open.discard(conn)
                if not (retry and not conn.got_bytes and isinstance(body, bytes)):
                    raise
                conn = await self._connect(key, method == "HEAD")
                try:
                    await self._send_and_wait_head(conn, head, body, size, piece_bytes, on_complete)
                except BaseException:
                    conn.close()
                    self._open.discard(conn)
                    raise
            except BaseException:
                conn.close()
                self._open.discard(conn)
                raise
        except BaseException:
            if self._limit is not None:
                self._limit.release()
            raise
        conn.on_complete = None  # the relay has the head now: the rest is its to read, however it arrives
        return Exchange(self, conn)

    async def _send_and_wait_head(self, conn: _Conn, head: bytes, body, size: int, piece_bytes: int,
                                  on_complete) -> None:
        conn.on_complete = on_complete
        await self._send(conn, head, body, size, piece_bytes)
        while not conn.head_done and conn.exc is None:
            await conn._wait()
        if conn.exc is not None and not conn.head_done:
            raise conn.exc

    async def _send(self, conn: _Conn, head: bytes, body, size: int, piece_bytes: int) -> None:
        t = conn.transport
        if isinstance(body, (bytes, bytearray)) and size <= piece_bytes:
            t.write(head + body if size else head)
            return
        t.write(head)
        if hasattr(body, "__aiter__"):  # a body sent on as it arrives from the client (relay.BodyStream)
            async for piece in body:
                if conn.closed:
                    break  # the upstream answered (an early error) or went away: its answer is read next
                t.write(piece)
                await conn.drain()
            return
        pieces = _pieces(body, piece_bytes) if isinstance(body, (bytes, bytearray)) else body
        for piece in pieces:
            if conn.closed:
                break  # the upstream answered (an early error) or went away: its answer is read next
            t.write(piece)
            await conn.drain()
            await asyncio.sleep(0)  # other clients are served between pieces

    async def _get(self, key: str, head_only: bool) -> _Conn:
        idle = self._idle.get(key)
        if idle:
            now = asyncio.get_running_loop().time()
            while idle:
                conn = idle.pop()  # the most recently used: the least likely to have been closed by the peer
                if conn.closed or now - conn.idle_since > KEEPALIVE_S:
                    conn.close()
                    self._open.discard(conn)
                    continue
                conn._reset(head_only)
                return conn
        return await self._connect(key, head_only)

    async def _connect(self, key: str, head_only: bool) -> _Conn:
        loop = asyncio.get_running_loop()
        host, port = self._addr[key]
        try:
            async with asyncio.timeout(self._connect_timeout or None):
                _, conn = await loop.create_connection(lambda: _Conn(loop, key, self._read_timeout), host, port)
        except OSError as exc:
            raise ConnectFailed(exc.errno, f"cannot connect to {host}:{port}: {exc.strerror or exc}") from exc
        self.connections_made += 1
        self._open.add(conn)
        conn._reset(head_only)
        return conn

    def _release(self, conn: _Conn) -> None:
        if self._limit is not None:
            self._limit.release()
        if conn.done and conn.keep_alive and not conn.closed and not conn._chunks:
            if conn._paused:
                conn._paused = False
                conn.transport.resume_reading()
            conn.idle_since = now = asyncio.get_running_loop().time()
            idle = self._idle.setdefault(conn.key, collections.deque())
            # The oldest idle connection goes once the peer closed it or it sat idle too long (reuse takes the
            # newest, so the oldest would otherwise stay open after a burst).
            while idle and (idle[0].closed or now - idle[0].idle_since > KEEPALIVE_S):
                old = idle.popleft()
                old.close()
                self._open.discard(old)
            idle.append(conn)
        else:
            conn.close()
            self._open.discard(conn)

    def idle_count(self, key: str) -> int:
        """Idle connections kept for ``key`` now."""
        return len(self._idle.get(key, ()))

    def close(self) -> None:
        """Close every connection, idle or in use."""
        for conn in list(self._open):
            conn.close()
        self._open.clear()
        self._idle.clear()


def _pieces(body: bytes, size: int):
    view = memoryview(body)
    for i in range(0, len(view), size):
        yield view[i:i + size]
