"""Session keys and ends from what clients already send (kvgate.sessions.identity, pure).

The rid lineage rule is smg's (model_gateway/src/policies/registry.rs ``strip_lineage_suffixes``: one trailing
``_r<n>``, then one trailing ``_t<n>``); a port of that Rust function is the oracle of a hypothesis property.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgate.sessions.identity import SessionResolver, has_lineage, rid_lineage, session_marks


def _smg_strip_suffix_tag(s: str, tag: str) -> str:
    # smg: let Some((head, tail)) = s.rsplit_once('_') else { return s }; tail.strip_prefix(tag) with
    # non-empty ASCII digits -> head, else s.
    if "_" not in s:
        return s
    head, tail = s.rsplit("_", 1)
    if not tail.startswith(tag):
        return s
    digits = tail[len(tag):]
    return head if digits and all("0" <= c <= "9" for c in digits) else s


def _smg_derive_rid_key(rid: str) -> str:
    stripped = _smg_strip_suffix_tag(_smg_strip_suffix_tag(rid, "r"), "t")
    return rid if stripped == "" else stripped


@pytest.mark.parametrize("rid,key", [
    ("abc_t1", "abc"), ("abc_t2", "abc"), ("abc_r1", "abc"), ("conv_t2_r1", "conv"), ("abc_t2_r13", "abc"),
    ("abc", "abc"), ("abc_t", "abc_t"), ("abc_tx1", "abc_tx1"), ("abc_r1_t2", "abc_r1"), ("_t1", "_t1"),
    ("a_b_t3", "a_b"), ("abc_t١", "abc_t١"),  # a non-ASCII digit is not a suffix (Rust's is_ascii_digit)
])
def test_rid_lineage_strips_as_smg_does(rid, key):
    assert rid_lineage(rid) == key == _smg_derive_rid_key(rid)


@settings(max_examples=500, deadline=None)
@given(st.text(alphabet="ab_tr019١", max_size=12))
def test_rid_lineage_is_smg_rule_on_any_rid(rid):
    assert rid_lineage(rid) == _smg_derive_rid_key(rid)
    assert has_lineage(rid) == (rid_lineage(rid) != rid)


def test_precedence_body_header_alias_routing_key_field_rid():
    r = SessionResolver(field="user")
    all_h = {"X-Session-ID": "h", "x-dynamo-session-id": "dyn", "X-SMG-Routing-Key": "rk"}
    body = {"session_id": "b", "user": "u", "rid": "conv_t3"}
    assert (r.resolve(body, all_h).session_id, r.resolve(body, all_h).source) == ("b", "body")
    body.pop("session_id")
    assert (r.resolve(body, all_h).session_id, r.resolve(body, all_h).source) == ("h", "header")
    all_h.pop("X-Session-ID")
    assert (r.resolve(body, all_h).session_id, r.resolve(body, all_h).source) == ("dyn", "header")
    all_h.pop("x-dynamo-session-id")
    assert (r.resolve(body, all_h).session_id, r.resolve(body, all_h).source) == ("rk", "routing_key")
    assert (r.resolve(body, {}).session_id, r.resolve(body, {}).source) == ("u", "field")
    body.pop("user")
    res = r.resolve(body, {})
    assert (res.session_id, res.source, res.inject) == ("conv", "rid", True)


def test_rid_lineage_modes_and_batches():
    suffixed, anyrid, off = (SessionResolver(rid_lineage=m) for m in ("suffixed", "any", "off"))
    assert suffixed.resolve({"rid": "3f9a0c"}, {}).session_id is None  # a fresh random rid names nothing
    assert anyrid.resolve({"rid": "3f9a0c"}, {}).session_id == "3f9a0c"
    assert off.resolve({"rid": "conv_t1"}, {}).session_id is None
    assert suffixed.resolve({"rid": ["c_t1", "c_t1_r2"]}, {}).session_id == "c"
    assert suffixed.resolve({"rid": ["c_t1", "d_t1"]}, {}).session_id is None
    assert suffixed.resolve({"rid": ["c_t1", 3]}, {}).session_id is None
    assert suffixed.resolve({"rid": 7}, {}).session_id is None


def test_routing_key_headers_are_configurable_like_smgs():
    r = SessionResolver(routing_key_headers=("x-routing-key", "X-SMG-Routing-Key"))
    assert r.resolve({}, {"X-SMG-Routing-Key": "b", "x-routing-key": "a"}).session_id == "a"
    assert SessionResolver(routing_key_headers=()).resolve({}, {"X-SMG-Routing-Key": "b"}).session_id is None
    with pytest.raises(ValueError):
        SessionResolver(order=("body", "cookie"))
    with pytest.raises(ValueError):
        SessionResolver(rid_lineage="sometimes")


def test_session_marks_final_and_parent():
    assert session_marks({}) == (False, None)
    assert session_marks({"X-Session-Final": "true"}) == (True, None)
    assert session_marks({"x-dynamo-session-final": "TRUE", "x-dynamo-parent-session-id": "p"}) == (True, "p")
    assert session_marks({"X-Session-Final": "false", "X-Parent-Session-ID": ""}) == (False, None)
    assert session_marks({"X-Session-Final": "1"}) == (True, None)


def test_registry_links_children_and_forgets_them_with_the_child():
    from kvgate.sessions.registry import SessionRegistry
    reg = SessionRegistry(max_sessions=3)
    for sid in ("p", "c1", "c2"):
        reg.request_started(sid, "header", 0.0)
        reg.request_finished(sid, 1.0)
    assert reg.link_parent("c1", "p") and reg.link_parent("c2", "p") and not reg.link_parent("c2", "p")
    assert not reg.link_parent("p", "p") and not reg.link_parent("ghost", "p")
    assert reg.children("p") == ["c1", "c2"] and reg.session_json("p", 2.0)["children"] == ["c1", "c2"]
    assert reg.link_parent("c2", "other")  # a later parent moves it
    assert reg.children("p") == ["c1"] and reg.children("other") == ["c2"]
    assert reg.get("c2").as_json(2.0)["parent"] == "other"
    reg.request_started("x", None, 3.0)  # over the cap: the longest idle (p) goes; then c1 ...
    reg.request_started("y", None, 3.0)
    assert reg.get("c1") is None and reg.children("p") == []
