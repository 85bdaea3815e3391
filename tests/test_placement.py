"""Session placement rules (kvgate.fleet.placement): pure, deterministic, no I/O."""

import pytest

from kvgate.fleet.placement import Placement, Target
from kvgate.sessions.inference import prefix_keys

A, B, C = "http://a:1", "http://b:1", "http://c:1"


def fleet(**kw) -> Placement:
    p = Placement(**kw)
    p.set_engines([(A, True), (B, True), (C, True)])
    return p


def test_new_sessions_go_to_most_free_kv_then_fewest_sessions_then_list_order():
    p = fleet()
    p.set_capacity({A: [(10_000, 6_000)], B: [(10_000, 1_000)], C: [(10_000, 1_000)]})
    assert p.place("s1", [], 0.0) == Target(B)        # B and C tie on free KV; B first in the list
    assert p.place("s2", [], 0.0) == Target(C)        # tie on free KV, C has fewer sessions
    call = p.call_started(Target(B), 3_000, 0.0)      # kvgate's own in-flight prompt on B
    assert p.place("s3", [], 0.0) == Target(C)
    p.call_finished(Target(B), call)
    assert p.engine_of("s1") == (B, None) and p.engine_of("nope") is None
    assert p.counts["free_kv"] == 3 and p.placements == {B: 1, C: 2}
    assert (p.sessions_on(A), p.sessions_on(B), p.sessions_on(C)) == (0, 1, 2)


def test_sticky_until_the_engine_leaves_or_turns_unhealthy_then_replaced_and_counted():
    p = fleet()
    t = p.place("s", [], 0.0)
    assert t == Target(A)
    for i in range(5):
        assert p.place("s", [], float(i)) == Target(A)
    assert p.counts["sticky"] == 5
    p.set_engines([(A, False), (B, True), (C, True)])  # the router marks it unhealthy
    assert p.place("s", [], 6.0) == Target(B)
    assert p.counts["replaced"] == 1 and p.sessions_on(A) == 0 and p.sessions_on(B) == 1
    p.set_engines([(A, True), (C, True)])             # B left the router's list
    assert p.place("s", [], 7.0) == Target(A)
    assert p.counts["replaced"] == 2


def test_grpo_siblings_share_the_prefix_engine_below_pressure_else_most_free():
    p = fleet(pressure_threshold=0.8)
    p.set_capacity({A: [(10_000, 0)], B: [(10_000, 0)], C: [(10_000, 0)]})
    p.place("other", [], 0.0)                         # A gets one session: the group goes elsewhere first
    task = list(range(1, 200))                        # 3 full blocks of 64 ids
    keys = prefix_keys(task)
    assert len(keys) == 3
    first = p.place("g0", keys, 0.0)
    assert first == Target(B)
    p.remember_prefix(keys, first)
    for i in range(1, 4):
        assert p.place(f"g{i}", keys, 0.0) == first
    assert p.counts["prefix"] == 3
    # a prompt extending the group's prompt (a later turn of a reopened session) goes there too
    assert p.place("g-cont", prefix_keys(task + list(range(500, 600))), 0.0) == first
    # the group's engine at the pressure threshold: the next sibling goes by free KV
    p.set_capacity({B: [(10_000, 7_000)]})
    p.call_started(first, 1_000, 0.0)
    assert p.place("g-late", keys, 0.0) == Target(C)
    # an unrelated prompt shares no key
    assert prefix_keys(list(range(7, 200)))[0] != keys[0]


def test_dp_engine_pins_one_rank_and_spreads_sessions_over_ranks():
    p = Placement()
    p.set_engines([(A, True)])
    p.set_capacity({A: [(5_000, 0), (5_000, 0)]})
    t1, t2 = p.place("s1", [], 0.0), p.place("s2", [], 0.0)
    assert {t1.dp_rank, t2.dp_rank} == {0, 1} and t1.engine == t2.engine == A
    for _ in range(3):
        assert p.place("s1", [], 1.0) == t1
    assert p.as_json()[A]["sessions_by_rank"] == {"0": 1, "1": 1}


def test_a_rank_is_pinned_once_ranks_become_known():
    p = Placement()
    p.set_engines([(A, True)])
    assert p.place("s", [], 0.0) == Target(A, None)   # no figures yet: one rank assumed
    p.set_capacity({A: [(5_000, 4_000), (5_000, 0)]})
    assert p.place("s", [], 1.0) == Target(A, 1)
    assert p.place("s", [], 2.0) == Target(A, 1)


