"""Pure pieces of the request path: classify, session identity, body rewrite, observe, discovery, compat."""

import orjson
import pytest

from kvgate.fleet import compat
from kvgate.common.classify import classify, inject_top_level, with_session_id
from kvgate.fleet.discovery import DiscoveryError, engine_base_url, parse_list_workers, parse_workers
from kvgate.sessions.observe import ResponseObserver
from kvgate.sessions.identity import SessionResolver


def test_classify_generate_routes_and_bad_bodies():
    c = classify("POST", "/generate", b'{"input_ids":[1,2]}')
    assert c.is_generate and c.body == {"input_ids": [1, 2]} and c.route == "/generate"
    assert classify("POST", "/generate", b"[1,2]").body is None
    assert classify("POST", "/generate", b"{not json").body is None
    assert classify("GET", "/generate", b"").is_generate is False
    assert classify("POST", "/some/unknown", b"{}").route == "other"


@pytest.mark.parametrize("raw", [b'{"a":1}', b'  {  "a" : 1.50, "b":[1,2] }', b"{}", b"{ }", b'{"x":{"y":{}}}'])
def test_inject_keeps_everything_else_byte_for_byte(raw):
    out = inject_top_level(raw, "session_id", "s-1")
    obj = orjson.loads(out)
    assert obj["session_id"] == "s-1"
    assert {k: v for k, v in obj.items() if k != "session_id"} == orjson.loads(raw)
    # the original bytes after "{" are untouched
    assert out.endswith(raw[raw.index(b"{") + 1:])


def test_with_session_id_rules():
    raw = b'{"input_ids":[1],"session_id":"other"}'
    out = with_session_id(raw, orjson.loads(raw), "s")
    assert orjson.loads(out) == {"input_ids": [1], "session_id": "s"}  # no duplicate key left behind
    assert out.count(b"session_id") == 1
    same = b'{"session_id":"s"}'
    assert with_session_id(same, orjson.loads(same), "s") is None
    legacy = b'{"session_params":{"id":"x"}}'
    assert with_session_id(legacy, orjson.loads(legacy), "s") is None  # never both: SGLang 400s that


def test_resolution_order_and_regex():
    r = SessionResolver(header="X-Session-ID", field="rid", field_regex=r"^(.+)-turn\d+$")
    assert r.resolve({"session_id": "b"}, {"X-Session-ID": "h"}).session_id == "b"
    res = r.resolve({}, {"X-Session-ID": "h"})
    assert (res.session_id, res.source, res.inject) == ("h", "header", True)
    res = r.resolve({"rid": "ep7-turn3"}, {})
    assert (res.session_id, res.source) == ("ep7", "field")
    assert r.resolve({"rid": "no-match"}, {}).session_id is None
    assert r.resolve({"rid": ["ep1-turn1", "ep1-turn2"]}, {}).session_id == "ep1"
    assert r.resolve({"rid": ["ep1-turn1", "ep2-turn2"]}, {}).session_id is None
    assert r.resolve({"session_id": 5}, {}).session_id is None
    header_first = SessionResolver(order=("header", "body"))
    assert header_first.resolve({"session_id": "b"}, {"X-Session-ID": "h"}).session_id == "h"
    whole = SessionResolver(order=("field",), field="user")
    assert whole.resolve({"user": "alice"}, {}).session_id == "alice"


def test_observer_json_and_sse_across_chunk_boundaries():
    body = orjson.dumps({"text": "x", "output_ids": [5, 6], "meta_info": {"prompt_tokens": 7, "completion_tokens": 2,
                                                                         "cached_tokens": 3, "finish_reason": {"type": "length", "length": 2}}})
    o = ResponseObserver(is_sse=False)
    for i in range(0, len(body), 5):
        o.feed(body[i:i + 5])
    got = o.result()
    assert got.meta_info["prompt_tokens"] == 7 and got.output_ids == [5, 6] and got.finish_type == "length"

    events = [{"output_ids": [5], "meta_info": {"completion_tokens": 1, "finish_reason": None}},
              {"output_ids": [5, 6], "meta_info": {"completion_tokens": 2, "prompt_tokens": 7,
                                                    "finish_reason": {"type": "abort", "message": "x"}}}]
    stream = b"".join(b"data: " + orjson.dumps(e) + b"\n\n" for e in events) + b"data: [DONE]\n\n"
    o = ResponseObserver(is_sse=True)
    for i in range(0, len(stream), 7):
        o.feed(stream[i:i + 7])
    got = o.result()
    assert got.output_ids == [5, 6] and got.meta_info["completion_tokens"] == 2 and got.finish_type == "abort"
    assert ResponseObserver(is_sse=False).result().meta_info is None
    bad = ResponseObserver(is_sse=False)
    bad.feed(b"<html>")
    assert bad.result().meta_info is None


