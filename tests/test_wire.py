"""kvgate.proxy.wire, the server's wire rules, without sockets: request lines as strict as smg's, response
framing, header serialisation (bytes kept, injection refused), the header view."""

from __future__ import annotations

import httptools
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvgate.proxy.wire import (BadRequest, Headers, error_answer, header_lines, origin_form, request_line_at,
                               response_head, safe_header)

METHOD = st.sampled_from([b"GET", b"POST", b"PUT", b"DELETE", b"HEAD", b"OPTIONS"])
URL = st.from_regex(rb"\A/[a-z0-9/_.?=&%-]{0,20}\Z", fullmatch=True)
SPACES = st.integers(1, 3)


def _line(method: bytes, url: bytes, a: int, b: int) -> bytes:
    return method + b" " * a + url + b" " * b + b"HTTP/1.1\r\n"


@given(prior=st.lists(st.tuples(METHOD, URL), max_size=2), method=METHOD, url=URL, a=SPACES, b=SPACES,
       body=st.binary(max_size=30))
def test_a_request_line_is_ok_exactly_when_it_has_one_space_between_its_parts(prior, method, url, a, b, body):
    """Whatever strict requests came before it in the same read (even the same line), a spaced-out line is
    refused and a strict one passes; what llhttp accepts of them decides nothing."""
    seen = b""
    at = 0
    for m, u in prior:  # earlier requests in the same read, each checked in turn
        seen += _line(m, u, 1, 1) + b"Host: k\r\n\r\n"
    mine = _line(method, url, a, b)
    seen += mine + b"Host: k\r\n\r\n" + body + _line(method, url, 1, 1)  # the strict line again after it
    for m, u in prior:
        ok, at = request_line_at(seen, at, m, u, "1.1")
        assert ok
    ok, end = request_line_at(seen, at, method, url, "1.1")
    assert ok == (a == 1 and b == 1)
    assert seen[:end].endswith(mine)


def test_the_lines_llhttp_accepts_and_smg_refuses():
    for line in (b"GET  / HTTP/1.1\r\n", b"GET /  HTTP/1.1\r\n", b"GET   /x   HTTP/1.1\r\n"):
        p = httptools.HttpRequestParser(type("C", (), {})())
        p.feed_data(line + b"Host: k\r\n\r\n")  # llhttp takes it ...
        assert request_line_at(line, 0, p.get_method(), b"/" if b"/x" not in line else b"/x", "1.1")[0] is False
    assert request_line_at(b"GET / HTTP/1.1\r\n", 0, b"GET", b"/", "1.1") == (True, 16)
    assert request_line_at(b"\r\nGET / HTTP/1.0\r\n", 0, b"GET", b"/", "1.0") == (True, 18)  # a leading empty line
    assert request_line_at(b"", 0, b"GET", b"/", "1.1") == (True, 0)  # nothing seen: nothing refused


@pytest.mark.parametrize("version,keep,stream,length,want,chunked,kept", [
    ((1, 1), True, False, 5, b"Content-Length: 5\r\n", False, True),
    ((1, 1), True, True, None, b"Transfer-Encoding: chunked\r\n", True, True),
    ((1, 0), True, True, None, b"Connection: close\r\n", False, False),  # HTTP/1.0: the close ends the body
    ((1, 0), True, False, 2, b"Content-Length: 2\r\nConnection: keep-alive\r\n", False, True),
    ((1, 1), False, False, 0, b"Content-Length: 0\r\nConnection: close\r\n", False, False),
])
def test_response_framing(version, keep, stream, length, want, chunked, kept):
    head, is_chunked, keep_alive = response_head(200, b"", b"X: 1\r\n", length, stream, version, keep, False)
    assert head == b"HTTP/1.1 200 OK\r\nX: 1\r\n" + want + b"\r\n"
    assert (is_chunked, keep_alive) == (chunked, kept)


def test_a_head_answer_streamed_is_not_chunked():
    head, chunked, keep = response_head(200, b"OK", b"", None, True, (1, 1), True, True)
    assert head == b"HTTP/1.1 200 OK\r\n\r\n" and not chunked and keep


@given(st.text(max_size=30), st.text(max_size=30))
def test_header_lines_keep_bytes_or_refuse_line_breaks(name, value):
    items = [("X-A", "caf" + b"\xe9".decode("utf-8", "surrogateescape")), (name, value)]
    if any(c in name + value for c in "\r\n\x00"):
        with pytest.raises(ValueError):
            header_lines(items)
        with pytest.raises(ValueError):
            safe_header(name + value)
    else:
        out = header_lines(items, first="HTTP/1.1 200 OK")
        assert out.startswith(b"HTTP/1.1 200 OK\r\nX-A: caf\xe9\r\n")
        assert out.count(b"\r\n") == 3


def test_headers_view_and_origin_form():
    h = Headers((b"Host", b"k", b"X-Two", b"1", b"x-two", b"2", b"X-Bin", b"\xff"))
    assert h["x-TWO"] == "1" and h.getall("X-Two") == ["1", "2"] and "host" in h and len(h) == 4
    assert h.get("x-bin").encode("utf-8", "surrogateescape") == b"\xff" and h.get("nope") is None
    assert list(h.without(["x-two"])) == ["Host", "X-Bin"]
    assert origin_form(b"http://h:1/a?b") == b"/a?b" and origin_form(b"HTTPS://h?q") == b"/?q"
    assert origin_form(b"http://h") == b"/" and origin_form(b"/x") == b"/x"


_NAME = st.sampled_from(["Host", "X-Session-ID", "x-session-id", "X-SESSION-ID", "Content-Type", "X-Two", "x-two",
                          "Connection", "X-Kvgate-Final", "Accept"])


@given(st.lists(st.tuples(_NAME, st.binary(max_size=8)), max_size=8), st.lists(_NAME, max_size=12))
def test_header_lookups_find_the_first_of_a_name_whatever_its_case(fields, lookups):
    """Every lookup (in any order, repeated) gives what one case-insensitive scan of the raw pairs gives."""
    h = Headers(tuple(x for k, v in fields for x in (k.encode(), v)))
    for name in lookups:
        want = next((v.decode("utf-8", "surrogateescape") for k, v in fields if k.lower() == name.lower()), None)
        assert h.get(name) == want
        assert (name in h) == (want is not None)


def test_error_answer_closes():
    out = error_answer(BadRequest(431, "a header line over 5 bytes"))
    assert out.startswith(b"HTTP/1.1 431 Request Header Fields Too Large\r\n") and b"Connection: close\r\n" in out
    assert out.endswith(b"\r\n\r\n431 Request Header Fields Too Large: a header line over 5 bytes\n")


def test_the_pure_parts_import_no_event_loop_or_http_library():
    import ast
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent / "kvgate" / "proxy"
    for name in ("wire.py", "conn_state.py", "body_budget.py"):
        tree = ast.parse((root / name).read_text())
        mods = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        mods |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert not mods & {"asyncio", "aiohttp", "httptools", "uvloop", "socket", "kvgate"}, (name, mods)
