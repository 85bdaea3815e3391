"""Nothing a client or an upstream sends breaks kvgate or alters a request (docs/guarantees.md).

Each test is one kind of bad input, checked on real sockets against the right value: what the upstream
received byte for byte, and what the client got (status and bytes).
"""

import gzip
import logging
import zlib

import aiohttp
import orjson
import pytest

from fake_upstream import parse_answer, request, response, send_raw
from kvgate.proxy.relay import header_safe

ODD_IDS = ["line\nbreak", "carriage\rreturn", "ctl\x01\x7fchars", "tab\tand space ", "ünïcödé", "x" * 9000]


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


# --- session ids are data ------------------------------------------------------------------------------

@pytest.mark.parametrize("sid", ODD_IDS)
async def test_odd_body_session_id_goes_out_unchanged_and_hashed_into_headers(kvgate_factory, echo_upstream, sid):
    gw, url = await kvgate_factory(upstream=echo_upstream.url, agentic_session_lifecycle=True)
    raw = orjson.dumps({"input_ids": [1, 2, 3], "session_id": sid})
    async with aiohttp.ClientSession() as http:
        async with http.post(url + "/generate", data=raw) as r:
            assert r.status == 200
            assert r.headers["X-Kvgate-Session-Id"] == header_safe(sid)
    rec = echo_upstream.received[0]
    assert rec["body"] == raw  # the body already carried the id: not a byte changed
    key = rec["headers"]["X-SMG-Routing-Key"]
    assert key == header_safe(sid) and (key == sid) == (sid.isascii() and sid.isprintable() and len(sid) <= 256
                                                       and sid == sid.strip())
    assert header_safe(sid) == header_safe(sid)  # stable: one session, one engine
    s = gw.lifecycle.registry.get(sid)
    assert s is not None and s.turns == 1 and s.in_flight == 0


async def test_ten_megabyte_session_id_is_relayed_untouched(kvgate_factory, echo_upstream):
    gw, url = await kvgate_factory(upstream=echo_upstream.url, agentic_session_lifecycle=True)
    raw = orjson.dumps({"input_ids": [1], "session_id": "s" * (10 << 20)})
    async with aiohttp.ClientSession() as http:
        async with http.post(url + "/generate", data=raw) as r:
            assert r.status == 200 and (await r.json())["len"] == len(raw)
            assert "X-Kvgate-Session-Id" not in r.headers  # over body_parse_max_bytes: no body features
    assert echo_upstream.received[0]["body"] == raw
    assert "X-SMG-Routing-Key" not in echo_upstream.received[0]["headers"]
    assert 'agentic_kv_body_features_skipped_total{reason="size"} 1.0' in gw.metrics.render()[0].decode()


# --- bodies exactly as received -------------------------------------------------------------------------

GENERATE = b'{"input_ids":[1,2,3],"sampling_params":{"max_new_tokens":2}}'
ENCODED = [(b"gzip", gzip.compress(GENERATE)), (b"deflate", zlib.compress(GENERATE)), (b"gzip", b"not gzip at all"),
           (b"deflate", b"\x00\x01 not deflate"), (b"br", b"\x0b\x02\x80")]


@pytest.mark.parametrize("encoding, body", ENCODED)
async def test_encoded_bodies_are_forwarded_exactly_and_never_decompressed(kvgate_factory, scripted, encoding, body):
    up = await scripted()
    gw, url = await kvgate_factory(upstream=up.url, agentic_session_lifecycle=True)
    raw = request(headers=[(b"Content-Encoding", encoding), (b"X-Session-ID", b"s1")], body=body)
    ans = parse_answer(await send_raw(_port(url), raw))
    assert ans.status == 200 and ans.body == b'{"ok":true}'
    rec = up.received[0]
    assert rec.body == body and rec.header(b"content-encoding") == encoding
    assert rec.header(b"x-smg-routing-key") is None  # body features skipped, and counted
    m = gw.metrics.render()[0].decode()
    assert 'agentic_kv_body_features_skipped_total{reason="content_encoding"} 1.0' in m
    assert 'agentic_kv_faults_total{stage="session"} 0.0' in m


# --- limits no lower than the router's; header bytes unchanged -------------------------------------------

async def test_nine_kilobyte_header_and_url_and_non_utf8_header_bytes_pass_unchanged(kvgate_factory, scripted, caplog):
    up = await scripted()
    gw, url = await kvgate_factory(upstream=up.url, agentic_session_lifecycle=True)
    big = b"v" * (9 * 1024)
    target = b"/generate?q=" + b"u" * (9 * 1024)
    headers = [(b"X-Big", big), (b"X-Session-ID", b"s\xe9ss"), (b"X-Other", b"a\xff\x80b")]
    with caplog.at_level(logging.WARNING):
        ans = parse_answer(await send_raw(_port(url), request(target=target, headers=headers, body=GENERATE)))
    assert ans.status == 200
    rec = up.received[0]
    assert rec.path == target
    assert rec.header(b"x-big") == big and rec.header(b"x-other") == b"a\xff\x80b"
    assert rec.header(b"x-session-id") == b"s\xe9ss"  # forwarded as sent, not "sss"
    sid = "s\\xe9ss"  # the id as data: the byte that was not UTF-8 escaped
    assert orjson.loads(rec.body) == {"session_id": sid, **orjson.loads(GENERATE)}
    assert rec.body.endswith(GENERATE[1:])
    assert ans.header(b"x-kvgate-session-id") == sid.encode()
    assert gw.lifecycle.registry.get(sid).turns == 1
    assert [r for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("kvgate")
            and "discovery" not in r.getMessage() and "not a router" not in r.getMessage()] == []