def test_observer_openai_usage_and_cap():
    o = ResponseObserver(is_sse=False)
    o.feed(orjson.dumps({"choices": [{"finish_reason": "stop"}], "usage": {"prompt_tokens": 4, "completion_tokens": 9}}))
    got = o.result()
    assert got.meta_info == {"prompt_tokens": 4, "completion_tokens": 9} and got.finish_type == "stop"
    small = ResponseObserver(is_sse=False, max_json_bytes=10)
    small.feed(b'{"meta_info":{"prompt_tokens":1}}')
    assert small.result().meta_info is None


def test_discovery_collapses_dp_ranks_and_keeps_pd_roles():
    obj = {"workers": [
        {"url": "http://h:1@0", "worker_type": "regular", "is_healthy": False},
        {"url": "http://h:1@1", "worker_type": "regular", "is_healthy": True},
        {"url": "http://p:2", "worker_type": "prefill", "is_healthy": True},
        {"url": "http://d:3/", "worker_type": "decode", "is_healthy": False},
        {"nourl": 1},
    ], "total": 4}
    engines = parse_workers(obj)
    assert [(e.url, e.worker_type, e.healthy) for e in engines] == [
        ("http://h:1", "regular", True), ("http://p:2", "prefill", True), ("http://d:3", "decode", False)]
    assert [e.url for e in parse_list_workers({"urls": ["http://a:1@0", "http://a:1@1", "http://b:2"]})] == [
        "http://a:1", "http://b:2"]
    assert engine_base_url("http://[::1]:8000@12") == "http://[::1]:8000"
    with pytest.raises(DiscoveryError):
        parse_workers({"urls": []})
    with pytest.raises(DiscoveryError):
        parse_list_workers([])


# Answers recorded from SGLang 0.5.23 (CPU) to the probe, straight and through the routers (docs/real-engines.md).
ENGINE_SESSION_ID_INVALID = (b'{"object":"error","message":"1 validation error:\\n  {\'type\': \'string_type\', \'loc\': '
                             b'(\'body\', \'session_id\'), \'msg\': \'Input should be a valid string\', \'input\': 0}'
                             b'\\n","type":"Bad Request","param":null,"code":400}')
ENGINE_SESSION_UNKNOWN = b'{"error":{"message":"Invalid request: session id kvgate-probe-3f2a does not exist"}}'
ENGINE_CHAT_200 = (b'{"id":"4f6a","object":"chat.completion","created":1,"model":"kvgate-tiny","choices":[{"index":0,'
                   b'"message":{"role":"assistant","content":"gram"},"finish_reason":"length"}],"usage":{}}')
ENGINE_GENERATE_200 = b'{"text":"rin","output_ids":[395],"meta_info":{"id":"af87","finish_reason":{"type":"length"}}}'


