"""kvgate's own HTTP/1.1 server (kvgate/proxy/server.py): the guarantees aiohttp's server gave, on real
sockets (127.0.0.1, random ports), with a raw client so the bytes on the wire are what is checked."""

from __future__ import annotations

import asyncio
import logging

import orjson
import pytest

from fake_upstream import parse_answer, request, response, send_raw
from kvgate.config import validate
from kvgate.proxy import server
from kvgate.proxy.bootstrap import start_gateway
from kvgate.proxy.relay import MAX_FIELD_BYTES, MAX_LINE_BYTES, _response_lines


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


async def read_response(reader: asyncio.StreamReader, method: bytes = b"GET") -> tuple[bytes, bytes]:
    """One response from a kept-alive connection: (head, body de-framed)."""
    head = (await reader.readuntil(b"\r\n\r\n"))[:-4]
    fields = {}
    for line in head.split(b"\r\n")[1:]:
        k, _, v = line.partition(b":")
        fields[k.strip().lower()] = v.strip()
    status = int(head.split(b" ", 2)[1])
    if method == b"HEAD" or status in (204, 304) or 100 <= status < 200:
        return head, b""
    if fields.get(b"transfer-encoding", b"").lower() == b"chunked":
        body = bytearray()
        while True:
            size = int((await reader.readuntil(b"\r\n"))[:-2], 16)
            if size == 0:
                await reader.readuntil(b"\r\n")
                return head, bytes(body)
            body += await reader.readexactly(size)
            assert await reader.readexactly(2) == b"\r\n"
    if b"content-length" in fields:
        return head, await reader.readexactly(int(fields[b"content-length"]))
    return head, await reader.read()  # ended by closing the connection


def _status(head: bytes) -> int:
    return int(head.split(b" ", 2)[1])


def _header(head: bytes, name: bytes) -> bytes | None:
    for line in head.split(b"\r\n")[1:]:
        k, _, v = line.partition(b":")
        if k.strip().lower() == name:
            return v.strip()
    return None


# --- pure helpers -----------------------------------------------------------------------------------------

def test_status_line_chunk_frame_and_header_lines():
    assert server.status_line(200) == b"HTTP/1.1 200 OK\r\n"
    assert server.status_line(418, b"Teapot") == b"HTTP/1.1 418 Teapot\r\n"
    assert server.status_line(599) == b"HTTP/1.1 599 \r\n"
    assert server.chunk_frame(b"x" * 26) == b"1a\r\n" + b"x" * 26 + b"\r\n"
    assert server.header_lines([("A", "1"), ("B", "s\udce9ss")]) == b"A: 1\r\nB: s\xe9ss\r\n"
    with pytest.raises(ValueError):
        server.header_lines([("X", "a\r\nInjected: 1")])


def test_response_lines_drop_hop_by_hop_and_replace_added_headers():
    raw = [(b"Content-Type", b"text/event-stream"), (b"Connection", b"keep-alive, X-Private"),
           (b"X-Private", b"1"), (b"Transfer-Encoding", b"chunked"), (b"X-Kvgate-Admission", b"old"),
           (b"X-Up", b"caf\xe9"), (b"Content-Encoding", b"gzip")]
    lines, has_length, ctype, encoded = _response_lines(raw, [("X-Kvgate-Admission", "admit")])
    assert lines == (b"Content-Type: text/event-stream\r\nX-Up: caf\xe9\r\nContent-Encoding: gzip\r\n"
                     b"X-Kvgate-Admission: admit\r\n")
    assert (has_length, ctype, encoded) == (False, b"text/event-stream", True)
    lines, has_length, _, encoded = _response_lines([(b"Content-Length", b"2")], ())
    assert (lines, has_length, encoded) == (b"Content-Length: 2\r\n", True, False)


# --- on the wire ------------------------------------------------------------------------------------------