async def test_non_utf8_response_header_bytes_reach_the_client_unchanged(kvgate_factory, scripted):
    up = await scripted(lambda r: response(200, b"ok", [(b"X-Up", b"caf\xe9 \xff")]))
    gw, url = await kvgate_factory(upstream=up.url)
    ans = parse_answer(await send_raw(_port(url), request(target=b"/x")))
    assert ans.status == 200 and ans.body == b"ok" and ans.header(b"x-up") == b"caf\xe9 \xff"


# --- a malformed upstream response is a 502 naming the upstream ---------------------------------------

MALFORMED = {
    "bad status line": b"HTTP/1.1 OK-ish\r\nContent-Length: 2\r\n\r\nok",
    "not http": b"SSH-2.0-OpenSSH_9.6\r\n\r\n",
    "bad content-length": b"HTTP/1.1 200 OK\r\nContent-Length: twelve\r\n\r\nok",
    "two content-lengths": b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nok",
    "bad chunk": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nok\r\n0\r\n\r\n",
    "204 with a body": b"HTTP/1.1 204 No Content\r\nContent-Length: 5\r\n\r\nhello",
    "header without colon": b"HTTP/1.1 200 OK\r\nbroken header line\r\nContent-Length: 2\r\n\r\nok",
}


@pytest.mark.parametrize("case", list(MALFORMED))
async def test_malformed_upstream_response_is_502_naming_it(kvgate_factory, scripted, case):
    up = await scripted(lambda r: MALFORMED[case])
    gw, url = await kvgate_factory(upstream=up.url)
    ans = parse_answer(await send_raw(_port(url), request(body=GENERATE)))
    assert ans.status == 502, (case, ans)
    err = orjson.loads(ans.body)["error"]
    assert err["upstream"] == up.url and up.url in err["message"] and err["type"] == "upstream_protocol_error"
    assert ans.header(b"x-kvgate-error") == b"upstream_protocol_error"
    m = gw.metrics.render()[0].decode()
    assert 'agentic_kv_upstream_errors_total{kind="protocol_error"} 1.0' in m
    assert 'agentic_kv_requests_total{route="/generate",status="error"} 1.0' in m


# --- observers never stop the bytes -------------------------------------------------------------------

SSE = (b'data: {"choices":[{"index":0,"delta":{"tool_calls":[{"index":null,"id":"c1","function":{"name":"f"}}]}}]}'
       b'\n\ndata: {"choices":[{"index":0,"delta":{"content":"hi"},"finish_reason":"stop"}],'
       b'"usage":{"prompt_tokens":3,"completion_tokens":2}}\n\ndata: [DONE]\n\n')


async def test_an_observer_that_raises_never_stops_the_bytes(kvgate_factory, scripted, caplog):
    up = await scripted(lambda r: response(200, SSE, [(b"Content-Type", b"text/event-stream")], chunked=True))
    gw, url = await kvgate_factory(upstream=up.url, agentic_session_lifecycle=True)

    def exploding_feed(self, chunk):
        raise TypeError("injected")

    body = orjson.dumps({"messages": [{"role": "user", "content": "hi"}], "stream": True})
    for _ in range(2):  # a null tool-call index is read as the first call
        ans = parse_answer(await send_raw(_port(url), request(target=b"/v1/chat/completions", body=body,
                                                             headers=[(b"X-Session-ID", b"tools")])))
        assert ans.status == 200 and ans.body == SSE  # every byte, although the observer read a null index
    assert 'agentic_kv_faults_total{stage="observer"} 0.0' in gw.metrics.render()[0].decode()
    from kvgate.sessions import observe
    original = observe.ResponseObserver.feed
    observe.ResponseObserver.feed = exploding_feed
    try:
        with caplog.at_level(logging.ERROR, logger="kvgate.proxy.relay"):
            for _ in range(3):
                ans = parse_answer(await send_raw(_port(url), request(target=b"/v1/chat/completions", body=body,
                                                                     headers=[(b"X-Session-ID", b"tools")])))
                assert ans.status == 200 and ans.body == SSE
    finally:
        observe.ResponseObserver.feed = original
    m = gw.metrics.render()[0].decode()
    assert 'agentic_kv_faults_total{stage="observer"} 3.0' in m
    assert len([r for r in caplog.records if "observer failed" in r.getMessage()]) == 1  # logged once
    s = gw.lifecycle.registry.get("tools")
    assert s.turns == 5 and s.in_flight == 0


@pytest.mark.parametrize("server, logger", [("kvgate", "kvgate.proxy.server"), ("aiohttp", "aiohttp.server")])
async def test_a_malformed_request_is_answered_400_in_one_log_line(kvgate_factory, scripted, caplog, server, logger):
    up = await scripted()
    gw, url = await kvgate_factory(upstream=up.url, http_server=server)
    with caplog.at_level(logging.INFO, logger=logger):
        out = await send_raw(_port(url), b"GET /x?q=\xe9 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert parse_answer(out, b"GET").status == 400 and up.received == []
    lines = [r for r in caplog.records if r.name == logger]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO and lines[0].exc_info is None
    assert "InvalidURLError" in lines[0].getMessage() and "answered 400" in lines[0].getMessage()
