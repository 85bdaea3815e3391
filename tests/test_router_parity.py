"""Bad input through kvgate gets the answer the router gives directly: a real smg in front of a simulated
engine, the same raw bytes sent both ways (docs/guarantees.md)."""

import gzip
import zlib

import orjson
import pytest

from fake_upstream import parse_answer, send_raw
from fake_upstream import request as raw_request

pytestmark = pytest.mark.router

GEN = {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 3, "ignore_eos": True, "temperature": 0}}
RAW = orjson.dumps(GEN)


def request(headers=(), **kw) -> bytes:
    return raw_request(headers=[(b"Content-Type", b"application/json"), *headers], **kw)  # smg: 415 without it


def _cases() -> dict[str, bytes]:
    with_id = lambda sid: orjson.dumps({**GEN, "session_id": sid})  # noqa: E731
    return {
        "session id with a newline": request(body=with_id("a\nb")),
        "session id with a carriage return": request(body=with_id("a\rb")),
        "session id with control characters": request(body=with_id("a\x01\x1f\x7fb")),
        "session id of 9 KB": request(body=with_id("s" * 9000)),
        "session id of 10 MB": request(body=with_id("m" * (10 << 20))),
        "gzip body": request(headers=[(b"Content-Encoding", b"gzip")], body=gzip.compress(RAW)),
        "invalid gzip body": request(headers=[(b"Content-Encoding", b"gzip")], body=b"not gzip"),
        "invalid deflate body": request(headers=[(b"Content-Encoding", b"deflate")], body=b"\x00\x01no"),
        "deflate body": request(headers=[(b"Content-Encoding", b"deflate")], body=zlib.compress(RAW)),
        "9 KB header": request(headers=[(b"X-Big", b"h" * 9216)], body=RAW),
        "9 KB URL": request(target=b"/generate?pad=" + b"u" * 9216, body=RAW),
        "non-UTF-8 session header": request(headers=[(b"X-Session-ID", b"s\xe9ss")], body=RAW),
        "header with CR/LF-looking bytes": request(headers=[(b"X-Session-ID", b"a\\r\\nInjected: 1")], body=RAW),
        "not JSON": request(body=b"{bad json"),
        "raw non-ASCII byte in the URL": request(target=b"/generate?sid=\xe9", body=RAW),
    }


async def test_bad_input_gets_the_routers_own_answer(sim_factory, router_factory, kvgate_factory):
    engine = await sim_factory(max_total_num_tokens=50_000, speed=100)
    router = await router_factory([engine.url])
    # the router's own answers: session calls stay on the router path (placed, they get the engine's answers:
    # docs/placement.md)
    gw, kv = await kvgate_factory(upstream=router, agentic_session_lifecycle=True, session_placement="router")
    port = lambda url: int(url.rsplit(":", 1)[1])  # noqa: E731
    for name, raw in _cases().items():
        direct = parse_answer(await send_raw(port(router), raw))
        via = parse_answer(await send_raw(port(kv), raw))
        assert direct is not None and via is not None, (name, direct, via)
        assert via.status == direct.status, (name, direct.status, via.status, via.body[:200])
        if direct.status == 200:
            assert orjson.loads(via.body)["output_ids"] == orjson.loads(direct.body)["output_ids"], name
        elif name != "raw non-ASCII byte in the URL":  # refused by the HTTP parser itself, in its own words
            assert via.body == direct.body, name
    statuses = {name: parse_answer(await send_raw(port(router), raw)).status for name, raw in _cases().items()}
    # The right values, measured on smg 1.13: ids are data (200), bodies are never decompressed (400).
    assert [n for n, s in statuses.items() if s != 200] == [
        "gzip body", "invalid gzip body", "invalid deflate body", "deflate body", "not JSON",
        "raw non-ASCII byte in the URL"]
    m = gw.metrics.render()[0].decode()
    assert 'agentic_kv_body_features_skipped_total{reason="content_encoding"} 4.0' in m
    assert 'agentic_kv_body_features_skipped_total{reason="size"} 1.0' in m
    assert 'agentic_kv_faults_total{stage="session"} 0.0' in m
