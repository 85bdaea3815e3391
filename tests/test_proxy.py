"""Transparent forwarding (issue 2, point 2) against a recording upstream on a real socket."""

import asyncio

import aiohttp
import orjson
import pytest


async def test_method_path_query_headers_body_status_pass_through(kvgate_factory, echo_upstream):
    gw, url = await kvgate_factory(upstream=echo_upstream.url)
    async with aiohttp.ClientSession() as http:
        async with http.put(url + "/any/path?x=1&y=%20z", data=b"\x00raw-bytes\xff",
                            headers={"X-Custom": "abc", "Authorization": "Bearer t", "User-Agent": "rollout/1.0", "Connection": "keep-alive, X-Hop",
                                     "X-Hop": "dropped", "Keep-Alive": "timeout=5"}) as r:
            assert r.status == 200
            assert r.headers["X-Upstream-Header"] == "kept"
            got = await r.json()
        async with http.get(url + "/status/418") as r:
            assert r.status == 418 and await r.text() == "teapot" and r.headers["X-Custom"] == "yes"
    rec = echo_upstream.received[0]
    assert (rec["method"], rec["path"], rec["query"]) == ("PUT", "/any/path", "x=1&y=%20z")
    assert rec["body"] == b"\x00raw-bytes\xff" and got["len"] == 11
    h = {k.lower(): v for k, v in rec["headers"].items()}
    assert h["x-custom"] == "abc" and h["authorization"] == "Bearer t"
    assert "x-hop" not in h and "keep-alive" not in h  # hop-by-hop, incl. those named by Connection
    assert h["user-agent"] == "rollout/1.0"  # the client's, not kvgate's


async def test_generate_body_untouched_when_lifecycle_off(kvgate_factory, echo_upstream):
    gw, url = await kvgate_factory(upstream=echo_upstream.url)
    raw = b'{"input_ids": [1, 2, 3],   "sampling_params": {"max_new_tokens": 4}}'
    async with aiohttp.ClientSession() as http:
        async with http.post(url + "/generate", data=raw, headers={"X-Session-ID": "s1",
                                                                   "Content-Type": "application/json"}) as r:
            assert r.status == 200
    assert echo_upstream.received[0]["body"] == raw
    assert "X-SMG-Routing-Key" not in echo_upstream.received[0]["headers"]


