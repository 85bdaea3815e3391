"""kvgate.proxy.conn_state: when a connection pauses and resumes reading, and its timer tables, without
sockets."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvgate.proxy.conn_state import Pause, Phase, ReadControl, Timers

REASONS = [Pause.PIPELINED, Pause.BODY, Pause.WRITE, Pause.BUDGET]


def test_reading_resumes_only_when_no_reason_is_left():
    c = ReadControl()
    assert c.pause(Pause.WRITE) is True  # the transport is told once ...
    assert c.pause(Pause.BODY) is False  # ... not again
    assert c.clear(Pause.WRITE) is False and c.reasons == Pause.BODY
    assert c.clear(Pause.BODY) is True and not c.paused


def test_a_closing_or_stopped_connection_never_resumes():
    c = ReadControl()
    c.pause(Pause.BODY)
    c.advance(Phase.CLOSING)
    assert c.clear(Pause.BODY) is False and c.paused and c.closing
    s = ReadControl()
    s.pause(Pause.STOPPED)
    assert s.stopped and s.clear(Pause.WRITE) is False
    assert s.linger() is True and s.phase is Phase.LINGERING and s.stopped and not s.paused
    s.advance(Phase.CLOSING)  # phases never go back
    assert s.phase is Phase.LINGERING
    s.advance(Phase.LOST)
    assert s.lost and s.pause(Pause.BODY) is False


@given(st.lists(st.tuples(st.booleans(), st.sampled_from(REASONS)), max_size=40))
def test_the_transport_is_paused_exactly_while_a_reason_holds(ops):
    c = ReadControl()
    transport_paused = False
    for pause, reason in ops:
        if pause:
            if c.pause(reason):
                assert not transport_paused
                transport_paused = True
        elif c.clear(reason):
            assert transport_paused
            transport_paused = False
        assert transport_paused == c.paused
        if c.reasons != Pause.NONE:
            assert transport_paused


def test_timers_oldest_first_and_a_restart_moves_to_the_end():
    t = Timers()
    t["a"] = 1.0
    t["b"] = 2.0
    t.enter_once("a", 5.0)  # runs already: unchanged
    t["c"] = 3.0
    t["b"] = 3.5  # already in: keeps its place
    t.restart("b", 4.0)  # restarted: to the end
    assert t.expired(2.5) == ["a"] and list(t) == ["c", "b"]
    t.drop("c")
    assert t.expired(10.0) == ["b"] and len(t) == 0
