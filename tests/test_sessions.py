"""The session registry with a hand-driven clock."""

from kvgate.sessions.registry import ACTIVE, CLOSED, CLOSING, FAILED, OK, PENDING, CloseRetry, SessionRegistry

E1, E2 = "http://e1", "http://e2"


def test_turns_inflight_tokens_and_idle():
    reg = SessionRegistry(wall=lambda: 1000.0)
    reg.request_started("a", "header", now=0.0)
    reg.request_started("a", "header", now=1.0)
    reg.request_finished("a", now=2.0, meta={"prompt_tokens": 10, "completion_tokens": 3, "cached_tokens": 4,
                                             "num_retractions": 2})
    s = reg.get("a")
    assert (s.turns, s.in_flight, s.prompt_tokens, s.completion_tokens, s.cached_tokens) == (2, 1, 10, 3, 4)
    assert s.retractions == 2 and reg.get("a").as_json(2.0)["retractions"] == 2
    assert reg.idle_sessions(now=100.0, idle_close_s=5) == []  # still one in flight
    reg.request_finished("a", now=3.0, meta={"num_retractions": True})  # not a count
    assert s.retractions == 2
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
    assert reg.begin_close("a", "client", 2.0) is True
    assert reg.begin_close("a", "idle", 2.1) is False
    assert reg.get("a").state == CLOSING
    gen = reg.get("a").close_gen
    assert reg.to_send("a", [E1, E2], 2.2) == [E1, E2]
    assert reg.to_send("a", [E1, E2], 2.2) == []  # calls are out: nothing more to send
    assert reg.close_result("a", gen, E1, "ok", 2.5) == OK
    assert reg.close_result("a", gen, E2, "timeout after 0.5s", 2.5) == PENDING  # a timeout is not success
    s = reg.get("a")
    assert s.state == CLOSING and s.close_results == {E1: "ok", E2: "timeout after 0.5s"}
    assert reg.close_counts() == {"sending": 0, "pending": 1}
    assert reg.due_retries(2.9) == []  # backoff 0.5 s
    assert reg.due_retries(3.0) == [("a", gen, E2)]
    assert reg.close_result("a", gen, E2, "ok", 3.1) == OK
    assert s.state == CLOSED and s.closes == 1 and s.close_results == {E1: "ok", E2: "ok"}
    assert reg.begin_close("a", "client", 3.2) is False  # closed on every engine: idempotent
    reg.request_started("a", None, 4.0)
    assert s.state == ACTIVE and s.reopened == 1 and s.turns == 2
    assert reg.begin_close("a", "client", 5.0) is True
    assert reg.begin_close("never-seen", "client", 5.0) is True  # closing an unknown id still fans out
    assert reg.counts() == {ACTIVE: 0, CLOSING: 2, CLOSED: 0, "dropped": 0}


def test_failed_close_backs_off_gives_up_and_is_rearmed_when_asked_again():
    reg = SessionRegistry(retry=CloseRetry(retries=2, backoff_s=1.0, max_backoff_s=1.5))
    assert reg.begin_close("s", "client", 0.0)
    gen = reg.get("s").close_gen
    assert reg.to_send("s", [E1], 0.0) == [E1]
    assert reg.close_result("s", gen, E1, "connect error", 0.0) == PENDING
    assert reg.next_due() == 1.0
    assert reg.due_retries(1.0) == [("s", gen, E1)]
    assert reg.close_result("s", gen, E1, "connect error", 1.0) == PENDING
    assert reg.next_due() == 2.5  # 1.0 x 2, capped at 1.5
    assert reg.due_retries(2.5) == [("s", gen, E1)]
    assert reg.close_result("s", gen, E1, "connect error", 2.5) == FAILED  # 2 retries used up
    s = reg.get("s")
    assert s.state == CLOSED and reg.close_stats["given_up"] == 1 and reg.close_stats["failed_attempts"] == 3
    # the client asks again: the failed engine is re-armed at once with fresh attempts
    assert reg.begin_close("s", "client", 100.0) is True
    assert s.state == CLOSING and reg.to_send("s", [E1], 100.0) == [E1]
    assert reg.close_result("s", gen, E1, "ok", 100.1) == OK and s.state == CLOSED and s.closes == 2


