"""Every error kvgate answers on its own /kvgate/ endpoints has one body shape, SGLang's error object nested as
OpenAI's: ``{"error": {"message", "type", "code"}}`` with ``code`` the HTTP status, on both HTTP servers."""

from __future__ import annotations

import aiohttp
import pytest


@pytest.mark.parametrize("server", ["kvgate", "aiohttp"])
async def test_each_kind_of_refusal_carries_message_type_and_code(kvgate_factory, echo_upstream, tmp_path, server):
    gw, url = await kvgate_factory(upstream=echo_upstream.url, http_server=server, agentic_session_lifecycle=True,
                                   max_session_id_bytes=8)
    async with aiohttp.ClientSession() as http:
        cases = [
            ("GET", "/kvgate/sessions/nope", 404, "not_found", "unknown session 'nope'"),
            ("GET", "/kvgate/nothing", 404, "not_found", None),
            ("DELETE", "/kvgate/sessions/x", 405, "method_not_allowed",
             "DELETE is not allowed on /kvgate/sessions/x; allowed: GET, HEAD"),
            ("GET", "/kvgate/sessions?limit=x", 400, "invalid_request", "limit and offset must be integers"),
            ("GET", "/kvgate/sessions?offset=-1", 400, "invalid_request", "limit and offset must be >= 0"),
            ("GET", "/kvgate/sessions?state=gone", 400, "invalid_request",
             "state must be one of active, closing, closed"),
            ("GET", "/kvgate/sessions/123456789", 400, "invalid_request",
             "session_id is over max_session_id_bytes (8 bytes)"),
        ]
        for method, path, status, kind, message in cases:
            async with http.request(method, url + path) as r:
                body = await r.json()
                assert r.status == status, (server, path)
                assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "code"}, (server, path)
                assert (body["error"]["type"], body["error"]["code"]) == (kind, status), (server, path)
                if message is not None:
                    assert body["error"]["message"] == message
                else:
                    assert body["error"]["message"].startswith("kvgate has no endpoint /kvgate/nothing; its endpoints: ")
    assert echo_upstream.received == []


async def test_without_the_admin_key_the_403_has_the_same_shape(kvgate_factory, echo_upstream, tmp_path):
    (tmp_path / "key").write_text("k3y\n")
    gw, url = await kvgate_factory(upstream=echo_upstream.url, admin_key_file=str(tmp_path / "key"))
    async with aiohttp.ClientSession() as http:
        async with http.get(url + "/kvgate/sessions/nope") as r:
            assert (r.status, await r.json()) == (403, {"error": {
                "message": "kvgate: this endpoint needs the admin key (header X-Kvgate-Admin-Key)",
                "type": "forbidden", "code": 403}})
        async with http.get(url + "/kvgate/sessions/nope", headers={"X-Kvgate-Admin-Key": "k3y"}) as r:
            assert (r.status, await r.json()) == (404, {"error": {
                "message": "unknown session 'nope'", "type": "not_found", "code": 404}})