def test_unreachable_engine_is_skipped_for_a_while_and_none_when_nothing_is_usable():
    p = fleet(unreachable_s=5.0)
    assert p.place("s", [], 0.0) == Target(A)
    p.mark_unreachable(A, 0.0)
    assert p.place("s", [], 0.1, exclude=[A]) == Target(B)
    assert p.place("t", [], 1.0) == Target(C)         # A still out; C has fewer sessions than B
    assert p.place("u", [], 6.0) == Target(A)         # A's time out is over
    p.set_engines([(A, False)])
    assert p.place("v", [], 7.0) is None and p.counts["no_engine"] == 1
    p.set_engines([])
    assert p.place("s", [], 8.0) is None


def test_forget_and_cap():
    p = fleet(max_sessions=2)
    p.place("s1", [], 0.0)
    p.place("s2", [], 1.0)
    p.place("s3", [], 2.0)
    assert p.engine_of("s1") is None and p.counts["dropped"] == 1 and len(p) == 2
    assert p.forget("s2") and not p.forget("s2")
    assert sum(p.sessions_on(u) for u in (A, B, C)) == 1


def test_engine_that_returns_counts_its_sessions_again():
    p = fleet()
    p.place("s1", [], 0.0)
    p.set_engines([(B, True)])
    p.set_engines([(A, True), (B, True)])
    assert p.sessions_on(A) == 1 and p.place("s1", [], 1.0) == Target(A)


from hypothesis import given, settings, strategies as st

OPS = st.lists(st.tuples(st.sampled_from(["place", "place", "place", "forget", "engines", "cap", "unreachable",
                                          "dormant"]),
                         st.integers(0, 7), st.integers(0, 7)), min_size=20, max_size=60)


@settings(max_examples=200, deadline=None)
@given(OPS)
def test_counts_stay_consistent_under_any_sequence(ops):
    """Per-engine session counts always equal the sessions whose engine is listed (a dormant one, ended by
    admission's evidence, not counted until its next call); a placed call always gets
    a usable engine of the current list and its DP rank is within that engine's ranks; no more sessions are
    kept than max_sessions (the runs here place more than that)."""
    urls = [A, B, C]
    p = Placement(max_sessions=5)
    p.set_engines([(u, True) for u in urls])
    now = 0.0
    for op, x, y in ops:
        now += 1.0
        if op == "place":
            t = p.place(f"s{x}", [y], now)
            if t is not None:
                e = p._engines[t.engine]
                assert p._usable(e, now) and (t.dp_rank is None or 0 <= t.dp_rank < e.dp_size)
                p.remember_prefix([y], t)
        elif op == "forget":
            p.forget(f"s{x}")
        elif op == "dormant":
            p.dormant(f"s{x}")
        elif op == "engines":
            p.set_engines([(u, (x >> i) & 1 == 0) for i, u in enumerate(urls) if (y >> i) & 1 == 0])
        elif op == "cap":
            p.set_capacity({urls[x % 3]: [(1000, 100 * y)] * (1 + x % 2)})
        else:
            p.mark_unreachable(urls[x % 3], now)
        listed = {u for u in urls if u in p._engines}
        expect = {u: 0 for u in listed}
        for s in p._sessions.values():
            if s.target.engine in listed and not s.dormant:
                expect[s.target.engine] += 1
        assert {u: p.sessions_on(u) for u in listed} == expect
        assert len(p) <= 5


