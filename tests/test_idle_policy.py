"""Adaptive idle close, step boundaries and abort (kvgate.sessions.idle_policy), with a hand-driven clock."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgate.common.classify import STEP_BOUNDARY_ROUTES
from kvgate.sessions.idle_policy import ADAPTIVE, FIXED, GapWindow, IdlePolicy, StepTracker, ends_session, flushes_kv


def turns(policy: IdlePolicy, sid: str, gaps, start: float = 0.0, busy_s: float = 1.0) -> float:
    """Drive ``sid`` through len(gaps)+1 turns of ``busy_s`` seconds separated by ``gaps``; returns the end time."""
    now = start
    policy.on_turn_start(sid, now)
    now += busy_s
    policy.on_turn_end(sid, now)
    for g in gaps:
        now += g
        policy.on_turn_start(sid, now)
        now += busy_s
        policy.on_turn_end(sid, now)
    return now


def test_gap_window_nearest_rank_quantiles():
    w = GapWindow(10)
    assert w.quantile(0.5) is None
    for x in range(1, 11):
        w.add(float(x))
    assert (w.quantile(0.5), w.quantile(0.95), w.quantile(1.0), w.quantile(0.0)) == (5.0, 10.0, 10.0, 1.0)
    for x in (100.0, 200.0):  # the ring drops the two oldest (1, 2)
        w.add(x)
    assert len(w) == 10 and w.total == 12
    assert w.quantile(0.1) == 3.0 and w.quantile(1.0) == 200.0
    for bad in (-1.0, math.nan, math.inf):
        w.add(bad)
    assert w.total == 12


def test_fixed_mode_is_todays_session_idle_close_s():
    p = IdlePolicy(mode=FIXED, fixed_s=300.0)
    turns(p, "a", [50.0, 2000.0])
    assert p.threshold("a") == 300.0 and p.sweep_threshold() == 300.0
    assert p.should_close("a", 300.5) and not p.should_close("a", 300.0)
    never = IdlePolicy(mode=FIXED, fixed_s=0.0)
    assert not never.should_close("a", 1e9) and never.sweep_threshold() == 0.0


def test_adaptive_falls_back_until_enough_gaps():
    p = IdlePolicy(mode=ADAPTIVE, fixed_s=300.0, min_samples=5, floor_s=10.0, ceiling_s=900.0)
    turns(p, "a", [2.0, 2.0, 2.0, 2.0])  # 4 gaps < 5
    assert p.global_threshold() == 300.0
    p2 = IdlePolicy(mode=ADAPTIVE, fixed_s=0.0, min_samples=5, ceiling_s=900.0)
    assert p2.global_threshold() == 900.0  # fixed 0 (never) -> the ceiling until learned
    p3 = IdlePolicy(mode=ADAPTIVE, fixed_s=5000.0, min_samples=5, ceiling_s=900.0)
    assert p3.global_threshold() == 900.0  # clamped


def test_adaptive_threshold_is_multiple_of_quantile_within_floor_and_ceiling():
    p = IdlePolicy(mode=ADAPTIVE, quantile=0.95, multiple=3.0, floor_s=10.0, ceiling_s=900.0, min_samples=20,
                   per_session=False)
    for s in range(20):  # 20 sessions, one gap each: 1, 2, ..., 20 s
        turns(p, f"s{s}", [float(s + 1)], start=1000.0 * s)
    # nearest rank: ceil(0.95 * 20) = 19th of 1..20 -> 19 s; x3 = 57 s
    assert p.global_threshold() == pytest.approx(57.0)
    assert p.should_close("s0", 57.5) and not p.should_close("s0", 56.0)
    low = IdlePolicy(mode=ADAPTIVE, multiple=2.0, floor_s=10.0, ceiling_s=900.0, min_samples=3, per_session=False)
    turns(low, "x", [0.5, 0.5, 0.5])
    assert low.global_threshold() == 10.0  # 1 s -> floor
    high = IdlePolicy(mode=ADAPTIVE, multiple=2.0, floor_s=10.0, ceiling_s=900.0, min_samples=3, per_session=False)
    turns(high, "x", [600.0, 600.0, 600.0])
    assert high.global_threshold() == 900.0  # 1200 s -> ceiling


def test_a_session_with_long_tools_keeps_a_longer_threshold():
    p = IdlePolicy(mode=ADAPTIVE, quantile=0.9, multiple=2.0, floor_s=5.0, ceiling_s=600.0, min_samples=10)
    for s in range(30):
        turns(p, f"fast{s}", [3.0], start=100.0 * s)
    turns(p, "slow", [120.0], start=10_000.0)
    assert p.global_threshold() == pytest.approx(6.0)  # 0.9-quantile of 30 x 3 s and one 120 s gap = 3 s
    assert p.threshold("slow") == pytest.approx(240.0)
    assert p.threshold("fast0") == pytest.approx(6.0)
    assert p.sweep_threshold() <= min(p.threshold("slow"), p.threshold("fast0"))
    assert not p.should_close("slow", 200.0) and p.should_close("fast0", 7.0)


def test_parallel_calls_record_no_gap_and_first_turn_none():
    p = IdlePolicy(mode=ADAPTIVE)
    assert p.on_turn_start("a", 0.0) is None
    assert p.on_turn_start("a", 1.0) is None  # the first is still in flight
    p.on_turn_end("a", 2.0)
    p.on_turn_end("a", 3.0)
    assert p.on_turn_start("a", 10.0) == 7.0  # from the end of the last one in flight
    assert p.gaps.total == 1
    p.on_turn_end("unknown", 1.0)  # ignored


def test_window_follows_a_change_of_workload():
    p = IdlePolicy(mode=ADAPTIVE, quantile=0.5, multiple=1.0, floor_s=1.0, ceiling_s=1000.0, window=50,
                   min_samples=10, per_session=False)
    turns(p, "a", [100.0] * 60)
    assert p.global_threshold() == 100.0
    turns(p, "b", [10.0] * 60, start=1e6)
    assert p.global_threshold() == 10.0


def test_per_session_records_are_bounded():
    p = IdlePolicy(mode=ADAPTIVE, max_sessions=100)
    for i in range(1000):
        p.on_turn_start(f"s{i}", float(i))
    assert len(p._sessions) == 100
    p.forget("s999")
    assert len(p._sessions) == 99


def test_bad_parameters_raise():
    for kw in ({"mode": "x"}, {"quantile": 0.0}, {"quantile": 1.5}, {"multiple": 0}, {"floor_s": 0},
               {"floor_s": 10, "ceiling_s": 5}, {"fixed_s": -1}):
        with pytest.raises(ValueError):
            IdlePolicy(**kw)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(min_value=0, max_value=1e6, allow_nan=False), min_size=1, max_size=80),
       st.floats(min_value=0.01, max_value=1.0), st.floats(min_value=0.1, max_value=10.0))
def test_adaptive_threshold_always_within_floor_and_ceiling(gaps, q, multiple):
    p = IdlePolicy(mode=ADAPTIVE, quantile=q, multiple=multiple, floor_s=5.0, ceiling_s=600.0, min_samples=1)
    turns(p, "a", gaps)
    assert 5.0 <= p.global_threshold() <= 600.0
    assert 5.0 <= p.threshold("a") <= 600.0
    assert p.threshold("a") >= p.sweep_threshold()


# --- step boundaries -----------------------------------------------------------------------------

def test_every_step_boundary_route_advances_on_success_only():
    t = StepTracker()
    for i, path in enumerate(sorted(STEP_BOUNDARY_ROUTES), start=1):
        assert t.on_boundary(path, 200) is True
        assert t.step == i
    assert t.as_json() == {"step": 5, "boundaries": {p: 1 for p in STEP_BOUNDARY_ROUTES}}
    assert not t.on_boundary("/flush_cache", 400)  # SGLang: not flushed while requests run
    assert not t.on_boundary("/flush_cache", None)  # upstream error: unknown -> not a flush
    assert not t.on_boundary("/flush_cache", 200, method="GET")
    assert not t.on_boundary("/generate", 200)
    assert t.step == 5


def test_opt_outs_do_not_flush():
    assert not flushes_kv("/update_weights_from_disk", 200, {"model_path": "x", "flush_cache": False})
    assert flushes_kv("/update_weights_from_disk", 200, {"model_path": "x"})
    assert not flushes_kv("/update_weights_from_tensor", 200, {"flush_cache": False})
    assert not flushes_kv("/release_memory_occupation", 200, {"tags": ["weights"]})
    assert flushes_kv("/release_memory_occupation", 200, {"tags": ["weights", "kv_cache"]})
    assert flushes_kv("/release_memory_occupation", 200, {})
    assert flushes_kv("/flush_cache", 200, None)


def test_sessions_stay_known_but_have_no_kv_after_a_flush():
    t = StepTracker()
    t.on_kv("a")
    t.on_kv("b")
    assert t.has_kv("a") and t.has_kv("b")
    t.on_boundary("/update_weights_from_distributed", 200)
    assert t.step == 1 and t.kv_step("a") == 0
    assert not t.has_kv("a") and not t.has_kv("b")  # do not close again: that KV no longer exists
    t.on_kv("a")  # a partial rollout continues across the step
    assert t.has_kv("a") and not t.has_kv("b") and t.kv_step("a") == 1
    assert t.has_kv("never-seen")  # unknown: assume it has KV (a client closing a session kvgate did not route)
    t.forget("a")
    assert t.kv_step("a") is None


def test_step_tracker_is_bounded():
    t = StepTracker(max_sessions=10)
    for i in range(100):
        t.on_kv(f"s{i}")
    assert len(t._kv_step) == 10 and t.kv_step("s99") == 0 and t.kv_step("s0") is None


def test_abort_closes_at_once():
    assert ends_session("abort")
    for other in ("stop", "length", None, "tool_calls", ""):
        assert not ends_session(other)


def test_client_aborts_remember_named_rids_only_and_are_bounded():
    from kvgate.sessions.idle_policy import ClientAborts
    ab = ClientAborts(max_rids=2)
    ab.note("r1")
    ab.note(["r2", "r3", 5, None])
    ab.note(None)
    assert not ab.asked("r1") and ab.asked("r2") and ab.asked("r3") and not ab.asked(None) and not ab.asked(5)
