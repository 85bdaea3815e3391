"""kvgate's HTTP/1.1 server for its clients: the asyncio shell (I/O edge) over its pure parts.

The client side's counterpart of kvgate.proxy.connection_pool: one small Protocol object per connection,
the request parsed by httptools (llhttp) as it arrives, one task per request (cancelled when the client goes
away, which closes the upstream call), and the answer written as bytes the relay built (no header objects on the
hot path). What it decides is not decided here: the wire rules (limits, refusals, framing, headers) are
kvgate.proxy.wire's, a connection's phase and pause reasons kvgate.proxy.conn_state's, the in-flight body
budget kvgate.proxy.body_budget's; the request's reading and writing is kvgate.proxy.request's.

What it guarantees (aiohttp's server gave the same):
- Header limits: a request line over MAX_LINE_BYTES (or not in RFC 9112's strict form: one space between
  its parts) is answered 400, a header line over MAX_FIELD_BYTES or a head over MAX_HEAD_BYTES 431; a
  malformed request 400. Each is one INFO log line (logger ``kvgate.proxy.server``) and the connection is
  closed after the answer. No refusal raises, whatever bytes follow it.
- Request bodies: Content-Length or chunked, read as they arrive (the handler reads them), never
  decompressed; ``Expect: 100-continue`` answered ``100 Continue`` when the handler starts (417 for
  other expectations). Reading is paused while BODY_HIGH_WATER bytes wait for the handler. Each request's
  body limit is ``body_limit(request)`` (a small one for routes answered from a few bytes).
- Keep-alive (HTTP/1.1 by default, HTTP/1.0 with ``Connection: keep-alive``), pipelined requests answered
  in order, HEAD answered without a body, a streamed answer of unknown length chunked (HTTP/1.1) or
  ended by closing the connection (HTTP/1.0).
- A connection idle for KEEPALIVE_S is closed (one loop-wide sweep, no timer per connection).
- ``cleanup()``: stop listening, close idle connections, let requests in flight finish for up to
  SHUTDOWN_TIMEOUT_S, then cancel them and close every connection.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
from email.utils import formatdate
from typing import Any, Awaitable, Callable

from kvgate.proxy.body_budget import BodyBudget
from kvgate.proxy.conn_state import Phase, Timers
from kvgate.proxy.connection import BODY_HIGH_WATER, BUDGET_STEP, LINGER_S, Connection
from kvgate.proxy.request import Request, StreamResponse
from kvgate.proxy.wire import (MAX_FIELD_BYTES, MAX_HEAD_BYTES, MAX_LINE_BYTES, SMALL_BODY_BYTES, BadRequest,
                               budget_retry_after_s,
                               Headers, Limits, chunk_frame, header_lines, status_line)

log = logging.getLogger("kvgate.proxy.server")

# aiohttp's keepalive_timeout: an idle keep-alive connection is closed after this many seconds.
KEEPALIVE_S = 75.0
# aiohttp's shutdown_timeout: how long cleanup() lets requests in flight finish before cancelling them.
SHUTDOWN_TIMEOUT_S = 60.0
# How often the loop-wide sweep looks for idle connections, heads and bodies that stopped arriving, and
# requests waiting too long for the body budget (and refreshes the Date header), seconds.
SWEEP_S = 1.0
# How often, at most, the file-descriptor shortage is logged, seconds.
FD_LOG_EVERY_S = 60.0


Handler = Callable[[Request], Awaitable[Any]]


class HttpServer:
    """kvgate's HTTP/1.1 server: ``route(request)`` picks the handler (it may set ``request.match_info``);
    ``await handler(request)`` answers on the Request, or returns an aiohttp Response to serialise.
    ``listen()`` adds a listening socket; ``cleanup()`` stops.

    client_max_size: the largest request body in bytes (one declared larger is answered 413 from its head,
    its body unread); body_limit(request): a request's own limit in bytes, when set (called once its head
    is read); limits: the rest of what a client may send (Limits); keepalive_s, shutdown_timeout_s in
    seconds. on_cleanup: awaited last by cleanup().
    """

    def __init__(self, route: Callable[[Request], Handler], client_max_size: int, keepalive_s: float = KEEPALIVE_S,
                 shutdown_timeout_s: float = SHUTDOWN_TIMEOUT_S,
                 on_cleanup: Callable[[], Awaitable[None]] | None = None, limits: Limits | None = None,
                 body_limit: Callable[[Request], int] | None = None):
        self.route = route
        self.client_max_size = client_max_size
        self.body_limit = body_limit
        self.limits = limits or Limits()
        self.loop = asyncio.get_running_loop()
        # connections idle, whose head (since it started) or body (since its last byte) is still arriving,
        # and that answered and drop what the client still sends (a connection enters and leaves ``idle``
        # itself, twice a request: a dict operation each, not a call)
        self.idle = Timers()
        self.heads = Timers()
        self.bodies = Timers()
        self._lingering = Timers()
        self.budget = BodyBudget(self.limits.inflight_body_bytes, self.limits.body_budget_wait_s, self.loop.time)
        self._fd_logged = -FD_LOG_EVERY_S
        self.keepalive_s = keepalive_s
        self.shutdown_timeout_s = shutdown_timeout_s
        self.on_cleanup = on_cleanup
        self.closing = False
        self._servers: list[asyncio.AbstractServer] = []
        self._conns: dict[Connection, None] = {}
        # handlers whose answer is written whole, finishing their bookkeeping (Connection.answered)
        self.finishing: dict[asyncio.Task, Request] = {}
        self._sweeper: asyncio.TimerHandle | None = None
        self.date = formatdate(usegmt=True)

    async def listen(self, host: str | None, port: int, backlog: int = 1024, reuse_port: bool | None = None) -> int:
        """Listen on host:port (port 0: a free one). Returns the bound port."""
        srv = await self.loop.create_server(lambda: Connection(self), host, port, backlog=backlog,
                                            reuse_port=reuse_port)
        self._servers.append(srv)
        if self._sweeper is None:
            self._sweeper = self.loop.call_later(SWEEP_S, self._sweep)
        return srv.sockets[0].getsockname()[1]

    @property
    def connections(self) -> int:
        return len(self._conns)

    # --- what a connection tells its server ---

    def opened(self, conn: Connection) -> None:
        if self.closing:
            conn.close()
            return
        self._conns[conn] = None
        self.idle[conn] = self.loop.time()

    def closed(self, conn: Connection) -> None:
        self._conns.pop(conn, None)
        for table in (self.idle, self.heads, self.bodies, self._lingering):
            table.drop(conn)

    def lingering(self, conn: Connection) -> None:
        self._lingering[conn] = self.loop.time()

    def reading_now(self, conn: Connection, in_head: bool) -> None:
        """After a read that left ``conn`` inside a head or a body: start the head's clock (once), restart
        the body's (its last byte came now). Requests that arrive in one read never get here."""
        if in_head:
            self.heads.enter_once(conn, self.loop.time())
        else:
            self.bodies.restart(conn, self.loop.time())  # to the end: oldest progress first

    def release_budget(self, req: Request) -> None:
        """``req`` is done (answered, or its connection gone): give back what it holds, let waiters in."""
        ticket = req.ticket
        if ticket is not None:  # a request without a body holds none
            req.ticket = None  # the ticket points back at the request: no cycle left for the GC
            self.grant(self.budget.release(ticket))

    @staticmethod
    def grant(tickets) -> None:
        """Tell the connections of the requests whose ``tickets`` the budget granted: they read on."""
        for t in tickets:
            t.owner.connection.granted(t.owner)

    def _sweep(self) -> None:
        """Once a second: close connections idle longer than keepalive_s; answer 408 to heads and bodies
        that stopped arriving and 503 to bodies that waited too long for the budget; close lingering
        connections; note a shortage of file descriptors; refresh the Date value."""
        self.date = formatdate(usegmt=True)
        now = self.loop.time()
        for conn in self.idle.expired(now - self.keepalive_s):
            conn.close()
        lim = self.limits
        for table, limit, what in ((self.heads, lim.header_timeout_s, "head"),
                                   (self.bodies, lim.body_timeout_s, "body")):
            for conn in table.expired(now - limit):
                if conn.lost:
                    continue
                if conn.read_paused:  # kvgate stopped reading it (its turn, the budget): not the client's delay
                    table.restart(conn, now)
                    continue
                conn.timed_out(what)
        late, granted = self.budget.expire()
        for t in late:
            t.owner.connection.budget_timeout(t.owner)
        self.grant(granted)
        for conn in self._lingering.expired(now - LINGER_S):
            conn.close()
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
        for conn in list(self.idle):
            conn.close()
        self.idle.clear()
        tasks = [c.task for c in self._conns if c.task is not None and not c.task.done()]
        tasks += [t for t in self.finishing if not t.done()]
        for c in self._conns:
            c.ctl.advance(Phase.CLOSING)
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


# What kvgate.proxy.server has always offered its callers, wherever it now lives.
__all__ = ["BadRequest", "budget_retry_after_s", "Connection", "Headers", "HttpServer", "Limits", "Request", "StreamResponse", "chunk_frame",
           "header_lines", "status_line", "BODY_HIGH_WATER", "BUDGET_STEP", "LINGER_S", "MAX_FIELD_BYTES",
           "MAX_HEAD_BYTES", "MAX_LINE_BYTES", "SMALL_BODY_BYTES"]