def test_a_reopened_session_goes_back_to_its_engine_below_pressure_not_where_free_kv_or_a_sibling_points():
    p = fleet(pressure_threshold=0.8, reopen_hint_s=100.0)
    p.set_capacity({A: [(10_000, 0)], B: [(10_000, 0)], C: [(10_000, 0)]})
    turn1 = list(range(1, 200))                       # GRPO siblings share the first turn's prompt exactly
    keys = prefix_keys(turn1)
    assert p.place("g0", keys, 0.0) == Target(A)
    p.remember_prefix(keys, Target(A))
    p.set_capacity({A: [(10_000, 8_500)]})            # A busy: the sibling goes by free KV ...
    assert p.place("g1", keys, 1.0) == Target(B)
    p.remember_prefix(keys, Target(B))                # ... and the shared prompt's key now points at B
    p.set_capacity({A: [(10_000, 1_000)]})
    assert p.forget("g0", 2.0) and p.engine_of("g0") is None and p.sessions_on(A) == 0
    assert p.reopen_hints(2.0) == 1
    # g0 comes back with its own next turn: the prefix index would say B, free KV would say C
    turn2 = prefix_keys(turn1 + list(range(900, 1000)))
    assert p.place("g0", turn2, 50.0) == Target(A)
    assert p.last_reason == "reopened" and p.counts["reopened"] == 1 and p.engine_of("g0") == (A, None)
    assert p.reopen_hints(50.0) == 0                  # the hint is used up: from now on g0 is sticky
    assert p.place("g0", turn2, 51.0) == Target(A) and p.last_reason == "sticky"
    # without the hint the same call would have gone where the sibling's key points
    q = fleet(pressure_threshold=0.8, reopen_hint_s=0.0)
    q.set_capacity({A: [(10_000, 1_000)], B: [(10_000, 0)], C: [(10_000, 0)]})
    q.place("g0", keys, 0.0)
    q.remember_prefix(keys, Target(B))
    q.forget("g0", 2.0)
    assert q.place("g0", turn2, 50.0) == Target(B) and q.last_reason == "prefix" and q.reopen_hints(50.0) == 0


def test_the_reopen_hint_yields_to_pressure_expires_and_is_bounded():
    p = fleet(pressure_threshold=0.8, reopen_hint_s=100.0, max_sessions=3)
    p.set_capacity({A: [(10_000, 0)], B: [(10_000, 0)], C: [(10_000, 0)]})
    for sid in ("s1", "s2", "s3"):
        assert p.place(sid, [], 0.0) == Target({"s1": A, "s2": B, "s3": C}[sid])
    # at or above the threshold (engine usage + kvgate's in-flight prompts): placed by the rules
    p.forget("s1", 1.0)
    p.set_capacity({A: [(10_000, 7_000)]})
    call = p.call_started(Target(A), 1_000, 1.5)
    assert p.place("s1", [], 2.0) == Target(B) and p.last_reason == "free_kv"
    assert p.counts["reopen_elsewhere"] == 1
    p.call_finished(Target(A), call)
    # stale after reopen_hint_s
    p.forget("s2", 10.0)
    assert p.reopen_hints(110.0) == 1 and p.reopen_hints(110.5) == 0
    assert p.place("s2", [], 111.0) != Target(B) or p.last_reason != "reopened"
    # an engine that left: no hint; at most max_sessions hints (the oldest dropped first)
    p.forget("s3", 200.0)
    p.set_engines([(A, True), (B, True)])
    assert p.place("s3", [], 201.0) in (Target(A), Target(B)) and p.last_reason != "reopened"
    assert p.reopen_hints(201.0) == 0
    for i in range(5):
        p.place(f"x{i}", [], 300.0)
        p.forget(f"x{i}", 300.0 + i)
    assert p.reopen_hints(304.0) == 3                 # x2, x3, x4
    assert p.place("x1", [], 305.0) is not None and p.last_reason != "reopened"
    assert p.place("x4", [], 305.0) is not None and p.last_reason == "reopened"


def test_a_reopened_session_on_a_dp_engine_keeps_its_rank():
    p = Placement(reopen_hint_s=60.0)
    p.set_engines([(A, True)])
    p.set_capacity({A: [(5_000, 0), (5_000, 0)]})
    t1, t2 = p.place("s1", [], 0.0), p.place("s2", [], 0.0)
    assert t1.dp_rank != t2.dp_rank
    p.forget("s1", 1.0)
    p.place("s3", [], 1.0)                            # s3 takes s1's now-empty rank by the free-KV rule
    assert p.place("s1", [], 2.0) == t1 and p.last_reason == "reopened"
    assert p.forget("nope", 3.0) is False and p.reopen_hints(3.0) == 0


