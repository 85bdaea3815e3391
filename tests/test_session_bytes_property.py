"""Whichever convention names a session, a request's bytes reach the upstream unchanged but for the documented
session fields (hypothesis over bodies, formatting and conventions).

The documented fields (README, docs/sessions.md): a top-level ``"session_id":"<id>"`` member inserted first into
the JSON object (absent from the body before; a body that already carries that id goes byte for byte), and the
routing-key header set to the id when the client set none. Every header the client sent arrives with the same
bytes (hop-by-hop headers aside). kvgate (in process) and a raw-socket upstream that records the bytes share one
event loop on a background thread; the test sends from the main thread.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import threading

import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fake_upstream import ScriptedUpstream
from kvgate.common.classify import inject_top_level
from kvgate.config import validate
from kvgate.proxy.bootstrap import start_gateway
from kvgate.sessions.identity import rid_lineage

CONVENTIONS = ("body", "header", "dynamo", "routing_key", "rid", "inferred")
RESERVED = {"session_id", "session_params", "rid", "messages", "prompt", "text", "input_ids", "n"}


class _Loop:
    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.upstream = self.run(ScriptedUpstream().start())
        self.gw, self.runner, self.port = self.run(start_gateway(validate({
            "upstream": self.upstream.url, "port": 0, "compat_probe": False, "agentic_session_lifecycle": True,
            "session_idle_close_s": 0})))

    def run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    def close(self):
        self.run(self.runner.cleanup())
        self.run(self.upstream.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


_FLEET: _Loop | None = None


def _fleet() -> _Loop:
    global _FLEET
    if _FLEET is None:
        _FLEET = _Loop()
    return _FLEET


def teardown_module(module):
    if _FLEET is not None:
        _FLEET.close()


json_leaf = st.none() | st.booleans() | st.integers(-2**63, 2**63 - 1) | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8)
json_value = st.recursive(json_leaf, lambda kids: st.lists(kids, max_size=3) | st.dictionaries(
    st.text(max_size=5), kids, max_size=3), max_leaves=8)
extra_fields = st.dictionaries(st.text(min_size=1, max_size=8).filter(lambda k: k not in RESERVED), json_value,
                               max_size=4)
sid_text = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7e), min_size=1, max_size=20)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(route=st.sampled_from(["/generate", "/v1/completions", "/v1/chat/completions"]),
       convention=st.sampled_from(CONVENTIONS), sid=sid_text, extra=extra_fields,
       indent=st.sampled_from([None, 1, 3]), sep=st.sampled_from([(",", ":"), (", ", ": "), (" ,", " :  ")]),
       final=st.booleans(), parent=st.none() | sid_text, turn=st.integers(1, 9))
def test_bytes_reach_the_upstream_unchanged_but_for_the_session_fields(route, convention, sid, extra, indent, sep,
                                                                       final, parent, turn):
    f = _fleet()
    body = dict(extra)
    if route == "/generate":
        body["text"] = "t" * 300 + sid
    elif route == "/v1/completions":
        body["prompt"] = "p" * 300 + sid
    else:
        body["messages"] = [{"role": "user", "content": "m" * 300 + sid}]
    headers = {"Content-Type": "application/json", "X-Trace": f"t-{turn}"}
    want = sid
    if convention == "body":
        body = {"session_id": sid, **body}
    elif convention == "header":
        headers["X-Session-ID"] = sid
    elif convention == "dynamo":
        headers["x-dynamo-session-id"] = sid
    elif convention == "routing_key":
        headers["X-SMG-Routing-Key"] = sid
    elif convention == "rid":
        body["rid"] = f"{sid}_t{turn}"
        want = rid_lineage(body["rid"])
    else:
        want = None
    if final:
        headers["X-Session-Final"] = "true"
    if parent is not None:
        headers["x-dynamo-parent-session-id"] = parent
    raw = json.dumps(body, indent=indent, separators=sep).encode()
    f.upstream.received.clear()
    conn = http.client.HTTPConnection("127.0.0.1", f.port, timeout=30)
    conn.request("POST", route, body=raw, headers=headers)
    resp = conn.getresponse()
    resp.read()
    conn.close()
    assert resp.status == 200
    (rec,) = f.upstream.received
    told = resp.getheader("X-Kvgate-Session-Id")
    assert told is not None
    if convention == "inferred":
        assert told.startswith("inf-")
        want = told
    if convention == "body":
        assert rec.body == raw  # the id was there already: not a byte changes
    else:
        assert rec.body == inject_top_level(raw, "session_id", want)
        assert orjson.loads(rec.body)["session_id"] == want
    for k, v in headers.items():
        assert rec.header(k.encode()) == v.encode(), k
    if "X-SMG-Routing-Key" not in headers:
        assert rec.header(b"X-SMG-Routing-Key") is not None
