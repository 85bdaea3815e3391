"""The session registry with a hand-driven clock."""

from kvgate.sessions.registry import ACTIVE, CLOSED, CLOSING, SessionRegistry


def test_turns_inflight_tokens_and_idle():
    reg = SessionRegistry(wall=lambda: 1000.0)
    reg.request_started("a", "header", now=0.0)
    reg.request_started("a", "header", now=1.0)
    reg.request_finished("a", now=2.0, meta={"prompt_tokens": 10, "completion_tokens": 3, "cached_tokens": 4})
    s = reg.get("a")
    assert (s.turns, s.in_flight, s.prompt_tokens, s.completion_tokens, s.cached_tokens) == (2, 1, 10, 3, 4)
    assert reg.idle_sessions(now=100.0, idle_close_s=5) == []  # still one in flight
    reg.request_finished("a", now=3.0, meta=None)
    reg.request_started("b", None, now=4.0)
    reg.request_finished("b", now=4.5)
    assert reg.idle_sessions(now=8.5, idle_close_s=5) == ["a"]
    assert reg.idle_sessions(now=9.6, idle_close_s=5) == ["a", "b"]
    assert reg.idle_sessions(now=1e9, idle_close_s=0) == []


def test_close_is_idempotent_and_reopens():
    reg = SessionRegistry()
    reg.request_started("a", None, 0.0)
    reg.request_finished("a", 1.0)
    assert reg.begin_close("a", "explicit", 2.0) is True
    assert reg.begin_close("a", "idle", 2.1) is False
    assert reg.get("a").state == CLOSING
    reg.finish_close("a", {"http://e1": "ok", "http://e2": "timeout"}, 2.5)
    s = reg.get("a")
    assert s.state == CLOSED and s.closes == 1 and s.close_results["http://e2"] == "timeout"
    assert reg.begin_close("a", "explicit", 3.0) is False
    reg.request_started("a", None, 4.0)
    assert s.state == ACTIVE and s.reopened == 1 and s.turns == 2
    assert reg.begin_close("a", "explicit", 5.0) is True
    assert reg.begin_close("never-seen", "explicit", 5.0) is True  # closing an unknown id still fans out
    assert reg.counts() == {ACTIVE: 0, CLOSING: 2, CLOSED: 0, "dropped": 0}


def test_cap_drops_oldest_idle_and_counts():
    reg = SessionRegistry(max_sessions=3)
    reg.request_started("busy", None, 0.0)  # in flight: never dropped
    for i, sid in enumerate(["a", "b", "c", "d"]):
        reg.request_started(sid, None, 1.0 + i)
        reg.request_finished(sid, 1.5 + i)
    assert len(reg) == 3 and reg.dropped == 2
    assert reg.get("busy") is not None and reg.get("a") is None and reg.get("b") is None
    view = reg.as_json(now=10.0, limit=2)
    assert [s["session_id"] for s in view["sessions"]] == ["d", "c"]
    assert view["counts"]["dropped"] == 2