def test_a_call_counts_until_figures_requested_after_it_arrive_not_on_top_of_them():
    """SGLang's num_used_tokens includes a running call's KV: once figures requested after the call went out
    arrive, its prompt no longer counts on top of them (it would count twice and a busy engine would look
    full while its calls run); a call sent after the request still counts; call_finished balances either way."""
    p = fleet(pressure_threshold=0.85)
    p.set_capacity({A: [(10_000, 0)], B: [(10_000, 0)], C: [(10_000, 0)]}, taken_at=0.0)
    assert p.place("s1", [], 0.0) == Target(A)
    c1 = p.call_started(Target(A), 6_000, 1.0)
    assert p.place("s2", [], 1.0) == Target(B)           # A counts s1's 6,000 in-flight tokens
    c2 = p.call_started(Target(A), 500, 3.0)             # sent after the next scrape was requested (2.0)
    p.set_capacity({A: [(10_000, 6_000)]}, taken_at=2.0)  # the engine now holds s1's prompt
    assert p.as_json()[A]["in_flight_prompt_tokens"] == 500
    assert p._engines[A].rank_usage(0) == (6_000 + 500) / 10_000   # counted once, plus the later call
    p.call_finished(Target(A), c1)                       # already settled: nothing more to take off
    p.call_finished(Target(A), c2)
    assert p._engines[A].in_flight == {0: 0} and p._engines[A].fresh == {}
    # figures with no time (unknown) settle nothing
    c3 = p.call_started(Target(B), 1_000, 4.0)
    p.set_capacity({B: [(10_000, 1_000)]})
    assert p._engines[B].rank_usage(0) == 0.2
    p.call_finished(Target(B), c3)
    assert p._engines[B].rank_usage(0) == 0.1


@given(st.lists(st.tuples(st.sampled_from(["start", "finish", "figures"]), st.integers(0, 5_000),
                          st.floats(0, 100)), max_size=60))
def test_in_flight_never_goes_negative_and_balances(ops):
    p = fleet()
    open_calls, t = [], 0.0
    for op, tokens, dt in ops:
        t += dt
        if op == "start":
            open_calls.append(p.call_started(Target(A), tokens, t))
        elif op == "finish" and open_calls:
            p.call_finished(Target(A), open_calls.pop(tokens % len(open_calls)))
        elif op == "figures":
            p.set_capacity({A: [(10_000, 100)]}, taken_at=t - dt / 2)
        assert all(v >= 0 for v in p._engines[A].in_flight.values())
        assert sum(p._engines[A].in_flight.values()) == sum(c[2] for c in p._engines[A].fresh.values())
    for c in open_calls:
        p.call_finished(Target(A), c)
    assert sum(p._engines[A].in_flight.values()) == 0


def test_when_every_rank_is_at_the_threshold_a_session_stays_where_its_prefix_is():
    """Pressure moves a reopened session only to a rank below the threshold, and a sibling of an indexed prompt
    only to a rank with more projected room after paying the re-prefill of the shared prompt: otherwise moving
    would re-prefill the prefix on an engine as full and gain nothing."""
    p = fleet(pressure_threshold=0.8, reopen_hint_s=100.0)
    p.set_capacity({A: [(10_000, 0)], B: [(10_000, 0)], C: [(10_000, 0)]})
    task = list(range(1, 200))                        # 199 tokens: the shared prompt a sibling re-prefills elsewhere
    keys = prefix_keys(task)
    assert p.place("s1", keys, 0.0, prompt_tokens=199) == Target(A)
    p.remember_prefix(keys, Target(A))
    assert p.forget("s1", 1.0)
    # every engine at or above 0.8; A, the session's own, is the fullest; B and C have less room than A once
    # they pay the 199-token prompt (A: 500 free, the prompt cached; B: 600 - 199 = 401; C: 550 - 199 = 351)
    p.set_capacity({A: [(10_000, 9_500)], B: [(10_000, 9_400)], C: [(10_000, 9_450)]})
    assert p.place("s1", keys, 2.0, prompt_tokens=199) == Target(A) and p.last_reason == "reopened"
    assert p.counts["pressed_stay"] == 1 and p.counts["reopen_elsewhere"] == 0
    # a sibling over the same prompt: the prefix's engine too
    assert p.place("g1", keys, 3.0, prompt_tokens=199) == Target(A) and p.last_reason == "prefix"
    assert p.counts["pressed_stay"] == 2
    # B with 700 free: 501 after paying the prompt, more than A's 500: a sibling gains room by moving there
    p.set_capacity({B: [(10_000, 9_300)]})
    assert p.place("g1b", keys, 3.5, prompt_tokens=199) == Target(B) and p.last_reason == "free_kv"
    assert p.counts["kv_moved"] == 1 and p.counts["pressed_stay"] == 2
    # once one rank has room below the threshold, pressure moves them again
    p.forget("s1", 4.0)
    p.set_capacity({C: [(10_000, 7_000)]})
    assert p.place("s1", keys, 5.0) == Target(C) and p.last_reason == "free_kv"
    assert p.place("g2", keys, 6.0) == Target(C) and p.last_reason == "free_kv"
    assert p.counts["reopen_elsewhere"] == 1 and p.counts["pressed_stay"] == 2