async def test_pipelined_requests_are_answered_in_order(kvgate_factory, echo_upstream):
    gw, url = await kvgate_factory(upstream=echo_upstream.url)
    body = b'{"input_ids":[1,2,3]}'
    raw = (b"GET /a?x=1 HTTP/1.1\r\nHost: k\r\n\r\n"
           b"POST /generate HTTP/1.1\r\nHost: k\r\nContent-Length: %d\r\n\r\n%s"
           b"GET /c HTTP/1.1\r\nHost: k\r\n\r\n" % (len(body), body))
    reader, writer = await asyncio.open_connection("127.0.0.1", _port(url))
    writer.write(raw)
    answers = [orjson.loads((await read_response(reader))[1]) for _ in range(3)]
    writer.close()
    assert [(a["method"], a["path"], a["query"], a["len"]) for a in answers] == [
        ("GET", "/a", "x=1", 0), ("POST", "/generate", "", len(body)), ("GET", "/c", "", 0)]
    assert [r["body"] for r in echo_upstream.received] == [b"", body, b""]


async def test_chunked_request_body_is_forwarded_whole(kvgate_factory, scripted):
    up = await scripted()
    gw, url = await kvgate_factory(upstream=up.url)
    body = b'{"text":"' + b"a" * 5000 + b'"}'
    chunked = b"".join(server.chunk_frame(body[i:i + 777]) for i in range(0, len(body), 777)) + b"0\r\n\r\n"
    out = await send_raw(_port(url), b"POST /generate HTTP/1.1\r\nHost: k\r\nTransfer-Encoding: chunked\r\n"
                                     b"Connection: close\r\n\r\n" + chunked)
    assert parse_answer(out).status == 200
    rec = up.received[0]
    assert rec.body == body and rec.header(b"content-length") == str(len(body)).encode()
    assert rec.header(b"transfer-encoding") is None


async def test_a_broken_chunk_is_400_and_nothing_goes_upstream(kvgate_factory, scripted, caplog):
    up = await scripted()
    gw, url = await kvgate_factory(upstream=up.url)
    with caplog.at_level(logging.INFO, logger="kvgate.proxy.server"):
        out = await send_raw(_port(url), b"POST /generate HTTP/1.1\r\nHost: k\r\nTransfer-Encoding: chunked\r\n\r\n"
                                         b"5\r\nhello\r\nzz\r\nxx\r\n0\r\n\r\n")
    assert parse_answer(out).status == 400 and up.received == []
    assert len([r for r in caplog.records if r.name == "kvgate.proxy.server"]) == 1


async def test_expect_100_continue(kvgate_factory, scripted):
    up = await scripted()
    gw, url = await kvgate_factory(upstream=up.url, max_body_bytes=1000)
    body = b'{"input_ids":[1]}'
    reader, writer = await asyncio.open_connection("127.0.0.1", _port(url))
    writer.write(b"POST /generate HTTP/1.1\r\nHost: k\r\nExpect: 100-continue\r\nContent-Length: %d\r\n\r\n" % len(body))
    assert await reader.readuntil(b"\r\n\r\n") == b"HTTP/1.1 100 Continue\r\n\r\n"
    writer.write(body)
    head, answer = await read_response(reader)
    assert _status(head) == 200 and answer == b'{"ok":true}' and up.received[0].body == body
    assert up.received[0].header(b"expect") is None  # answered here, not passed on
    # Declared larger than max_body_bytes: 413 at once, no 100 Continue, the body is never sent.
    writer.write(b"POST /generate HTTP/1.1\r\nHost: k\r\nExpect: 100-continue\r\nContent-Length: 5000\r\n\r\n")
    head, _ = await read_response(reader)
    assert _status(head) == 413 and _header(head, b"connection") == b"close"
    assert await reader.read() == b""  # closed
    writer.close()
    assert len(up.received) == 1


async def test_body_over_max_body_bytes_is_413(kvgate_factory, scripted):
    up = await scripted()
    gw, url = await kvgate_factory(upstream=up.url, max_body_bytes=4096)
    out = await send_raw(_port(url), request(body=b"x" * 4097))
    assert parse_answer(out).status == 413 and up.received == []
    out = await send_raw(_port(url), request(body=b"x" * 4096))
    assert parse_answer(out).status == 200 and up.received[0].size == 4096


