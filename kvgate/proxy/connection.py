"""One client connection of kvgate's HTTP/1.1 server: the asyncio Protocol and httptools (llhttp) callbacks
(I/O edge), a thin shell over the pure rules: the wire's (kvgate.proxy.wire: limits, refusals, framing), the
connection's phase and pause reasons (kvgate.proxy.conn_state), the body budget's (kvgate.proxy.body_budget,
kept by the server). The request it parses is a kvgate.proxy.request.Request; kvgate.proxy.server listens,
keeps the connections' timers and the budget, and says what the server guarantees.

A connection reads and answers its requests in order: one is answered at a time (a pipelined one waits,
reading paused), its handler in a task of its own; after a refusal, a malformed request or a
``Connection: close`` answer it reads nothing more, half-closes and lingers (``LINGER_S``). No refusal raises,
whatever bytes follow it in the same read: once stopped, the parser's callbacks stop it (``_Stop``).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

import httptools
from aiohttp import web

from kvgate.proxy.conn_state import Pause, Phase, ReadControl
from kvgate.proxy.request import Request
from kvgate.proxy.wire import (BAD_VERSION, COMMON, CONNECT_ANSWER, METHODS, VERSIONS, BadRequest, budget_retry_after_s,
                               error_answer,
                               error_body, origin_form, request_line_at)

if TYPE_CHECKING:
    from kvgate.proxy.server import HttpServer

log = logging.getLogger("kvgate.proxy.server")

# Body bytes buffered before reading from the client pauses until the handler takes them.
BODY_HIGH_WATER = 1 << 18
# A body of unknown length (chunked) takes the in-flight body budget in steps of this many bytes.
BUDGET_STEP = 1 << 20
# After the last answer on a connection kvgate closes (a refusal before the body was read, Connection: close,
# a malformed request), the client's remaining bytes are read and dropped for at most this long before the
# connection closes, so the answer is not lost to a reset (nginx's lingering_close; its lingering_timeout is 5 s).
LINGER_S = 5.0
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_GONE = "the client closed the connection"
_WRITE = Pause.WRITE.value
_BODY = Pause.BODY.value
_STOPPED = Pause.STOPPED.value
_OPEN, _CLOSING, _LOST = Phase.OPEN, Phase.CLOSING, Phase.LOST  # module names: no class lookup per request
# The lengths of the header names the connection reads itself: Upgrade, Expect, Content-Length, Transfer-Encoding.
_FRAMING_NAME_LENGTHS = frozenset(len(n) for n in (b"upgrade", b"expect", b"content-length", b"transfer-encoding"))


class _Stop(Exception):
    """Raised in a parser callback once the connection stopped reading: the parser is given nothing more."""


class Connection(asyncio.Protocol):
    """One client connection: the httptools parser's callbacks, the request being read, the one being
    answered and any pipelined behind it. Its phase and why its reading is paused: ``ctl`` (ReadControl)."""

    __slots__ = ("server", "loop", "transport", "parser", "ctl", "_url", "_fields", "_expect", "_length",
                 "_chunked_in", "_in_head", "_head_bytes", "_trailer_bytes", "_reading", "current", "_queue",
                 "task", "_drain_waiter", "_refused", "_limit_error", "_lim", "_max_fields", "_max_field", "_max_head",
                 "_max_line", "_upgrade", "_synthetic", "_pending_error", "_next_waiting", "_timed", "_chunk", "_seen",
                 "_seen_more", "_seen_at", "_seen_room", "_line_room", "__weakref__")

    def __init__(self, server: "HttpServer"):
        self.server = server
        self.loop = server.loop
        self.transport: asyncio.Transport | None = None
        self.parser: httptools.HttpRequestParser | None = None  # made when bytes come, dropped between requests
        self.ctl = ReadControl()
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
        self._drain_waiter: asyncio.Future | None = None
        self._refused = False  # a body refused (413): further body bytes are dropped
        self._limit_error: BadRequest | None = None
        self._lim = server.limits
        self._max_fields = 2 * self._lim.header_count  # _fields holds a name and a value per header
        self._max_field = self._lim.header_line_bytes
        self._max_head = self._lim.head_bytes
        self._max_line = self._lim.request_line_bytes
        self._line_room = self._max_line + 16  # bytes of later reads kept for a request line begun in one
        self._upgrade = False  # the request being read asked for Upgrade: its body is read as a plain one's
        self._synthetic = False  # the parser is reading the framing-only head that follows an Upgrade
        self._pending_error: BadRequest | None = None  # answered once the requests before it are
        self._next_waiting = False  # the next request waits for the client to read the answers written
        self._timed = False  # in the server's table of heads or bodies still arriving
        self._chunk: bytes | None = None  # the read being parsed
        # for the request-line check (wire.request_line_at, once its head is read): the read in which the
        # request began, the reads after it (at most a request line's worth), and where in the first the
        # request lines already checked end
        self._seen: bytes | None = None
        self._seen_more: list[bytes] | None = None
        self._seen_at = 0
        self._seen_room = 0  # bytes of later reads still kept for the request line (it starts in the first)

    # --- what the request and the server read ---

    @property
    def lost(self) -> bool:
        return self.ctl.phase is _LOST

    @property
    def closing(self) -> bool:
        return self.ctl.phase >= _CLOSING

    @property
    def write_paused(self) -> bool:
        return bool(self.ctl.bits & _WRITE)

    @property
    def read_paused(self) -> bool:
        """kvgate stopped reading this connection (its turn, the budget, the handler): not the client's delay."""
        return self.ctl.paused

    # --- asyncio.Protocol ---

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  (asyncio and uvloop set TCP_NODELAY)
        self.server.opened(self)

    def data_received(self, data: bytes) -> None:
        if self.ctl.bits & _STOPPED:
            return  # after a malformed request, a refusal or a Connection: close: dropped
        in_head = self._in_head
        if in_head or self._reading is None:
            n = len(data)
            head = self._head_bytes = self._head_bytes + n
            if head > self._max_head:
                self._bad(BadRequest(431, f"request head over {self._max_head} bytes"))
                return
            if in_head and self._seen_room > 0:
                self._seen_room -= n
                if self._seen_more is None:
                    self._seen_more = [data]
                else:
                    self._seen_more.append(data)
        self._chunk = data
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
                        self.ctl.stop()
                        self.parser = None
                        return
                    # Upgrade: kvgate relays no other protocol, so the request is a plain one (as smg
                    # serves it) and its body is read on: a fresh parser is given the body's framing alone,
                    # then the bytes after the head.
                    self._upgrade = False
                    data = data[exc.args[0]:] if exc.args else b""
                    parser = self.parser = httptools.HttpRequestParser(self)
                    self._synthetic = True
                    length = self._reading.content_length if self._reading is not None else 0
                    framing = (b"Transfer-Encoding: chunked\r\n" if self._chunked_in and length is None
                               else b"Content-Length: %d\r\n" % (length or 0))
                    parser.feed_data(b"PUT / HTTP/1.1\r\n" + framing + b"\r\n")
            self._chunk = None
            if self._reading is None and not self._in_head:
                # Between messages: a request waiting for its answer (admission) keeps no parser.
                self.parser = None
                self._seen = self._seen_more = None
            elif not self.ctl.bits & _STOPPED:
                self._timed = True
                self.server.reading_now(self, self._in_head)
        except httptools.HttpParserCallbackError as exc:
            err = self._limit_error
            if err is not None:
                self._bad(err)
            elif not self.ctl.bits & _STOPPED:
                raise RuntimeError("an HTTP parser callback failed") from exc.__context__
            # else: the connection answered its last request inside a callback; what followed is dropped
        except httptools.HttpParserError as exc:
            if not self.ctl.bits & _STOPPED:
                self._bad(BadRequest(400, f"{type(exc).__name__}: {exc}"))

    def eof_received(self) -> bool:
        return False  # the client half-closed: close, which cancels a handler still running

    def connection_lost(self, exc: Exception | None) -> None:
        self.ctl.advance(_LOST)
        self.ctl.stop()
        server = self.server
        server.closed(self)
        req = self._reading
        if req is not None:
            req.wake()
            server.release_budget(req)
        task = self.task
        if task is not None and not task.done():
            task.cancel()  # the client left: its handler ends, which closes the upstream call
        w = self._drain_waiter
        if w is not None and not w.done():
            w.set_exception(ConnectionResetError(_GONE))
            w.exception()  # retrieved: nobody may be waiting
        for q in self._queue or ():
            server.release_budget(q)
        self._queue = None

    def pause_writing(self) -> None:
        # The answers written wait in the transport: read no further request until the client takes them.
        self.pause(Pause.WRITE)

    def resume_writing(self) -> None:
        self.resume(Pause.WRITE)
        w = self._drain_waiter
        if w is not None and not w.done():
            w.set_result(None)
        if self._next_waiting:
            self._next_waiting = False
            self._next()

    async def drain(self) -> None:
        """Wait until the client has read enough of what was written. Raises ConnectionResetError once it left."""
        if self.ctl.phase is _LOST:
            raise ConnectionResetError(_GONE)
        if not self.write_paused:
            return
        w = self._drain_waiter
        if w is None or w.done():
            w = self._drain_waiter = self.loop.create_future()
        await w

    def pause(self, reason: Pause = Pause.NONE) -> None:
        """Stop reading, for ``reason`` (see conn_state.Pause)."""
        if self.ctl.pause(reason):
            self.transport.pause_reading()

    def resume(self, reason: Pause) -> None:
        """``reason`` no longer holds: read again unless another does (or the connection is closing)."""
        if self.ctl.clear(reason):
            self.transport.resume_reading()

    # --- httptools callbacks ---

    def on_message_begin(self) -> None:
        if self.ctl.bits & _STOPPED:
            raise _Stop
        self._in_head = True
        chunk = self._chunk
        if self._seen is not chunk:  # this request's line starts in the read being parsed
            self._seen = chunk
            self._seen_more = None
            self._seen_at = 0
        self._seen_room = self._line_room
        if self._synthetic:
            return
        self._url = b""
        self._fields = []
        self._expect = self._length = None
        self._chunked_in = self._upgrade = False
        self._trailer_bytes = 0

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
            if self._trailer_bytes > self._lim.trailer_bytes:
                raise self._refusal(400, f"trailer section over {self._lim.trailer_bytes} bytes")
            return
        n = len(name)
        if n + len(value) > self._max_field:
            raise self._refusal(431, f"a header line over {self._max_field} bytes")
        fields = self._fields
        if len(fields) >= self._max_fields:
            raise self._refusal(431, f"more than {self._max_fields // 2} header lines")
        if n in _FRAMING_NAME_LENGTHS:  # (one set lookup: most headers are none of these)
            lname = name.lower()
            if lname == b"content-length":
                try:
                    self._length = int(value)
                except ValueError:
                    pass  # llhttp refuses the request
            elif lname == b"expect":
                self._expect = value.strip().lower()
            elif lname == b"upgrade":
                self._upgrade = True
            elif lname == b"transfer-encoding":
                self._chunked_in = b"chunked" in value.lower()
        value = value.rstrip(b" \t")
        fields += (COMMON.get(name, name), COMMON.get(value, value))  # (in place: the same list)

    def on_headers_complete(self) -> None:
        if self.ctl.bits & _STOPPED:
            raise _Stop
        p = self.parser
        self._in_head = False
        self._head_bytes = 0
        server = self.server
        if self._timed:  # the head took more than one read
            self._timed = False
            server.heads.drop(self)
        if self._synthetic:  # the framing-only head after an Upgrade: the body that follows is the request's
            self._synthetic = False
            self._fields = []
            return
        url = self._url
        if not url.isascii():
            raise self._refusal(400, "a byte that is not ASCII in the URL")
        v = p.get_http_version()
        version = VERSIONS.get(v)
        if version is None:  # HTTP/0.9 (no version) or 2.0 and above on an HTTP/1 connection: as smg answers them
            raise self._refusal(*BAD_VERSION.get(v[:1], BAD_VERSION["2"]))
        method = p.get_method()
        seen = self._seen
        if seen is not None:  # the request line in its strict form (wire.request_line_at), as smg requires
            if self._seen_more is not None:
                seen = self._seen = b"".join((seen, *self._seen_more))
                self._seen_more = None
            ok, self._seen_at = request_line_at(seen, self._seen_at, method, url, v)
            if not ok:
                raise self._refusal(400, "a request line not of the form METHOD SP target SP HTTP/x.y "
                                         "(one space between its parts)")
        if method == b"CONNECT":  # kvgate tunnels nothing; smg answers CONNECT the same way
            raise self._refusal(*CONNECT_ANSWER)
        if self._upgrade:  # an Upgrade header: llhttp stops at the head only when Connection names it too
            self._upgrade = p.should_upgrade()
        chunked = self._chunked_in
        if chunked and version == (1, 0):
            # RFC 9112 6.1: Transfer-Encoding on HTTP/1.0 is faulty framing; smg and nginx answer 400
            raise self._refusal(400, "Transfer-Encoding on an HTTP/1.0 request")
        if url[0] != 0x2F and url != b"*":  # not origin-form (/...): absolute-form
            url = origin_form(url)
        length = self._length
        req = Request(self, METHODS.get(method) or method.decode("ascii"), url.decode("ascii"), tuple(self._fields),
                      version, p.should_keep_alive(), self._expect, length, server.client_max_size)
        self._fields = []
        self._reading = req
        if (length or chunked) and server.body_limit is not None:  # (only a body needs its limit)
            req.max_body = server.body_limit(req)
        if length is not None and length > req.max_body:
            # Refused from its head: the body is not read, the answer goes when its turn comes, then the close.
            req.early = BadRequest(413, f"a body of {length} bytes is over the limit of {req.max_body}")
            self._refused = True
        elif length or chunked:
            req.ticket = t = server.budget.admit(req, length if length is not None else BUDGET_STEP)
            if t.want:  # no room now: its body waits (reading paused) until granted or refused
                self.pause(Pause.BUDGET)
        if self.current is None:
            self._dispatch(req)
        else:  # pipelined behind the request being answered: read no more until its turn
            if self._queue is None:
                self._queue = []
            self._queue.append(req)
            self.pause(Pause.PIPELINED)

    def on_body(self, body: bytes) -> None:
        req = self._reading
        if req is None or self._refused:
            return
        ctl = self.ctl
        if ctl.bits & _STOPPED:
            raise _Stop
        buffered = req.feed(body)
        ticket = req.ticket
        if ticket is not None and req.received > ticket.held and req.content_length is None and not ticket.want:
            # chunked: the next step of the body budget (reading pauses while the budget is full)
            if not self.server.budget.take(ticket, req.received - ticket.held + BUDGET_STEP):
                self.pause(Pause.BUDGET)
        if buffered > BODY_HIGH_WATER and not ctl.bits & _BODY:
            self.pause(Pause.BODY)

    def on_message_complete(self) -> None:
        if self._upgrade:
            return  # the head of an Upgrade request: its body is read next (data_received)
        req = self._reading
        if req is not None:
            self._reading = None
            if self._timed:  # the body took more than one read
                self._timed = False
                self.server.bodies.drop(self)
            req.end()

    # --- what the request tells the connection ---

    def body_taken(self) -> None:
        """The handler took the body bytes buffered: read on (unless another reason holds)."""
        self.resume(Pause.BODY)

    def refuse_body(self) -> None:
        """The handler refused the body being read (413): drop what else arrives, close after the answer."""
        self._refused = True
        self.ctl.advance(_CLOSING)
        if self._reading is not None:
            self._reading.drop_body()

    def granted(self, req: Request) -> None:
        """The body budget has room for ``req`` now: read its body (and send the 100 Continue it waits for)."""
        if (req is self.current and req.expect == b"100-continue" and req.version >= (1, 1) and not req.body_done
                and self.ctl.phase is not _LOST):
            self.transport.write(_CONTINUE)
        self.resume(Pause.BUDGET)

    def budget_timeout(self, req: Request) -> None:
        """``req`` waited body_budget_wait_s for room in the body budget: 503, then the connection closes."""
        self.ctl.clear(Pause.BUDGET)
        err = BadRequest(503, "kvgate's in-flight request body budget stayed full",
                         retry_after_s=budget_retry_after_s(self.server.limits.body_budget_wait_s))
        log.info("request body from %s waited too long for the body budget, answered 503", self._peer())
        self.ctl.stop()
        self.ctl.advance(_CLOSING)
        if req is self.current:  # the handler's read raises it
            req.fail(err)
        else:
            req.early = err

    # --- requests ---

    def _dispatch(self, req: Request) -> None:
        """Start answering ``req``: its handler runs in a task of its own (cancelled when the client goes),
        and _done writes what it returned. No wrapper coroutine: a waiting request keeps only the
        handler's own."""
        self.current = req
        server = self.server
        server.idle.pop(self, None)  # busy
        early = req.early
        if early is not None:
            self._answer(req, web.Response(status=early.status, text=error_body(early.status, early),
                                           headers=early.headers()))
            return
        expect = req.expect
        if expect is not None and req.version >= (1, 1):
            if expect != b"100-continue":
                self._answer(req, web.HTTPExpectationFailed(text=f"Unknown Expect: {expect.decode('latin-1')}"))
                return
            if not req.body_done and not (req.ticket is not None and req.ticket.want):
                self.transport.write(_CONTINUE)  # (one waiting for the body budget is sent it once granted)
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
        if (req is not self.current or task is None or task.done() or self.ctl.phase is not _OPEN
                or not req.keep_alive or not req.body_done or self.server.closing):
            return  # answered from _done (the task ended), or the connection closes after this answer
        self.server.finishing[task] = req
        self._finished(req)

    def _done(self, task: asyncio.Task) -> None:
        req = self.current
        if task is not self.task or req is None:  # detached (answered) or ended after its connection moved on
            done = self.server.finishing.pop(task, None)
            if done is not None and not task.cancelled() and task.exception() is not None:  # logged, never lost
                log.error("error handling %s %s after its answer", done.method, done.raw_path,
                          exc_info=task.exception())
            return
        if task.cancelled():  # the client left, or shutdown cancelled it
            if self.ctl.phase is not _LOST:
                self.ctl.advance(_CLOSING)
                self.transport.close()  # cancelled by shutdown: the connection goes too
            self._finished(req)
            return
        exc = task.exception()
        if exc is None:
            resp = task.result()
        elif isinstance(exc, web.HTTPException):
            resp = exc
        elif isinstance(exc, BadRequest):  # the body's framing broke while the handler read it (logged once)
            resp = web.Response(status=exc.status, text=error_body(exc.status, exc), headers=exc.headers())
        elif isinstance(exc, Exception):
            log.error("error handling %s %s", req.method, req.raw_path, exc_info=exc)
            resp = None if req.sent else web.Response(status=500, text="500 Internal Server Error")
            if req.sent:
                self.ctl.advance(_CLOSING)
        else:  # KeyboardInterrupt, SystemExit: not ours to answer
            self.ctl.advance(_CLOSING)
            resp = None
        self._answer(req, resp)

    def _answer(self, req: Request, resp) -> None:
        """Write ``resp`` unless the handler answered on the request itself; then the next request."""
        if self.ctl.phase is not _LOST:
            try:
                if req.sent == 0 and resp is not None:
                    req.write_response(resp, self.server.date)
                elif req.sent != 2:  # a streamed answer the handler did not end (the client sees it cut), or none
                    self.ctl.advance(_CLOSING)
            except Exception:
                log.exception("error writing the answer to %s %s", req.method, req.raw_path)
                self.ctl.advance(_CLOSING)
        self._finished(req)

    def _finished(self, req: Request) -> None:
        self.task = None
        self.current = None
        server = self.server
        ticket = req.ticket
        if ticket is not None:
            req.ticket = None  # the ticket points back at the request: no cycle left for the GC
            granted = server.budget.release(ticket)
            if granted:
                server.grant(granted)
        ctl = self.ctl
        phase = ctl.phase
        if phase is _LOST:
            return
        if phase is not _OPEN or not req.keep_alive or not req.body_done or server.closing:
            self._close_after()
            return
        if ctl.bits & _WRITE:  # the client has not read the answers written: the next request waits
            self._next_waiting = True
            server.idle[self] = self.loop.time()  # a client that never reads them is closed after keepalive_s
            return
        if self._queue is None and self._pending_error is None:  # nothing waits its turn: _next, in short
            server.idle[self] = self.loop.time()
            return
        self._next()

    def _next(self) -> None:
        """Answer the next pipelined request, or the malformed one after them (then close), or go idle."""
        queue = self._queue
        if queue:
            nxt = queue.pop(0)
            if not queue:
                self._queue = None
                self.resume(Pause.PIPELINED)
            self._dispatch(nxt)
            return
        err = self._pending_error
        if err is not None:
            self._pending_error = None
            self._write_error(err)
            return
        self.server.idle[self] = self.loop.time()  # idle since now: closed after keepalive_s

    def _close_after(self) -> None:
        """Close once the answer is written: half-close, then drop what the client still sends for at most
        LINGER_S (until its own close), so it reads the answer first. Always, not only when a body is
        unread: a pipelined request behind a ``Connection: close`` one may still be in flight, and bytes
        arriving at a closed socket make the kernel reset the connection, which can discard the answer
        before the client reads it (nginx lingers when it sees such bytes; kvgate cannot see those in flight)."""
        self.ctl.advance(_CLOSING)
        self.ctl.stop()
        if self.transport.is_closing():
            return
        self._linger()

    def _linger(self) -> None:
        self.parser = None
        self._reading = None
        self.ctl.linger()
        try:
            self.transport.write_eof()
        except (OSError, RuntimeError, NotImplementedError):
            self.transport.close()
            return
        self.transport.resume_reading()
        self.server.lingering(self)

    def _peer(self) -> str:
        peer = self.transport.get_extra_info("peername") if self.transport is not None else None
        return peer[0] if peer else "?"

    def _bad(self, err: BadRequest) -> None:
        """Answer a request kvgate cannot read (after the ones before it), log one line, close."""
        log.info("bad request from %s: %s, answered %d", self._peer(), err, err.status)
        self._limit_error = None
        self.parser = None
        self.pause(Pause.STOPPED)
        self.server.heads.drop(self)
        self.server.bodies.drop(self)
        req, self._reading = self._reading, None
        if req is not None and req is self.current:  # its body broke mid-way: the handler's read raises
            req.fail(err)
            return
        if req is not None and self._queue and req is self._queue[-1]:  # its body broke while it waited its turn
            self._queue.pop()
            self.server.release_budget(req)
            if not self._queue:
                self._queue = None
        if self.current is not None or self._queue:  # the requests before it are answered first, in order
            self._pending_error = err
            return
        self._write_error(err)

    def _write_error(self, err: BadRequest) -> None:
        self.ctl.advance(_CLOSING)
        self.transport.write(error_answer(err))
        self._linger()  # the client may still be sending: it reads the answer rather than a reset

    def timed_out(self, what: str) -> None:
        """A head or a body stopped arriving for header_timeout_s / body_timeout_s: 408, then close."""
        err = BadRequest(408, f"the request {what} did not arrive in time")
        req = self._reading
        if req is not None and req is self.current:
            log.info("request %s from %s stopped arriving, answered 408", what, self._peer())
            self.ctl.stop()
            self.ctl.advance(_CLOSING)
            self.parser = None
            self._reading = None
            req.fail(err)
            return
        self._bad(err)

    def close(self) -> None:
        self.ctl.advance(_CLOSING)
        if self.transport is not None and self.ctl.phase is not _LOST:
            self.transport.close()