def test_reopen_elsewhere_counts_only_sessions_that_really_moved():
    p = fleet(pressure_threshold=0.8, reopen_hint_s=100.0)
    p.set_capacity({A: [(100_000, 0)], B: [(10_000, 0)], C: [(10_000, 0)]})
    assert p.place("s1", [], 0.0) == Target(A)
    p.forget("s1", 1.0)
    # A is at the threshold and B below it, so the hint yields; but A still has the most free KV (20,000 vs
    # 5,000), so the free-KV rule picks A again: not a move
    p.set_capacity({A: [(100_000, 80_000)], B: [(10_000, 5_000)], C: [(10_000, 9_000)]})
    assert p.place("s1", [], 2.0) == Target(A) and p.last_reason == "free_kv"
    assert p.counts["reopen_elsewhere"] == 0
    # an engine that left: the session moves, counted once
    p.forget("s1", 3.0)
    p.set_engines([(B, True), (C, True)])
    assert p.place("s1", [], 4.0) == Target(B) and p.counts["reopen_elsewhere"] == 1


def test_an_engine_learned_from_the_router_is_the_sessions_engine_and_its_sticky_target():
    """learn(): the engine the router named for a session's call (x-smg-routed-worker-id) becomes the
    session's engine for engine_of() (admission's lookup), follows the router when it moves the session, is
    ignored for an engine kvgate does not know, and is where kvgate places the session if it places it later."""
    from kvgate.fleet.placement import placement_active
    p = fleet()
    p.set_capacity({A: [(10_000, 9_000)], B: [(10_000, 0)], C: [(10_000, 0)]})
    assert p.learn("s", Target(A), 0.0) is True
    assert p.engine_of("s") == (A, None) and p.placed_by("s") == "router" and p.sessions_on(A) == 1
    assert p.learn("s", Target(A), 1.0) is False                      # the same engine again: no change
    assert p.learn("s", Target(C), 2.0) is True and p.engine_of("s") == (C, None)  # the router moved it
    assert (p.sessions_on(A), p.sessions_on(C)) == (0, 1)
    assert p.learn("x", Target("http://unknown:1"), 3.0) is False and p.engine_of("x") is None
    # kvgate places it later (its route switched to kvgate): it stays on the router's engine, where its KV is
    p.set_capacity({A: [(10_000, 0)], B: [(10_000, 0)], C: [(10_000, 8_000)]})
    assert p.place("s", [], 4.0) == Target(C) and p.last_reason == "sticky" and p.placed_by("s") == "kvgate"
    assert p.counts["routed"] == 2 and p.counts["free_kv"] == 0
    # a closed session learned again is no longer a re-open hint
    p.forget("s", 5.0)
    assert p.reopen_hints(5.0) == 1
    p.learn("s", Target(B), 6.0)
    assert p.reopen_hints(6.0) == 0 and p.engine_of("s") == (B, None)
    # auto places with either feature on, whatever the router does with session_id; router never; kvgate always
    assert [placement_active(m, on) for m in ("auto", "kvgate", "router") for on in (True, False)] == [
        True, False, True, True, False, False]


def test_compute_load_breaks_free_kv_ties_and_counts_calls_the_figures_cannot_include():
    """Equal free KV: the engine with fewer running + waiting requests wins (reported, plus kvgate's calls sent
    since the figures were requested); the free-KV rule still comes first."""
    p = fleet()
    p.set_capacity({A: [(10_000, 1_000, 9)], B: [(10_000, 1_000, 2)], C: [(10_000, 1_000, 2)]}, 0.0)
    assert p.place("s1", [], 1.0) == Target(B)        # A is busier; B before C in the list
    call = p.call_started(Target(B), 10, 1.0)         # B: 2 reported + 1 sent since
    assert p.place("s2", [], 1.0) == Target(C)
    p.call_finished(Target(B), call)
    p.set_capacity({A: [(10_000, 0, 30)], B: [(10_000, 5_000, 0)], C: [(10_000, 5_000, 0)]}, 2.0)
    assert p.place("s3", [], 2.0) == Target(A)        # most free KV, however busy
    assert p.as_json()[A]["requests"] == 30


