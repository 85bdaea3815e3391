"""The relay's own HTTP/1.1 client (kvgate.proxy.connection_pool) on real sockets: connections reused and counted, every
body framing relayed byte for byte, 1xx and HEAD, cuts, refused connects, and a stale connection resent only
when the method allows it."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from fake_upstream import parse_answer, request, send_raw
from kvgate.proxy.connection_pool import ConnectFailed, Disconnected, ConnectionPool, ResponseError
from kvgate.tools.procs import free_port


@pytest.fixture
def keepalive(scripted):
    """``await keepalive(script)``: the shared raw upstream (fake_upstream.ScriptedUpstream) keeping its connections
    open; ``script(received)`` answers with bytes, (bytes, "close") to answer and then close, or None to close
    without answering (``received.conn``, ``received.number``: which connection, which request on it)."""
    return lambda script: scripted(script, keep_alive=True)


def _heads(up) -> list[bytes]:
    return [r.head for r in up.received]


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n{\"ok\":true}"


async def test_connections_are_reused_and_counted(kvgate_factory, keepalive):
    up = await keepalive(lambda q: OK)
    gw, url = await kvgate_factory(upstream=up.url)
    async with aiohttp.ClientSession() as http:
        for i in range(5):
            async with http.post(url + "/generate", data=b'{"input_ids":[%d]}' % i) as r:
                assert r.status == 200 and await r.read() == b'{"ok":true}'
    assert up.connections == 1 and gw.upstream.pool.connections_made == 1
    assert [r.body for r in up.received] == [b'{"input_ids":[%d]}' % i for i in range(5)]
    assert gw.upstream.pool.idle_count(gw.upstream.base) == 1
    # the request head: request line, Host, the client's headers in order, Content-Length last
    lines = _heads(up)[0].split(b"\r\n")
    assert lines[0] == b"POST /generate HTTP/1.1"
    assert lines[1] == b"Host: " + up.url[len("http://"):].encode()
    assert lines[-1] == b"Content-Length: 17"


async def test_concurrent_requests_open_one_connection_each_then_share_them(kvgate_factory, keepalive):
    up = await keepalive(lambda q: OK)
    gw, url = await kvgate_factory(upstream=up.url)
    async with aiohttp.ClientSession() as http:
        async def one():
            async with http.post(url + "/generate", data=b"{}") as r:
                return r.status
        assert await asyncio.gather(*[one() for _ in range(4)]) == [200] * 4
        made = gw.upstream.pool.connections_made
        assert 1 <= made <= 4 and up.connections == made
        for _ in range(6):  # sequential: every one reuses an idle connection
            assert await one() == 200
    assert gw.upstream.pool.connections_made == made


@pytest.mark.parametrize("framing, answer, status, body", [
    ("content-length", b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello", 200, b"hello"),
    ("chunked", b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nhel\r\n2\r\nlo\r\n0\r\n\r\n", 200,
     b"hello"),
    ("close-delimited", (b"HTTP/1.1 200 OK\r\n\r\nhello, until the connection closes", "close"), 200,
     b"hello, until the connection closes"),
    ("empty 204", b"HTTP/1.1 204 No Content\r\n\r\n", 204, b""),
    ("1xx first", b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n"
                  b"HTTP/1.1 201 Created\r\nContent-Length: 2\r\n\r\nok", 201, b"ok"),
])
async def test_every_body_framing_is_relayed_byte_for_byte(kvgate_factory, keepalive, framing, answer, status, body):
    up = await keepalive(lambda q: answer)
    gw, url = await kvgate_factory(upstream=up.url)
    for _ in range(2):
        raw = await send_raw(_port(url), request(body=b"{}"))
        ans = parse_answer(raw)
        assert ans is not None, raw[:200]
        assert (ans.status, ans.body) == (status, body)
        assert ans.header(b"link") is None  # an informational response's headers are not the final ones
    m = gw.metrics.render()[0].decode()
    assert f'agentic_kv_requests_total{{route="/generate",status="{status}"}} 2.0' in m
    # a close-delimited body ends with its connection; the others' connection is reused
    assert gw.upstream.pool.connections_made == up.connections == (2 if framing == "close-delimited" else 1)


async def test_head_response_ends_with_its_head(kvgate_factory, keepalive):
    up = await keepalive(lambda q: b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nX-Up: 1\r\n\r\n"
                         if q.head.startswith(b"HEAD") else OK)
    gw, url = await kvgate_factory(upstream=up.url)
    async with aiohttp.ClientSession() as http:
        async with http.head(url + "/thing") as r:
            assert r.status == 200 and r.headers["Content-Length"] == "5" and r.headers["X-Up"] == "1"
            assert await r.read() == b""
        async with http.post(url + "/generate", data=b"{}") as r:  # the next request is answered in full
            assert r.status == 200 and await r.read() == b'{"ok":true}'
    assert [h.split(b" ", 1)[0] for h in _heads(up)] == [b"HEAD", b"POST"]


async def test_upstream_closing_mid_body_cuts_the_client(kvgate_factory, keepalive):
    up = await keepalive(lambda q: (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhalf", "close"))
    gw, url = await kvgate_factory(upstream=up.url)
    raw = await send_raw(_port(url), request(body=b"{}"))
    # the head and the bytes there were, then the cut: never a complete-looking answer
    assert raw.startswith(b"HTTP/1.1 200") and raw.endswith(b"half") and parse_answer(raw) is None
    m = gw.metrics.render()[0].decode()
    assert 'agentic_kv_upstream_errors_total{kind="cut"} 1.0' in m
    assert 'agentic_kv_requests_total{route="/generate",status="200"} 1.0' in m
    assert gw.upstream.pool.idle_count(gw.upstream.base) == 0  # a cut connection is never reused


async def test_refused_connect_raises_connect_failed_and_sends_nothing():
    pool = ConnectionPool(connect_timeout_s=5.0, read_timeout_s=0.0)
    pool.set_address("dead", "127.0.0.1", free_port())
    with pytest.raises(ConnectFailed):
        await pool.exchange("dead", b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n", b"", 0, "GET",
                            True, 1 << 20)
    assert pool.connections_made == 0
    pool.close()


async def test_stale_connection_resent_only_for_methods_safe_to_send_twice(keepalive):
    # The upstream closes its first connection on the second request without answering (an idle
    # connection it dropped as the request went out): a GET is sent again on a new connection, a POST is not.
    up = await keepalive(lambda q: None if (q.conn == 0 and q.number == 1) or (q.conn == 1 and q.number == 1) else OK)
    pool = ConnectionPool(connect_timeout_s=5.0, read_timeout_s=0.0)
    port = _port(up.url)
    pool.set_address("up", "127.0.0.1", port)

    async def send(method: str, retry: bool) -> int:
        head = f"{method} /x HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n".encode()
        ex = await pool.exchange("up", head, b"", 0, method, retry, 1 << 20)
        try:
            while await ex.read():
                pass
            return ex.status
        finally:
            ex.release()

    assert await send("GET", True) == 200  # connection 0, request 0
    assert await send("GET", True) == 200  # connection 0 closes unanswered; resent on connection 1
    assert up.connections == 2 and len(_heads(up)) == 3
    with pytest.raises(Disconnected):
        await send("POST", False)  # connection 1, request 1: closed unanswered, not resent
    assert up.connections == 2 and len(_heads(up)) == 4
    assert await send("POST", False) == 200  # a new connection
    assert up.connections == 3
    pool.close()


def test_request_head_drops_hop_by_hop_and_connection_named_headers_and_keeps_bytes():
    from kvgate.proxy.relay import forward_head
    raw = ((b"Host", b"kvgate:8080"), (b"X-A", b"caf\xe9"), (b"Connection", b"keep-alive, X-Hop"), (b"X-Hop", b"1"),
           (b"Content-Length", b"3"), (b"Expect", b"100-continue"), (b"Keep-Alive", b"timeout=5"),
           (b"X-SMG-Routing-Key", b"client"), (b"x-b", b"2"))
    assert forward_head(raw) == b"X-A: caf\xe9\r\nX-SMG-Routing-Key: client\r\nx-b: 2\r\n"
    # an extra header replaces the client's of the same name (any case) and goes last
    assert forward_head(raw, {"x-smg-routing-key": "s1"}) == b"X-A: caf\xe9\r\nx-b: 2\r\nx-smg-routing-key: s1\r\n"
    assert forward_head(((b"X-A", b"1"),)) == b"X-A: 1\r\n"


def test_response_head_serialiser_keeps_bytes_and_refuses_injected_lines():
    from multidict import CIMultiDict
    from kvgate.proxy.wire import header_lines

    def ser(first, headers):
        return header_lines(headers.items(), first=first) + b"\r\n"
    ok = ser("HTTP/1.1 200 OK", CIMultiDict([("X-Up", b"caf\xe9".decode("utf-8", "surrogateescape")), ("A", "b")]))
    assert ok == b"HTTP/1.1 200 OK\r\nX-Up: caf\xe9\r\nA: b\r\n\r\n"
    for bad in ("a\r\nEvil: 1", "a\nb", "a\rb"):
        with pytest.raises(ValueError):
            ser("HTTP/1.1 200 OK", CIMultiDict([("X", bad)]))
    with pytest.raises(ValueError):
        ser("HTTP/1.1 200 OK", CIMultiDict([("X\r\nY", "v")]))


async def test_kvgate_patches_no_private_name_of_aiohttp(kvgate_factory, echo_upstream):
    import aiohttp.http_writer
    before = aiohttp.http_writer._serialize_headers
    for server in ("kvgate", "aiohttp"):
        await kvgate_factory(upstream=echo_upstream.url, http_server=server)
    assert aiohttp.http_writer._serialize_headers is before


async def test_pool_limit_holds_a_request_until_a_connection_frees(keepalive):
    up = await keepalive(lambda q: OK)
    pool = ConnectionPool(connect_timeout_s=5.0, read_timeout_s=0.0, limit=1)
    pool.set_address("up", "127.0.0.1", _port(up.url))
    head = b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n"
    first = await pool.exchange("up", head, b"", 0, "POST", False, 1 << 20)
    second = asyncio.create_task(pool.exchange("up", head, b"", 0, "POST", False, 1 << 20))
    waiting = asyncio.create_task(pool.exchange("up", head, b"", 0, "POST", False, 1 << 20))
    for _ in range(5):
        await asyncio.sleep(0)
    assert not second.done() and not waiting.done()  # the one connection allowed is in use
    waiting.cancel()  # a request cancelled while it waits gives nothing back it did not hold
    await asyncio.gather(waiting, return_exceptions=True)
    assert await first.read() == b'{"ok":true}' and await first.read() == b""
    first.release()
    ex = await second
    assert ex.status == 200 and await ex.read() == b'{"ok":true}'
    ex.release()
    assert pool.connections_made == 1 and up.connections == 1
    third = await pool.exchange("up", head, b"", 0, "POST", False, 1 << 20)  # the limit is free again
    fourth = asyncio.create_task(pool.exchange("up", head, b"", 0, "POST", False, 1 << 20))
    for _ in range(5):
        await asyncio.sleep(0)
    assert not fourth.done()  # and still one: the cancelled waiter gave back nothing it did not hold
    third.release()
    (await fourth).release()
    pool.close()


async def test_trailers_are_not_relayed_as_headers_and_an_endless_head_is_refused(kvgate_factory, keepalive):
    from kvgate.proxy import connection_pool as pool
    answers = [b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\nX-Trailer: t\r\n\r\n",
               b"HTTP/1.1 200 OK\r\nX-Big: " + b"v" * (pool.MAX_HEAD_BYTES + 10) + b"\r\nContent-Length: 0\r\n\r\n"]
    up = await keepalive(lambda q: answers[len(_heads(up)) - 1])
    gw, url = await kvgate_factory(upstream=up.url)
    ans = parse_answer(await send_raw(_port(url), request(body=b"{}")))
    assert (ans.status, ans.body, ans.header(b"x-trailer")) == (200, b"ok", None)
    ans = parse_answer(await send_raw(_port(url), request(body=b"{}")))
    assert ans.status == 502 and ans.header(b"x-kvgate-error") == b"upstream_protocol_error"


@pytest.mark.parametrize("flags, entry, line", [
    (["--event-loop", "asyncio"], ["-m", "kvgate"], None),
    # uvloop asked for but not importable: one log line, then asyncio's loop
    ([], ["-c", "import sys; sys.modules['uvloop'] = None; from kvgate.cli import main; sys.exit(main())"],
     "event_loop: uvloop is not installed; serving on asyncio's event loop"),
])
async def test_serve_relays_on_asyncios_event_loop(keepalive, log_dir, flags, entry, line):
    import sys
    from kvgate.tools import procs
    up = await keepalive(lambda q: OK)
    port = procs.free_port()
    p = procs.start("kvgate", [sys.executable, *entry, "serve", "--upstream", up.url, "--port", str(port),
                               "--no-compat-probe", *flags], log_dir, url=f"http://127.0.0.1:{port}")
    try:
        await asyncio.to_thread(procs.wait_http, p.url + "/kvgate/health", 30, p)
        async with aiohttp.ClientSession() as http:
            for _ in range(3):
                async with http.post(p.url + "/generate", data=b"{}") as r:
                    assert r.status == 200 and await r.read() == b'{"ok":true}'
    finally:
        p.stop()
    assert up.connections == 1 and len(_heads(up)) == 3
    log = p.log_path.read_text()
    assert (line in log) if line else ("uvloop" not in log), log[-500:]
    assert log.count("event_loop") == (1 if line else 0)


async def test_a_second_response_to_one_request_is_a_502(kvgate_factory, keepalive):
    up = await keepalive(lambda q: OK + b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
    gw, url = await kvgate_factory(upstream=up.url)
    for _ in range(2):  # the connection is not reused: the next request gets the same, complete answer
        ans = parse_answer(await send_raw(_port(url), request(body=b"{}")))
        assert ans.status == 502 and ans.header(b"x-kvgate-error") == b"upstream_protocol_error"
    assert gw.upstream.pool.idle_count(gw.upstream.base) == 0 and gw.upstream.pool.connections_made == 2


def test_https_upstreams_keep_aiohttps_client_with_the_same_headers():
    from kvgate.proxy.relay import Upstream, _multidict_from_head, forward_head
    up = Upstream("http://127.0.0.1:9/", 1.0, 0.0)
    assert up._target("http://127.0.0.1:9") == (b"", b"Host: 127.0.0.1:9\r\n")
    assert up._target("http://router/prefix/") == (b"/prefix", b"Host: router\r\n")
    assert up._target("http://[::1]:8000") == (b"", b"Host: [::1]:8000\r\n")
    assert up._target("https://router:8443") is None  # TLS: aiohttp's client relays it
    head = forward_head(((b"X-A", b"caf\xe9"), (b"Connection", b"close"), (b"x-b", b"1")), {"X-SMG-Routing-Key": "s"})
    md = _multidict_from_head(head)
    assert list(md.items()) == [("X-A", "caf\udce9"), ("x-b", "1"), ("X-SMG-Routing-Key", "s")]


async def _exchange_with_hook(pool: ConnectionPool, calls: list):
    def on_complete(conn):
        calls.append((conn.status, bytes(conn.reason), conn.take()))
        return "answered"
    head = b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n"
    return await pool.exchange("up", head, b"{}", 2, "POST", False, 1 << 20, on_complete)


async def test_a_response_that_arrives_whole_is_handed_to_on_complete_before_the_exchange_returns(keepalive):
    up = await keepalive(lambda q: OK)
    pool = ConnectionPool(connect_timeout_s=5.0, read_timeout_s=0.0)
    pool.set_address("up", "127.0.0.1", _port(up.url))
    for _ in range(2):  # a new connection, then the same one reused: the hook is armed per request
        calls: list = []
        ex = await _exchange_with_hook(pool, calls)
        assert calls == [(200, b"OK", b'{"ok":true}')] and ex.early == "answered"
        assert await ex.read() == b""  # the body went to the hook, once
        ex.release()
        assert pool.idle_count("up") == 1
    assert pool.connections_made == 1
    pool.close()


async def test_a_response_still_arriving_when_its_head_is_read_never_reaches_on_complete(keepalive):
    # Head and first chunk, then (once the test says so) the last chunk: the relay streams it; the hook,
    # disarmed when the exchange returned the head, must not answer the request a second time.
    rest = asyncio.Event()

    async def in_two_parts():
        yield b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n"
        await rest.wait()
        yield b"6\r\n world\r\n0\r\n\r\n"

    up = await keepalive(lambda q: in_two_parts())
    pool = ConnectionPool(connect_timeout_s=5.0, read_timeout_s=0.0)
    pool.set_address("up", "127.0.0.1", _port(up.url))
    calls: list = []
    ex = await _exchange_with_hook(pool, calls)
    assert ex.early is None and not ex.complete
    assert await ex.read() == b"hello"
    rest.set()
    assert await ex.read() == b" world" and await ex.read() == b""
    assert calls == []
    ex.release()
    pool.close()


async def test_a_malformed_response_never_reaches_on_complete(keepalive):
    up = await keepalive(lambda q: b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nabc")
    pool = ConnectionPool(connect_timeout_s=5.0, read_timeout_s=0.0)
    pool.set_address("up", "127.0.0.1", _port(up.url))
    calls: list = []
    with pytest.raises(ResponseError):
        ex = await _exchange_with_hook(pool, calls)
        await ex.read()
    assert calls == []
    pool.close()


async def test_an_error_answering_from_the_data_callback_is_a_500_never_an_emptied_answer(kvgate_factory, keepalive,
                                                                                             monkeypatch):
    """kvgate's own fault while it answers from the upstream's data callback, after the body was taken: the
    client gets the server's 500 (as for any handler error), not the upstream's status with an empty body;
    the next request is answered whole."""
    from kvgate.proxy import server as kv_server
    up = await keepalive(lambda q: OK)
    gw, url = await kvgate_factory(upstream=up.url)
    real = kv_server.Request.answer
    failures = {"left": 1}

    def failing_answer(self, *args, **kw):
        if failures["left"]:
            failures["left"] -= 1
            raise RuntimeError("a fault of kvgate's own")
        return real(self, *args, **kw)

    monkeypatch.setattr(kv_server.Request, "answer", failing_answer)
    async with aiohttp.ClientSession() as http:
        async with http.post(url + "/generate", data=b'{"input_ids":[1]}') as r:
            assert r.status == 500 and failures["left"] == 0
        async with http.post(url + "/generate", data=b'{"input_ids":[2]}') as r:
            assert r.status == 200 and await r.read() == b'{"ok":true}'