def test_probe_verdicts():
    assert compat.classify_probe(400, ENGINE_SESSION_ID_INVALID) == compat.FORWARDED
    both = b'{"error":{"message":"session_id and session_params cannot both be set."}}'
    assert compat.classify_probe(400, both) == compat.FORWARDED
    assert compat.classify_probe(400, ENGINE_SESSION_UNKNOWN) == compat.DROPPED
    assert compat.classify_probe(200, ENGINE_GENERATE_200) == compat.DROPPED
    assert compat.classify_probe(200, ENGINE_CHAT_200) == compat.DROPPED
    assert compat.classify_probe(200, b'{"meta_info":{"finish_reason":{"type":"abort"}}}') == compat.DROPPED
    # Answers the probe does not recognise are no verdict: unknown, never dropped.
    for status, body in [
            (503, b'{"error":{"code":"no_available_workers"}}'), (500, b'{"error":{"code":"no_available_workers"}}'),
            (None, b""), (401, b'{"error":{"message":"Unauthorized"}}'), (404, b'{"error":{"code":"model_not_found"}}'),
            (400, b'{"object":"error","message":"The engine was started with --skip-tokenizer-init","code":400}'),
            (500, b'Internal Server Error'), (200, b'{"ok":true}'), (200, b"not json"), (200, b"[1]"),
            # a router rejecting the number itself is not the engine's validation error
            (422, b'Failed to deserialize the JSON body: session_id: invalid type: integer `0`, expected a string'),
            (400, b'{"error":{"message":"session does not exist"}}')]:
        assert compat.classify_probe(status, body) == compat.UNKNOWN, (status, body)
    body = orjson.loads(compat.probe_body("p1"))
    assert body["session_id"] == compat.PROBE_SESSION_ID and body["session_params"] == {"id": "p1"}
    assert body["sampling_params"]["max_new_tokens"] == 1
    for route in compat.PROBE_ROUTES[1:]:
        chat = orjson.loads(compat.probe_body("p2", route, "m"))
        assert chat["session_id"] == compat.PROBE_SESSION_ID and "session_params" not in chat
        assert chat["model"] == "m" and chat["max_tokens"] == 1
    with pytest.raises(ValueError):
        compat.probe_body("p", "/v1/responses")
    line = compat.verdict_line({"/generate": compat.DROPPED, "/v1/completions": compat.FORWARDED}, "http://r", True,
                               {"/generate": True})
    assert line == ("compat: router http://r top-level session_id: /generate dropped (kvgate places sessions), "
                    "/v1/chat/completions unknown (via the router), /v1/completions forwarded (via the router)")
    assert compat.routing_key_warning("cache_aware", "X-SMG-Routing-Key").startswith("router policy 'cache_aware'")
    assert compat.routing_key_warning("manual", "X-SMG-Routing-Key") is None
    assert compat.routing_key_warning(None, "X-SMG-Routing-Key") is None


def test_engine_warnings():
    kinds = lambda info, st=200: [k for k, _ in compat.engine_warnings(info, st)]
    assert kinds({"enable_session_radix_cache": True, "version": "0.5.17"}) == []
    assert kinds({"enable_session_radix_cache": False, "version": "0.5.17"}) == ["session_radix_cache_off"]
    assert kinds({"enable_session_radix_cache": True, "version": "0.5.15", "radix_eviction_policy": "lru"}) == [
        "needs_priority_eviction"]
    assert kinds({"enable_session_radix_cache": True, "version": "0.5.16.post2",
                  "radix_eviction_policy": "priority"}) == []
    assert kinds({"enable_session_radix_cache": True, "version": "0.5.9"}) == ["engine_too_old"]
    assert kinds({"enable_session_radix_cache": True}, 404) == ["metrics_404"]
    assert kinds({"enable_session_radix_cache": True, "enable_cache_report": False}) == ["cache_report_off"]
    assert kinds({"enable_session_radix_cache": True, "enable_cache_report": True}) == []
    assert kinds(None, None) == ["server_info_unreadable"]
    assert compat.parse_version("0.5.17rc1") == (0, 5, 17)


def test_probe_is_unknown_unless_it_got_an_answer_it_knows():
    """Only the engine's both-set 400 (forwarded) and what an engine answers without session_id (its
    session-does-not-exist 400, an abort, a generation) are verdicts; a refused key, a router's own
    validation error, a limiter or an unparsable 200 are unknown, and kvgate probes again."""
    for status, body in [(401, b'{"error":{"message":"Unauthorized"}}'), (403, b"Forbidden"),
                         (422, b'{"error":{"message":"invalid type: string"}}'), (415, b""),
                         (400, b'{"error":{"message":"unknown field `session_id`"}}'), (429, b"{}"),
                         (200, b"not json"), (200, b'{"ok": true}'), (404, b'{"error":{"code":"model_not_found"}}')]:
        assert compat.classify_probe(status, body) == compat.UNKNOWN, (status, body)
    assert compat.classify_probe(200, b'{"text":"a","meta_info":{"id":"x"}}') == compat.DROPPED
    assert compat.classify_probe(200, b'[{"text":"a","meta_info":{}},{"text":"b","meta_info":{}}]') == compat.DROPPED
    assert compat.classify_probe(200, b'{"id":"c","choices":[{"text":"a"}]}') == compat.DROPPED
    assert compat.classify_probe(
        400, b'{"error":{"message":"Invalid request: session id p does not exist"}}') == compat.DROPPED
    # the routing-key warning: smg 1.13 keeps a key on one worker with consistent_hashing, manual, or sticky sessions
    assert compat.routing_key_warning("consistent_hashing", "X-SMG-Routing-Key") is None
    assert compat.routing_key_warning("cache_aware", "X-SMG-Routing-Key", sticky=True) is None
    assert "--sticky-sessions" in compat.routing_key_warning("round_robin", "X-SMG-Routing-Key")