def test_a_prefix_engine_that_is_the_busier_one_takes_no_sibling():
    p = fleet()
    p.set_capacity({A: [(10_000, 0, 0)], B: [(10_000, 0, 0)], C: [(10_000, 0, 0)]}, 0.0)
    keys = prefix_keys(list(range(1, 200)))
    first = p.place("g0", keys, 0.0)
    p.remember_prefix(keys, first)
    p.set_capacity({A: [(10_000, 0, 3)], B: [(10_000, 0, 3)], C: [(10_000, 0, 3)]}, 1.0)
    assert p.place("g1", keys, 1.0) == first           # as busy as the others: the prefix wins
    p.set_capacity({A: [(10_000, 0, 7)], B: [(10_000, 0, 3)], C: [(10_000, 0, 3)]}, 2.0)
    assert p.place("g2", keys, 2.0) == first           # 4 more than the least busy: within the default margin
    p.set_capacity({A: [(10_000, 0, 8)], B: [(10_000, 0, 3)], C: [(10_000, 0, 3)]}, 3.0)
    assert p.place("g3", keys, 3.0) == Target(B) and p.counts["busier_moved"] == 1


def test_the_busier_margin_lets_a_prefix_engine_take_siblings_up_to_that_many_more_requests():
    """busier_margin N: the prefix's engine keeps its siblings while it runs + queues at most N more requests
    than the least busy other engine; None: load never moves them (only KV pressure does)."""
    keys = prefix_keys(list(range(1, 200)))
    for margin, moved_at in ((0, 1), (2, 3), (5, 6), (None, None)):
        p = Placement(busier_margin=margin)
        p.set_engines([(A, True), (B, True)])
        p.set_capacity({A: [(10_000, 0, 0)], B: [(10_000, 0, 0)]}, 0.0)
        first = p.place("g0", keys, 0.0)
        p.remember_prefix(keys, first)
        other = B if first.engine == A else A
        got = []
        for extra in range(0, 8):
            p.set_capacity({first.engine: [(10_000, 0, extra)], other: [(10_000, 0, 0)]}, 1.0 + extra)
            got.append(p.place(f"probe{extra}", keys, 1.0 + extra).engine)
            p.forget(f"probe{extra}")
        want = [first.engine if moved_at is None or extra < moved_at else other for extra in range(0, 8)]
        assert got == want, (margin, got)
        assert p.counts["busier_moved"] == (0 if moved_at is None else 8 - moved_at)
    with pytest.raises(ValueError):
        Placement(busier_margin=-1)


def test_a_call_that_ended_after_the_figures_counted_it_no_longer_makes_its_engine_busier():
    """Turns sent one after the other: the engine's figures, requested while the first sibling's call ran, say
    one request running there. Once that call ends it runs there no more, so the next sibling follows the shared
    prompt to that engine (its radix cache) instead of being moved off a "busier" engine that is idle; so too
    when those figures arrive only after the call ended. Before, the stale figure held until the next poll."""
    task = list(range(1, 257))
    for figures_arrive_late in (False, True):
        p = Placement(busier_margin=0)  # one request more makes an engine the busier one
        p.set_engines([(A, True), (B, True)])
        p.set_capacity({A: [(200_000, 0, 0)], B: [(200_000, 0, 0)]}, 0.0)
        keys = prefix_keys(task)
        t = p.place("a", keys, 1.0)
        p.remember_prefix(keys, t)
        h = p.call_started(t, 256, 1.0)
        other = B if t.engine == A else A
        running = {t.engine: [(200_000, 256, 1)], other: [(200_000, 0, 0)]}  # requested at 2.0, a's call running
        if figures_arrive_late:
            p.call_finished(t, h, 3.0)
            p.set_capacity(running, 2.0)
        else:
            p.set_capacity(running, 2.0)
            assert p.place("probe", keys, 2.5).engine == other  # a's engine is the busier one now
            p.forget("probe")
            p.call_finished(t, h, 3.0)
        assert p.as_json()[t.engine]["requests"] == 0
        assert p.place("b", keys, 3.5).engine == t.engine