async def test_session_id_injected_and_routing_key_set(kvgate_factory, echo_upstream):
    gw, url = await kvgate_factory(upstream=echo_upstream.url, agentic_session_lifecycle=True,
                                   session_field="rid", session_field_regex=r"^(.+)-t\d+$")
    raw = b'{"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}}'
    async with aiohttp.ClientSession() as http:
        for path, headers, body in [
            ("/generate", {"X-Session-ID": "s1"}, raw),
            ("/v1/chat/completions", {"X-Session-ID": "s2", "X-SMG-Routing-Key": "client-key"},
             b'{"messages":[{"role":"user","content":"hi"}]}'),
            ("/v1/completions", {}, b'{"prompt":"x","rid":"ep9-t3"}'),
            ("/generate", {"X-Session-ID": "ignored"}, b'{"input_ids":[1],"session_id":"kept"}'),
            ("/generate", {}, b'{"input_ids":[1]}'),
            ("/generate", {"X-Session-ID": "s3"}, b'{"session_params":{"id":"old"},"input_ids":[1]}'),
            ("/generate", {"X-Session-ID": "s4"}, b"[not an object"),
        ]:
            async with http.post(url + path, data=body, headers=headers) as r:
                assert r.status == 200
    rec = echo_upstream.received
    b0 = orjson.loads(rec[0]["body"])
    assert b0 == {"session_id": "s1", "input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}}
    assert rec[0]["body"].endswith(raw[1:])  # everything else byte-for-byte
    assert rec[0]["headers"]["X-SMG-Routing-Key"] == "s1"
    assert orjson.loads(rec[1]["body"])["session_id"] == "s2"
    assert rec[1]["headers"]["X-SMG-Routing-Key"] == "client-key"  # the client's own key wins
    assert orjson.loads(rec[2]["body"])["session_id"] == "ep9"
    assert rec[3]["body"] == b'{"input_ids":[1],"session_id":"kept"}'
    assert rec[3]["headers"]["X-SMG-Routing-Key"] == "kept"
    inferred = orjson.loads(rec[4]["body"])["session_id"]  # no id anywhere: prefix inference named it
    assert inferred.startswith("inf-") and len(inferred) > 12
    assert rec[4]["body"].endswith(b'"input_ids":[1]}') and rec[4]["headers"]["X-SMG-Routing-Key"] == inferred
    assert rec[5]["body"] == b'{"session_params":{"id":"old"},"input_ids":[1]}'
    assert rec[6]["body"] == b"[not an object"
    sessions = {s["session_id"]: s for s in gw.lifecycle.registry.as_json(0.0)["sessions"]}
    assert set(sessions) == {"s1", "s2", "ep9", "kept", inferred}
    assert sessions[inferred]["source"] == "inferred" and sessions["s1"]["source"] == "header"
    assert all(s["turns"] == 1 and s["in_flight"] == 0 for s in sessions.values())
    m = gw.metrics.render()[0].decode()
    assert 'agentic_kv_session_id_injected_total{source="header"} 2.0' in m
    assert 'agentic_kv_session_params_skipped_total 1.0' in m


async def test_no_id_and_inference_off_leaves_body_untouched(kvgate_factory, echo_upstream):
    gw, url = await kvgate_factory(upstream=echo_upstream.url, agentic_session_lifecycle=True,
                                   session_inference=False)
    async with aiohttp.ClientSession() as http:
        async with http.post(url + "/generate", data=b'{"input_ids":[1]}') as r:
            assert r.status == 200
    assert echo_upstream.received[0]["body"] == b'{"input_ids":[1]}'
    assert "X-SMG-Routing-Key" not in echo_upstream.received[0]["headers"]
    assert len(gw.lifecycle.registry) == 0


async def test_sse_relayed_chunk_by_chunk(kvgate_factory, echo_upstream):
    gw, url = await kvgate_factory(upstream=echo_upstream.url)
    async with aiohttp.ClientSession() as http:
        async with http.post(url + "/sse", data=b"{}") as r:
            assert r.headers["Content-Type"] == "text/event-stream" and r.headers["X-Up"] == "1"
            first = await r.content.readuntil(b"\n\n")
            # the upstream has not produced chunk 1 yet: chunk 0 arrived without waiting for the rest
            assert first == b'data: {"i":0}\n\n'
            echo_upstream.release.set()
            rest = await r.read()
    assert rest == b'data: {"i":1}\n\ndata: {"i":2}\n\ndata: [DONE]\n\n'


async def test_upstream_down_is_502_naming_it(kvgate_factory):
    from kvgate.tools.procs import free_port
    dead = f"http://127.0.0.1:{free_port()}"
    gw, url = await kvgate_factory(upstream=dead)
    async with aiohttp.ClientSession() as http:
        async with http.post(url + "/generate", data=b'{"input_ids":[1]}') as r:
            assert r.status == 502
            err = (await r.json())["error"]
    assert err["upstream"] == dead and dead in err["message"] and err["type"] == "upstream_unreachable"
    assert 'agentic_kv_upstream_errors_total{kind="unreachable"} 1.0' in gw.metrics.render()[0].decode()


async def test_client_disconnect_cancels_upstream(kvgate_factory, echo_upstream):
    gw, url = await kvgate_factory(upstream=echo_upstream.url)
    http = aiohttp.ClientSession()
    task = asyncio.create_task(http.get(url + "/slow"))
    await echo_upstream.arrived.wait()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await http.close()
    await asyncio.wait_for(echo_upstream.cancelled.wait(), 10)  # the upstream handler saw its client leave
    m = gw.metrics.render()[0].decode()
    assert "agentic_kv_client_disconnects_total 1.0" in m
    assert "agentic_kv_inflight_requests 0.0" in m


async def test_huge_body_forwarded_and_over_limit_rejected(kvgate_factory, echo_upstream):
    gw, url = await kvgate_factory(upstream=echo_upstream.url, max_body_bytes=64 * 1024 * 1024)
    big = b"{" + b'"pad":"' + b"x" * (48 * 1024 * 1024) + b'"}'
    async with aiohttp.ClientSession() as http:
        async with http.post(url + "/generate", data=big) as r:
            assert r.status == 200
            assert (await r.json())["len"] == len(big)
        async with http.post(url + "/generate", data=b"x" * (65 * 1024 * 1024)) as r:
            assert r.status == 413
    assert len(echo_upstream.received) == 1


@pytest.mark.parametrize("raw", [b"", b"null", b"{bad json", b'"str"', b"\xff\xfe"])
async def test_non_object_bodies_are_answered_by_upstream(kvgate_factory, echo_upstream, raw):
    gw, url = await kvgate_factory(upstream=echo_upstream.url, agentic_session_lifecycle=True)
    async with aiohttp.ClientSession() as http:
        async with http.post(url + "/generate", data=raw, headers={"X-Session-ID": "s"}) as r:
            assert r.status == 200
    assert echo_upstream.received[0]["body"] == raw


async def test_own_endpoints(kvgate_factory, echo_upstream):
    gw, url = await kvgate_factory(upstream=echo_upstream.url, engines=["http://127.0.0.1:1@0", "http://127.0.0.1:1@1"])
    async with aiohttp.ClientSession() as http:
        async with http.get(url + "/kvgate/health") as r:
            h = await r.json()
        async with http.get(url + "/health") as r:  # forwarded, not answered by kvgate
            assert (await r.json())["path"] == "/health"
        async with http.get(url + "/kvgate/engines") as r:
            e = await r.json()
        async with http.post(url + "/close_session", json={"session_id": "x"}) as r:
            assert r.status == 200  # lifecycle off: still kvgate's, its close goes to the engines, not the router
    assert h["status"] == "ok" and h["session_lifecycle"] is False
    assert [x["url"] for x in e["engines"]] == ["http://127.0.0.1:1"]
    assert "/close_session" not in [r["path"] for r in echo_upstream.received]
    assert gw.lifecycle.registry.get("x").close_reason == "client"


async def test_kvgate_fault_fails_open(kvgate_factory, echo_upstream):
    gw, url = await kvgate_factory(upstream=echo_upstream.url, agentic_session_lifecycle=True)

    def broken(*a, **k):
        raise RuntimeError("injected")

    gw.resolver.resolve = broken
    gw.lifecycle.request_started = broken
    raw = b'{"input_ids":[1,2,3]}'
    async with aiohttp.ClientSession() as http:
        async with http.post(url + "/generate", data=raw, headers={"X-Session-ID": "s"}) as r:
            assert r.status == 200
    assert echo_upstream.received[0]["body"] == raw  # unchanged, not dropped
    m = gw.metrics.render()[0].decode()
    assert 'agentic_kv_faults_total{stage="session"} 1.0' in m


async def test_discovery_falls_back_to_list_workers(kvgate_factory):
    from aiohttp import web

    async def list_workers(request):
        return web.json_response({"urls": ["http://10.0.0.1:1@0", "http://10.0.0.1:1@1", "http://10.0.0.2:2"]})

    app = web.Application()
    app.router.add_get("/list_workers", list_workers)  # an old sglang-router: /workers is 404
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        router = f"http://127.0.0.1:{runner.addresses[0][1]}"
        gw, url = await kvgate_factory(upstream=router)
        await gw.directory.first_refresh.wait()
        assert gw.directory.urls == ["http://10.0.0.1:1", "http://10.0.0.2:2"]
        assert gw.directory.last_error is None
    finally:
        await runner.cleanup()