def test_reopen_cancels_pending_closes_and_stale_results_are_ignored():
    reg = SessionRegistry()
    reg.begin_close("s", "idle", 0.0)
    gen = reg.get("s").close_gen
    reg.to_send("s", [E1, E2], 0.0)
    reg.close_result("s", gen, E1, "connect error", 0.1)
    reg.request_started("s", None, 0.2)  # the agent came back from a long tool call
    s = reg.get("s")
    assert s.state == ACTIVE and s.engine_closes == {} and reg.close_stats["cancelled"] == 2
    assert reg.close_result("s", gen, E2, "ok", 0.3) is None  # the call that was out: stale
    assert reg.due_retries(100.0) == []  # E1's retry was dropped: it would untag the continued session
    assert reg.close_counts() == {"sending": 0, "pending": 0}


def test_cancel_close_when_the_session_came_back_through_another_replica():
    reg = SessionRegistry()
    reg.request_started("s", None, 0.0)
    reg.request_finished("s", 0.1)
    reg.begin_close("s", "client", 0.2)
    gen = reg.get("s").close_gen
    reg.to_send("s", [E1, E2], 0.2)
    reg.close_result("s", gen, E1, "ok", 0.3)
    reg.close_result("s", gen, E2, "connect error", 0.3)
    assert reg.cancel_close("s", 0.4) == 1  # E2's pending retry
    s = reg.get("s")
    assert s.state == CLOSED and s.closes == 1 and reg.close_stats["cancelled"] == 1
    assert s.close_results[E1] == "ok" and s.close_results[E2].startswith("cancelled")
    assert reg.due_retries(100.0) == [] and reg.close_counts() == {"sending": 0, "pending": 0}
    assert reg.close_result("s", gen, E2, "ok", 0.5) is None  # a call that was out: stale
    assert reg.cancel_close("s", 0.6) == 0  # not closing: nothing to do
    assert reg.request_started("s", None, 0.7).state == ACTIVE  # a turn here re-opens it as usual


def test_engine_back_makes_its_pending_closes_due_now():
    reg = SessionRegistry(retry=CloseRetry(retries=5, backoff_s=30.0))
    for sid in ("x", "y"):
        reg.begin_close(sid, "client", 0.0)
        reg.to_send(sid, [E1], 0.0)
        reg.close_result(sid, reg.get(sid).close_gen, E1, "connect error", 0.0)
    assert reg.due_retries(1.0) == []
    assert reg.engine_back(E1, 1.0) == 2
    assert sorted(sid for sid, _, _ in reg.due_retries(1.0)) == ["x", "y"]


def test_a_4xx_is_final_and_a_close_with_no_engine_known_waits_for_one():
    reg = SessionRegistry()
    reg.begin_close("s", "client", 0.0)
    reg.to_send("s", [E1], 0.0)
    assert reg.close_result("s", reg.get("s").close_gen, E1, "http 404", 0.0, final=True) == FAILED
    assert reg.get("s").state == CLOSED
    reg.begin_close("t", "client", 0.0)
    assert reg.to_send("t", [], 0.0) == [] and reg.get("t").state == CLOSING
    assert reg.awaiting_engines() == ["t"]
    assert reg.to_send("t", [E1, E2], 1.0) == [E1, E2] and reg.awaiting_engines() == []
    for e in (E1, E2):
        reg.close_result("t", reg.get("t").close_gen, e, "ok", 1.5)
    assert reg.get("t").state == CLOSED and reg.get("t").close_results == {E1: "ok", E2: "ok"}


def test_over_the_cap_a_close_no_engine_was_asked_for_goes_before_one_on_the_wire():
    reg = SessionRegistry(max_sessions=2)
    for sid in ("a", "b"):
        reg.begin_close(sid, "client", 0.0)
    reg.to_send("a", [E1], 0.0)  # a's call is out; b waits for an engine
    reg.begin_close("c", "client", 1.0)  # a third closing session: over the cap
    assert reg.get("b") is None and reg.dropped == 1
    assert reg.get("a").state == CLOSING and reg.awaiting_engines() == ["c"]


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