@pytest.mark.parametrize("case, status", [("header", 431), ("url", 400), ("head", 431)])
async def test_oversized_heads_are_refused_in_one_log_line(kvgate_factory, scripted, caplog, case, status):
    up = await scripted()
    gw, url = await kvgate_factory(upstream=up.url)
    if case == "header":
        raw = request(headers=[(b"X-Big", b"v" * (MAX_FIELD_BYTES + 1))])
    elif case == "url":
        raw = request(target=b"/generate?q=" + b"u" * MAX_LINE_BYTES)
    else:  # many headers, each under the line limit
        raw = request(headers=[(b"X-%d" % i, b"v" * 100_000) for i in range(server.MAX_HEAD_BYTES // 100_000 + 1)])
    with caplog.at_level(logging.INFO, logger="kvgate.proxy.server"):
        out = await send_raw(_port(url), raw)
    assert parse_answer(out).status == status and up.received == []
    lines = [r for r in caplog.records if r.name == "kvgate.proxy.server"]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO and f"answered {status}" in lines[0].getMessage()
    # Just under the limits: relayed.
    out = await send_raw(_port(url), request(headers=[(b"X-Big", b"v" * (MAX_FIELD_BYTES - 100))]))
    assert parse_answer(out).status == 200 and len(up.received[0].header(b"x-big")) == MAX_FIELD_BYTES - 100


async def test_client_disconnect_mid_upstream_cancels_the_upstream_call(kvgate_factory, echo_upstream):
    gw, url = await kvgate_factory(upstream=echo_upstream.url)
    reader, writer = await asyncio.open_connection("127.0.0.1", _port(url))
    writer.write(b"GET /slow HTTP/1.1\r\nHost: k\r\n\r\n")
    await echo_upstream.arrived.wait()
    writer.close()
    await asyncio.wait_for(echo_upstream.cancelled.wait(), 10)
    m = gw.metrics.render()[0].decode()
    assert "agentic_kv_client_disconnects_total 1.0" in m and "agentic_kv_inflight_requests 0.0" in m


async def test_http_1_0_closes_unless_kept_alive_and_streams_close_delimited(kvgate_factory, echo_upstream):
    gw, url = await kvgate_factory(upstream=echo_upstream.url)
    out = await send_raw(_port(url), b"GET /a HTTP/1.0\r\n\r\n")  # answered, then closed (read to EOF)
    head, _, body = out.partition(b"\r\n\r\n")
    assert _status(head) == 200 and orjson.loads(body)["path"] == "/a"
    assert _header(head, b"connection") == b"close"
    reader, writer = await asyncio.open_connection("127.0.0.1", _port(url))
    writer.write(b"GET /b HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
    head, body = await read_response(reader)
    assert _header(head, b"connection") == b"keep-alive" and orjson.loads(body)["path"] == "/b"
    # A streamed answer of unknown length to an HTTP/1.0 client: not chunked, ended by the close.
    writer.write(b"GET /sse HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
    head = await reader.readuntil(b"\r\n\r\n")  # the upstream holds the rest until released
    echo_upstream.release.set()
    body = await reader.read()
    writer.close()
    assert _header(head, b"transfer-encoding") is None and _header(head, b"connection") == b"close"
    assert _header(head, b"content-length") is None
    assert body == b"".join(b"data: %s\n\n" % orjson.dumps({"i": i}) for i in range(3)) + b"data: [DONE]\n\n"


async def test_keep_alive_reuses_one_connection_and_streams_chunked(kvgate_factory, echo_upstream):
    gw, url = await kvgate_factory(upstream=echo_upstream.url)
    reader, writer = await asyncio.open_connection("127.0.0.1", _port(url))
    for i in range(3):
        writer.write(b"POST /generate HTTP/1.1\r\nHost: k\r\nContent-Length: 2\r\n\r\n{}")
        head, body = await read_response(reader)
        assert _status(head) == 200 and orjson.loads(body)["len"] == 2 and _header(head, b"connection") is None
    writer.write(b"GET /sse HTTP/1.1\r\nHost: k\r\n\r\n")
    head = await reader.readuntil(b"\r\n\r\n")
    assert _header(head, b"transfer-encoding") == b"chunked" and _header(head, b"x-up") == b"1"
    first = b'data: {"i":0}\n\n'
    frame = b"%x\r\n%s\r\n" % (len(first), first)
    assert await asyncio.wait_for(reader.readexactly(len(frame)), 10) == frame  # before chunk 1 exists
    echo_upstream.release.set()
    rest = b""
    while not rest.endswith(b"0\r\n\r\n"):
        rest += await reader.read(4096)
    writer.write(b"GET /after HTTP/1.1\r\nHost: k\r\n\r\n")
    head, body = await read_response(reader)
    writer.close()
    assert orjson.loads(body)["path"] == "/after"
    assert len(echo_upstream.received) == 5


async def test_head_is_answered_without_a_body(kvgate_factory, scripted):
    up = await scripted(lambda r: b"HTTP/1.1 200 OK\r\nContent-Length: 1234\r\nX-Up: h\r\nConnection: close\r\n\r\n")
    gw, url = await kvgate_factory(upstream=up.url)
    reader, writer = await asyncio.open_connection("127.0.0.1", _port(url))
    writer.write(b"HEAD /x HTTP/1.1\r\nHost: k\r\n\r\n")
    head, _ = await read_response(reader, b"HEAD")
    assert _status(head) == 200 and _header(head, b"content-length") == b"1234" and _header(head, b"x-up") == b"h"
    writer.write(b"HEAD /metrics HTTP/1.1\r\nHost: k\r\n\r\n")  # kvgate's own GET route, as HEAD
    head, _ = await read_response(reader, b"HEAD")
    assert _status(head) == 200 and int(_header(head, b"content-length")) > 1000
    writer.write(b"GET /kvgate/health HTTP/1.1\r\nHost: k\r\n\r\n")  # the connection carried no body bytes
    head, body = await read_response(reader)
    writer.close()
    assert orjson.loads(body)["checks"][0] == {"check": "router", "ok": True, "reason": f"{up.url} answers",
                                               "upstream": up.url, "since_s": orjson.loads(body)["checks"][0]["since_s"],
                                               "failures": 0, "placed_routes": []}


async def test_non_utf8_header_bytes_round_trip_on_a_streamed_answer(kvgate_factory, scripted):
    sse = b"data: 1\n\ndata: [DONE]\n\n"
    up = await scripted(lambda r: response(200, sse, [(b"Content-Type", b"text/event-stream"),
                                                      (b"X-Up", b"caf\xe9 \xff")], chunked=True))
    gw, url = await kvgate_factory(upstream=up.url, agentic_session_lifecycle=True)
    out = await send_raw(_port(url), request(target=b"/generate", headers=[(b"X-Session-ID", b"s\xe9ss"),
                                                                           (b"X-Other", b"a\xff\x80b")],
                                             body=b'{"text":"hi","stream":true}'))
    ans = parse_answer(out)
    assert ans.status == 200 and ans.body == sse and ans.header(b"x-up") == b"caf\xe9 \xff"
    assert ans.header(b"x-kvgate-session-id") == b"s\\xe9ss"
    rec = up.received[0]
    assert rec.header(b"x-session-id") == b"s\xe9ss" and rec.header(b"x-other") == b"a\xff\x80b"


async def test_session_routes_and_methods_route_as_aiohttp_did(kvgate_factory, echo_upstream):
    gw, url = await kvgate_factory(upstream=echo_upstream.url, agentic_session_lifecycle=True)
    out = parse_answer(await send_raw(_port(url), request(b"GET", b"/kvgate/sessions/a%20b")), b"GET")
    assert out.status == 404 and orjson.loads(out.body)["error"]["message"] == "unknown session 'a b'"
    out = parse_answer(await send_raw(_port(url), request(b"POST", b"/kvgate/sessions/s1/close")))
    assert out.status == 200 and orjson.loads(out.body)["session_id"] == "s1"
    out = parse_answer(await send_raw(_port(url), request(b"POST", b"/close_session", body=b'{"session_id":"s2"}')))
    assert out.status == 200 and orjson.loads(out.body) == {"session_id": "s2", "known": False, "state": "closing",
                                                             "engines": 0}
    # A method kvgate's own route does not take goes to the router, as with aiohttp's catch-all.
    out = parse_answer(await send_raw(_port(url), request(b"POST", b"/metrics", body=b"{}")))
    assert out.status == 200 and orjson.loads(out.body)["path"] == "/metrics"
    assert [r["path"] for r in echo_upstream.received] == ["/metrics"]


async def test_idle_keep_alive_connection_is_closed(kvgate_factory, echo_upstream):
    gw, url = await kvgate_factory(upstream=echo_upstream.url)
    reader, writer = await asyncio.open_connection("127.0.0.1", _port(url))
    writer.write(b"GET /a HTTP/1.1\r\nHost: k\r\n\r\n")
    await read_response(reader)
    srv = _server_of(url)
    assert srv.connections == 1
    srv.keepalive_s = 0.0  # the next sweep (within SWEEP_S) closes it
    assert await asyncio.wait_for(reader.read(), 10) == b""
    writer.close()


_SERVERS: dict[int, server.HttpServer] = {}


def _server_of(url: str) -> server.HttpServer:
    return _SERVERS[_port(url)]


@pytest.fixture(autouse=True)
def _track_servers(monkeypatch):
    original = server.HttpServer.listen

    async def listen(self, host, port, **kw):
        bound = await original(self, host, port, **kw)
        _SERVERS[bound] = self
        return bound

    monkeypatch.setattr(server.HttpServer, "listen", listen)
    yield
    _SERVERS.clear()


async def test_shutdown_lets_a_request_in_flight_finish_then_closes(echo_upstream):
    gw, runner, port = await start_gateway(validate({"upstream": echo_upstream.url, "port": 0,
                                                     "compat_probe": False}))
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /slow HTTP/1.1\r\nHost: k\r\n\r\n")
    await echo_upstream.arrived.wait()
    idle_r, idle_w = await asyncio.open_connection("127.0.0.1", port)
    cleanup = asyncio.create_task(runner.cleanup())
    assert await asyncio.wait_for(idle_r.read(), 10) == b""  # an idle connection is closed at once
    with pytest.raises(OSError):
        await asyncio.open_connection("127.0.0.1", port)  # no longer listening
    assert not cleanup.done()
    echo_upstream.release.set()
    head, body = await read_response(reader)
    assert _status(head) == 200 and body == b"late" and _header(head, b"connection") == b"close"
    await asyncio.wait_for(cleanup, 10)
    assert await reader.read() == b""
    writer.close()
    idle_w.close()


async def test_shutdown_cancels_a_request_that_outlasts_the_timeout(echo_upstream):
    gw, runner, port = await start_gateway(validate({"upstream": echo_upstream.url, "port": 0,
                                                     "compat_probe": False}))
    runner.shutdown_timeout_s = 0.05
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /slow HTTP/1.1\r\nHost: k\r\n\r\n")
    await echo_upstream.arrived.wait()
    await asyncio.wait_for(runner.cleanup(), 10)
    await asyncio.wait_for(echo_upstream.cancelled.wait(), 10)  # the upstream call was closed
    assert await reader.read() == b""
    writer.close()
    assert "agentic_kv_inflight_requests 0.0" in gw.metrics.render()[0].decode()


async def test_aiohttp_server_is_still_selectable(kvgate_factory, echo_upstream):
    gw, url = await kvgate_factory(upstream=echo_upstream.url, http_server="aiohttp")
    out = parse_answer(await send_raw(_port(url), request(body=b'{"input_ids":[1]}')))
    assert out.status == 200 and orjson.loads(out.body)["len"] == 17
    assert _port(url) not in _SERVERS
    # a streamed answer through aiohttp's server: every event, in order, and the upstream's own header
    echo_upstream.release.set()
    raw = await send_raw(_port(url), request(target=b"/sse", headers=[(b"X-Odd", b"s\xe9ss")]))
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"\r\nX-Up: 1\r\n" in head
    assert [b'data: {"i":%d}' % i in body for i in range(3)] == [True] * 3 and body.index(b"[DONE]") > body.index(b'"i":2')
    # header bytes that are not UTF-8 reached the upstream as sent
    assert echo_upstream.received[-1]["headers"]["X-Odd"].encode("utf-8", "surrogateescape") == b"s\xe9ss"


# --- a handler that answers, then finishes its bookkeeping -----------------------------------------------------

async def _raw_server(handler):
    srv = server.HttpServer(lambda req: handler, client_max_size=1 << 20)
    port = await srv.listen("127.0.0.1", 0)
    return srv, port


async def test_the_next_request_is_answered_while_the_last_handler_finishes(caplog):
    """A keep-alive client sends its next request as soon as it has an answer. The handler that wrote the
    answer may still be finishing (kvgate records metrics and releases its admission lease after the relay
    answered): the connection reads and answers the next request at once, without pausing reading, and the
    handler still held is neither cancelled nor lost; a failure after its answer is logged with its route."""
    hold = asyncio.Event()
    finished: list[str] = []
    paused = []

    async def handler(req: server.Request):
        req.answer(200, b"OK", b"Content-Type: text/plain\r\n", req.raw_path.encode(), False)
        if req.raw_path == "/first":
            await hold.wait()  # bookkeeping after the answer
            finished.append(req.raw_path)
            raise RuntimeError("a fault after the answer")
        finished.append(req.raw_path)

    srv, port = await _raw_server(handler)
    orig_pause = server.Connection.pause
    server.Connection.pause = lambda self, *a: (paused.append(1), orig_pause(self, *a))[1]
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /first HTTP/1.1\r\nHost: x\r\n\r\n")
        head, body = await read_response(reader)
        assert _status(head) == 200 and body == b"/first"
        first = next(iter(srv.finishing))  # the first handler, detached from its connection, still running
        assert not first.done()
        for i in range(3):
            writer.write(b"GET /next%d HTTP/1.1\r\nHost: x\r\n\r\n" % i)
            head, body = await asyncio.wait_for(read_response(reader), 30)
            assert (_status(head), body) == (200, b"/next%d" % i)
        assert finished == ["/next0", "/next1", "/next2"] and not paused
        writer.close()  # the client leaves: the handler that answered is not cancelled
        with caplog.at_level(logging.ERROR, logger="kvgate.proxy.server"):
            hold.set()
            await asyncio.wait([first], timeout=30)
            for _ in range(3):
                await asyncio.sleep(0)  # its done callback
        assert first.done() and not first.cancelled() and finished[-1] == "/first"
        assert "error handling GET /first after its answer" in caplog.text and not srv.finishing
    finally:
        server.Connection.pause = orig_pause
        await srv.cleanup()


async def test_shutdown_waits_for_a_handler_finishing_after_its_answer():
    hold = asyncio.Event()
    done = []

    async def handler(req: server.Request):
        req.answer(200, b"OK", b"", b"ok", False)
        await hold.wait()
        done.append(1)

    srv, port = await _raw_server(handler)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    head, body = await read_response(reader)
    assert body == b"ok" and len(srv.finishing) == 1
    stop = asyncio.ensure_future(srv.cleanup())
    for _ in range(20):
        await asyncio.sleep(0)
    assert not stop.done()  # waits for the handler still finishing
    hold.set()
    await asyncio.wait_for(stop, 30)
    assert done == [1]
    writer.close()


# --- an aiohttp Response whose body is a payload ------------------------------------------------------------------

async def test_a_response_body_aiohttp_holds_as_a_payload_goes_out_byte_for_byte():
    """A handler's web.Response built from text or a byte stream holds its body as an aiohttp Payload, not bytes:
    kvgate's server sends exactly the payload's bytes, read through aiohttp's public API (for any text, any bytes).
    """
    import io
    from aiohttp import payload, web
    from hypothesis import HealthCheck, given, settings, strategies as st

    current: list = []

    async def handler(req: server.Request):
        return current[0]

    srv, port = await _raw_server(handler)
    try:
        async def answer(resp) -> bytes:
            current[:] = [resp]
            ans = parse_answer(await send_raw(port, request(b"GET", b"/")), b"GET")
            assert ans is not None and ans.status == 200
            return ans.body

        loop = asyncio.get_running_loop()

        @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
        @given(text=st.text(max_size=200), raw=st.binary(max_size=200),
               charset=st.sampled_from(["utf-8", "utf-16", "latin-1"]))
        def check(text, raw, charset):
            if charset == "latin-1":
                text = text.encode("latin-1", "replace").decode("latin-1")
            as_text = web.Response(body=text, content_type="text/plain")
            as_text.body = payload.StringPayload(text, encoding=charset)
            assert not isinstance(as_text.body, (bytes, bytearray))  # a payload: the case under test
            sent = asyncio.run_coroutine_threadsafe(answer(as_text), loop)
            assert sent.result(30) == text.encode(charset)
            as_stream = web.Response(body=io.BytesIO(raw), content_type="application/octet-stream")
            sent = asyncio.run_coroutine_threadsafe(answer(as_stream), loop)
            assert sent.result(30) == raw

        await asyncio.to_thread(check)
    finally:
        await srv.cleanup()
