"""No refusal raises, whatever bytes follow it: kvgate's server connection (kvgate/proxy/connection.py) driven
without sockets, through a transport that records what is written, so hypothesis can try many mixtures fast.

Before: a request with an unknown ``Expect`` value followed by another request in the same read got its 417,
then the parser, dropped by the close, was called again for the next request: ``AttributeError: 'NoneType'
object has no attribute 'get_http_version'`` in ``on_headers_complete``, a 1.1 KB traceback per request."""

from __future__ import annotations

import asyncio
import logging
import re

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvgate.proxy import server
from kvgate.proxy.wire import Limits

Connection = getattr(server, "Connection", None) or getattr(server, "_Conn")  # noqa: B009 (the name before)

LIMITS = Limits(request_line_bytes=64, header_line_bytes=64, head_bytes=1024, header_count=4, trailer_bytes=64)
MAX_BODY = 16


class Transport:
    """What a connection writes, and whether it paused, half-closed or closed."""

    def __init__(self) -> None:
        self.out = bytearray()
        self.closed = self.eof = False
        self.reading = True

    def write(self, data: bytes) -> None:
        self.out += data

    def write_eof(self) -> None:
        self.eof = True

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def get_extra_info(self, name, default=None):
        return ("127.0.0.1", 1) if name == "peername" else default


async def _handler(req):
    body = await req.read()
    req.answer(200, b"", b"", b"ok %d" % len(body), False)


# Requests refused from their head (or their request line), each as smg or nginx answers it.
REFUSED = [
    (b"POST / HTTP/1.1\r\nHost: k\r\nExpect: bogus\r\nContent-Length: 2\r\n\r\nhi", 417),
    (b"POST / HTTP/1.1\r\nHost: k\r\nExpect: 100-continue-please\r\n\r\n", 417),
    (b"POST / HTTP/1.1\r\nHost: k\r\nContent-Length: 99999\r\n\r\n", 413),
    (b"CONNECT k:443 HTTP/1.1\r\nHost: k\r\n\r\n", 404),
    (b"GET / HTTP/2.0\r\nHost: k\r\n\r\n", 400),
    (b"GET /" + b"a" * 100 + b" HTTP/1.1\r\nHost: k\r\n\r\n", 400),
    (b"GET / HTTP/1.1\r\nX-Long: " + b"v" * 100 + b"\r\n\r\n", 431),
    (b"GET / HTTP/1.1\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(6)) + b"\r\n", 431),
    (b"GET /\xc3\xa9 HTTP/1.1\r\nHost: k\r\n\r\n", 400),
    (b"POST / HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 400),
    (b"GET  / HTTP/1.1\r\nHost: k\r\n\r\n", 400),
    (b"GET /  HTTP/1.1\r\nHost: k\r\n\r\n", 400),
    (b"GET / HTTP/1.1\r\nHost: k\r\nConnection: close\r\n\r\n", 200),  # not refused: the last answer all the same
    (b"BAD\x01 / HTTP/1.1\r\n\r\n", 400),
]
VALID = [b"GET /a HTTP/1.1\r\nHost: k\r\n\r\n", b"POST /b HTTP/1.1\r\nHost: k\r\nContent-Length: 3\r\n\r\nabc",
         b"POST /c HTTP/1.1\r\nHost: k\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nhi\r\n0\r\n\r\n"]


async def _drive(reads: list[bytes]) -> tuple[Transport, list]:
    """Feed ``reads`` to one connection, letting handlers run between reads; then the client leaves.
    Returns the transport and what the event loop's exception handler was given."""
    loop = asyncio.get_running_loop()
    errors: list = []
    loop.set_exception_handler(lambda _loop, ctx: errors.append(ctx))
    srv = server.HttpServer(lambda req: _handler, client_max_size=MAX_BODY, limits=LIMITS)
    conn = Connection(srv)
    t = Transport()
    conn.connection_made(t)
    for data in reads:
        if t.reading and not t.closed:
            conn.data_received(data)
        for _ in range(3):
            await asyncio.sleep(0)
    conn.connection_lost(None)
    for _ in range(3):
        await asyncio.sleep(0)
    await srv.cleanup()
    return t, errors


def _split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    return [data[a:b] for a, b in zip([0, *points], [*points, len(data)]) if b > a]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(refused=st.sampled_from(REFUSED), before=st.lists(st.sampled_from(VALID), max_size=2),
       after=st.lists(st.one_of(st.sampled_from(VALID + [r for r, _ in REFUSED]), st.binary(max_size=40)),
                      min_size=1, max_size=4),
       cuts=st.lists(st.integers(0, 1 << 16), max_size=3))
def test_a_refusal_followed_by_any_pipelined_bytes_never_logs_an_exception(refused, before, after, cuts, caplog):
    raw, status = refused
    data = b"".join([*before, raw, *after])
    caplog.clear()
    with caplog.at_level(logging.DEBUG):
        t, errors = asyncio.run(_drive(_split(data, cuts)))
    assert errors == []
    bad = [r for r in caplog.records if r.exc_info or r.levelno >= logging.WARNING]
    assert bad == [], [r.getMessage() for r in bad]
    statuses = [int(s) for s in re.findall(rb"HTTP/1\.1 (\d{3}) ", bytes(t.out))]
    # every request before the refusal is answered 200 in order, then the refusal's own answer (a 417 whose
    # body had arrived whole leaves the connection open for what follows, as aiohttp's server did)
    assert statuses[:len(before) + 1] == [200] * len(before) + [status], (statuses, data)


def test_the_unknown_expect_example_is_answered_417_and_nothing_else():
    data = REFUSED[0][0] + VALID[0]
    t, errors = asyncio.run(_drive([data]))
    assert errors == [] and bytes(t.out).startswith(b"HTTP/1.1 417 Expectation Failed\r\n")
    assert bytes(t.out).count(b"HTTP/1.1 ") == 1 and t.eof
