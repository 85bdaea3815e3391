"""The pause gate's foresight (kvgate.admission.pause_gate): pausing starts when an engine's working set outgrows
its ceiling and prefilling a whole ceiling takes ``foresee_cycles`` program cycles, before the evictions that the
measured re-prefill ratio would wait for."""

import math

import pytest
from hypothesis import given, settings, strategies as st

from kvgate.admission.capacity import ClusterSnapshot, EngineCapacity
from kvgate.admission.coordinator import Kind
from kvgate.admission.ledger import Ledger
from kvgate.admission.pause_gate import Cycle, PauseGate
from kvgate.admission.program import ProgramCoordinator, ProgramState
from program_helpers import programs as _programs, teach_prefill_rate

E0, E1 = "http://e0", "http://e1"


def test_foresight_opens_at_its_ratio_and_holds_the_gate_open_a_window():
    g = PauseGate(1.5, 0.2, window_s=10.0, min_span_s=1.0, foresee_cycles=4.0)
    g.started(0.0)
    assert g.foresee(1.0, 3.9) is False and g.opened == 0 and g.foresight_first == 3.9
    assert g.foresee(2.0, 4.0) is True and g.opened == 1 and g.foreseen == 1
    # no re-prefill measured (ratio 0 < stop): open for a window after the last foresight at or over 4
    assert g.update(5.0, 1) is True
    assert g.foresee(6.0, 5.0) is True and g.opened == 1  # already open: counted once
    assert g.update(15.9, 1) is True
    assert g.update(16.0, 1) is False and g.closed == 1
    assert g.foresight_peak == 5.0 and g.stats(16.0, 1)["foreseen"] == 1


def test_foresight_off_or_gate_off_never_changes_the_gate():
    g = PauseGate(1.5, 0.2, window_s=10.0, min_span_s=1.0)  # foresee_cycles 0: off
    assert g.foresee(1.0, 1e9) is False and g.opened == 0 and g.foresight_peak == 1e9
    always = PauseGate(0.0, foresee_cycles=3.0)  # the gate off: always open, nothing counted
    assert always.foresee(1.0, 10.0) is True and always.update(2.0, 1) is True
    for bad in (-1.0, math.inf, math.nan, "2"):
        with pytest.raises(ValueError, match="foresee_cycles"):
            PauseGate(1.5, foresee_cycles=bad)


def test_cycle_is_the_weighted_mean_turn_plus_tool_call():
    c = Cycle()
    assert c.seconds() is None
    c.turn(2.0)
    assert c.seconds() is None  # no tool call seen yet
    c.gap(1.0)
    assert c.seconds() == pytest.approx(3.0)
    c.turn(4.0)
    assert c.seconds() == pytest.approx(2.0 + 0.05 * 2.0 + 1.0)
    c.gap(-1.0)  # a negative gap is no evidence
    assert c.seconds() == pytest.approx(3.1)


def _fleet(cap, engines, foresee, start=1.5, decode=(), stop=0.2):
    lg = Ledger(headroom=1.0, pressure_threshold=0.99, stale_after_s=1e9, lease_ttl_s=1e9)
    co = ProgramCoordinator(lg, max_wait_s=30.0, program_ttl_s=600.0, overdue_default_s=100.0,
                            reclaim_after_s=None, pause_start_ratio=start, pause_stop_ratio=stop,
                            pause_window_s=20.0, pause_min_span_s=2.0, pause_foresee_cycles=foresee)
    co.reconcile(ClusterSnapshot.build({e: EngineCapacity.from_pools([(cap, 0, 0.0)]) for e in engines}, 0.0,
                                       list(decode)), 0.0)
    return co


def test_a_pool_outgrown_on_a_slow_engine_pauses_before_any_reprefill_is_measured():
    """Two-turn programs on one 2,000-token engine prefilling 0.01 s a token (a ceiling takes 20 s against the
    ~14 s cycle of these one-at-a-time turns): the working set outgrows the pool, the gate opens on foresight
    alone (no miss answered yet) and an in-tool program pauses to make room."""
    co = _fleet(2000, (E0,), foresee=1.0)
    t = teach_prefill_rate(co, 0.0, E0, 0.01, [100 + 20 * i for i in range(10)], reserve=50, prompt_tokens=40,
                           completion_tokens=5)
    for i in range(3):  # answers timed as the engine's rate says
        assert co.submit(f"a{i}", 600, False, t, place=E0, session_id=f"s{i}", prompt_tokens=580).kind is Kind.ADMIT
        t += 0.05 + 0.01 * 580
        co.release(f"a{i}", t, {"prompt_tokens": 580, "cached_tokens": 0, "completion_tokens": 20})
    t += 1.5
    for i in range(2):  # the second turn: each found its KV (no re-prefill), and the cycle is learned
        assert co.submit(f"b{i}", 700, False, t, place=E0, session_id=f"s{i}", prompt_tokens=680).kind is Kind.ADMIT
        t += 0.05 + 0.01 * 80
        co.release(f"b{i}", t, {"prompt_tokens": 680, "cached_tokens": 600, "completion_tokens": 20})
    assert co.ledger.reserved_on(E0) <= 2000
    assert co.gate.reprefill_tokens == 0 and not co.gate.is_open and co.gate.foresight is None
    assert co.counters["pause"] == 0
    d = co.submit("b2", 700, False, t, place=E0, session_id="s2", prompt_tokens=680)
    assert d.kind is Kind.ADMIT  # a continuing turn: never held; with it the working set is 2,100 tokens
    cycle = co.gate.cycle.seconds()
    assert co.gate.foresight == pytest.approx(2000 * co.prefill.per_token_s(E0) / cycle) and co.gate.foresight >= 1
    assert co.gate.foreseen == 1 and co.gate.is_open and co.gate.reprefill_tokens == 0
    assert co.counters["pause"] == 1 and co.ledger.reserved_on(E0) <= 2000  # an in-tool program made room


def test_a_rate_fitted_over_calls_of_one_size_does_not_open_the_gate_on_an_engine_that_keeps_up():
    """Two engines of 18,000 tokens that prefill ~3,000-token prompts in 0.6-1.2 s (a ceiling in ~5 s, about one
    ~4 s program cycle): agents grow past the ceiling of one. The prefill rate is learned from calls of nearly one
    size, where the least-squares slope is the timing noise's (it read 100-230 cycles, and the gate opened and
    held turns while both engines idled). Bounded by what the calls allow, foresight reads about 1 and the gate
    stays closed."""
    import random
    rng = random.Random(8)
    co = _fleet(18000, (E0, E1), foresee=20.0)
    t = 0.0
    for k in range(12):  # one-turn jobs of ~3,000 tokens on each engine, timed with noise
        for e in (E0, E1):
            d = co.submit(f"j{e}{k}", 3300, False, t, place=e, session_id=None, prompt_tokens=3000)
            assert d.kind is Kind.ADMIT
            y = 0.9 + rng.uniform(-0.3, 0.3)
            co.release(f"j{e}{k}", t + y, {"prompt_tokens": 3000 + rng.randint(-5, 5), "cached_tokens": 0,
                                            "completion_tokens": 200})
            t += y
    assert co.prefill.per_token_s(E0) <= 1.2 / 2995
    for turn in range(4):  # eight agents on E0, each turn ~1 s, tool calls ~3 s, contexts growing 1,500 a turn
        for i in range(8):
            size = 3000 + 1500 * turn
            d = co.submit(f"a{i}t{turn}", size + 200, False, t, place=E0, session_id=f"a{i}", prompt_tokens=size)
            co.release(f"a{i}t{turn}", t + 1.0, {"prompt_tokens": size, "cached_tokens": size - 1500,
                                                  "completion_tokens": 200})
            co.take_actions()
        t += 4.0
    assert co.gate.foresight_peak is not None and co.gate.foresight_peak < 3
    assert not co.gate.is_open and co.gate.foreseen == 0 and co.counters["pause"] == 0


_OPS = st.lists(st.tuples(st.sampled_from(["turn", "end", "tick", "close"]), st.integers(0, 9),
                          st.integers(50, 1500), st.floats(0.0, 2.0)), min_size=1, max_size=80)


def _drive(co, ops, places, on_call=None):
    """Random turns, answers (part of what a program held re-prefilled), ticks and closes; returns every
    decision, action and counter, in order."""
    t, inflight, n, log = 0.0, {}, 0, []
    for place in places:
        t = teach_prefill_rate(co, t, place, 0.002, [100 + 40 * i for i in range(10)], reserve=50, prompt_tokens=40,
                               completion_tokens=5, prefix=f"r{place}")
    for op, i, size, dt in ops:
        t += dt
        sid = f"s{i}"
        if op == "turn" and sid not in inflight:
            n += 1
            d = co.submit(f"t{n}", size, False, t, place=places[i % len(places)], session_id=sid,
                          prompt_tokens=size - 10)
            log.append((d.ticket, d.kind))
            inflight[sid] = f"t{n}"
        elif op == "end" and sid in inflight:
            tk = inflight.pop(sid)
            if co.is_waiting(tk):
                co.cancel(tk, t)
            log += [(d.ticket, d.kind) for d in co.release(tk, t, {"prompt_tokens": size, "completion_tokens": 10,
                                                                    "cached_tokens": size // 3})]
        elif op == "close" and sid not in inflight:
            co.forget(sid, t)
        else:
            log += [(d.ticket, d.kind) for d in co.pump(t)]
        log += [(a.kind, a.session_id) for a in co.take_actions()]
        if on_call is not None:
            on_call(co, t)
    return log + sorted(co.counters.items())


@settings(max_examples=120, deadline=None)
@given(ops=_programs(), cap=st.integers(800, 2500), engines=st.integers(1, 2),
       foresee=st.floats(0.05, 2.0))
def test_foresight_opens_only_where_a_regular_pool_is_outgrown_at_its_ratio(ops, cap, engines, foresee):
    """Over random fleets, programs and event orders: foresight reads only while some regular engine's working
    set is over its ceiling, or, with the gate open, turns wait on one, the
    figure it reads is ceiling x learned seconds a token / learned cycle on one of them, and it opens the gate
    only at foresee_cycles or more (read as it happens: the pauses that follow in the same call bring the pool
    back within its ceiling); with foresight off the policy decides exactly as with it unreachable."""
    places = [f"http://e{i}" for i in range(engines)]
    co = _fleet(cap, places, foresee)
    gate, read = co.gate, PauseGate.foresee

    def foresee_checked(now, reading):
        over = [p for p in places if co.ledger.reserved_on(p) > co.ledger.ceiling_of(p)]
        if gate.is_open:
            over += [w.place for w in co._queue.values()]
        assert over, "foresight read with no pool outgrown and no turn waiting"
        assert any(reading == pytest.approx(co.ledger.ceiling_of(p) * co.prefill.per_token_s(p)
                                            / gate.cycle.seconds()) for p in over
                   if co.prefill.per_token_s(p) is not None)  # a place whose rate is not told reads none
        before = gate.foreseen
        out = read(gate, now, reading)
        assert gate.foreseen == before or reading >= foresee
        return out

    gate.foresee = foresee_checked
    _drive(co, ops, places)
    assert _drive(_fleet(cap, places, 0.0), ops, places) == _drive(_fleet(cap, places, 1e300), ops, places)


@settings(max_examples=80, deadline=None)
@given(ops=st.one_of(_OPS, _programs()), engines=st.integers(1, 3))
def test_a_fleet_of_decode_workers_never_foresees(ops, engines):
    """A decode worker's outgrown pool comes back by KV transfer, not a re-prefill a pause could save: a fleet of
    decode workers alone never reads a foresight, so the gate never opens on it."""
    places = [f"http://e{i}" for i in range(engines)]
    co = _fleet(1000, places, 0.5, decode=places)
    _drive(co, ops, places)
    assert co.gate.foresight is None and co.gate.foreseen == 0


@settings(max_examples=100, deadline=None)
@given(ops=_programs(), cap=st.integers(1000, 4000), engines=st.integers(1, 3), foresee=st.floats(0.05, 2.0),
       start=st.sampled_from([0.02, 0.1, 1.5]))
def test_the_gate_follows_the_evidence_on_polls_with_no_program_left(ops, cap, engines, foresee, start):
    """Over random fleets, programs and event orders, then every program ended and the capacity polls going on
    with no traffic: once the window holds no re-prefill and no foresight reading, the gate is closed at the
    next poll, and says the ratio closed it (the stats and the pausing gauge read it between rollout steps)."""
    places = [f"http://e{i}" for i in range(engines)]
    co = _fleet(cap, places, foresee, start=start, stop=start / 2)
    last = [0.0]
    _drive(co, ops, places, lambda c, now: last.__setitem__(0, now))
    t = last[0]  # the step ends at once: the calls in flight answer, every program closes
    for tk in list(co._ticket_sid):  # every call ends, every program closes
        if co.is_waiting(tk):
            co.cancel(tk, t)
        co.release(tk, t, {"prompt_tokens": 100, "completion_tokens": 10, "cached_tokens": 100})
    for sid in list(co._programs):
        co.forget(sid, t)
    co.take_actions()
    assert co.state_of("s0") is None
    snapshot = ClusterSnapshot.build({e: EngineCapacity.from_pools([(cap, 0, 0.0)]) for e in places}, t)
    for k in range(1, 2 * int(co.gate.window_s) + 2):  # a poll a second, past a window with nothing in it
        co.reconcile(snapshot, t + k)
    assert not co.gate.is_open
    if co.gate.opened:
        by, ratio = co.gate.turned_by
        assert co.gate.closed == co.gate.opened and by == "ratio" and ratio < co.gate.stop_ratio


@settings(max_examples=200, deadline=None)
@given(ops=_programs(), cap=st.integers(800, 4000), engines=st.integers(1, 2),
       start=st.sampled_from([0.0, 1.5, 1e9]))
def test_an_ended_program_holds_no_reservation_and_wakes_no_timer_with_the_gate_open_or_closed(ops, cap, engines,
                                                                                              start):
    """Over random fleets, programs and event orders, the gate always open (start ratio 0), opening on the
    evidence (1.5) or never (1e9): after each pump, no program idle past what its gaps predict (ended) holds a
    reservation, nothing is due at the pump's own time, and once the fleet's gaps are known no program in a tool
    call still ends at the default's time where the gaps predict sooner. With the gate closed an ended program used to keep its
    reservation until its TTL (counted in the working set, foresight's reading and /kvgate/stats), and its due
    time, never taken, made next_deadline answer 'now' at every call: the admission timer woke every millisecond."""
    places = [f"http://e{i}" for i in range(engines)]
    co = _fleet(cap, places, 0.0, start=start, stop=min(0.2, start))
    seen = {"ended": 0, "default": 0}

    def check(c, now):
        c.pump(now)
        c.take_actions()
        nd = c.next_deadline(now)
        assert nd is None or nd > now, (nd, now, c.gate.is_open)
        gaps = c._gaps
        for p in c._programs.values():
            if p.state is ProgramState.IN_TOOL and p.overdue_at <= now:
                seen["ended"] += 1
                assert c.ledger.holding(p.sid) == 0, (p.sid, c.gate.is_open)
            if (p.state is ProgramState.IN_TOOL and p.last_end is not None and gaps._fleet_bound is not None
                    and p.overdue_at == p.last_end + min(gaps.default_s, gaps.ttl_s)):
                seen["default"] += 1  # its end still the default's, once the fleet's gaps tell a sooner one
                assert gaps.overdue_after(p) >= min(gaps.default_s, gaps.ttl_s), p.sid
    _drive(co, ops, places, check)


def test_jobs_that_ended_before_the_fleets_first_gaps_end_by_those_gaps_not_by_the_default():
    """Five one-turn jobs (sessions that never come back) end their turns before any gap between turns is known:
    their end is set at the default (100 s here). An agent's turns then give the fleet its first gaps (1 s, so
    programs end after 3 x 1 s): the jobs end by that bound too, as jobs finishing a second later would, and no
    longer hold their reservations for the default's 100 s."""
    co = _fleet(20_000, (E0,), 0.0, start=1e9)  # the gate never opens: lifecycle alone, reservations only
    for j in range(5):
        assert co.submit(f"j{j}", 500, False, 0.0, place=E0, session_id=f"job{j}", prompt_tokens=400).kind is Kind.ADMIT
        co.release(f"j{j}", 0.5, {"prompt_tokens": 400, "cached_tokens": 0, "completion_tokens": 50})
    assert all(co._programs[f"job{j}"].overdue_at == 100.5 for j in range(5))
    t = 0.5
    for turn in range(5):  # the agent: a turn of 0.5 s, then a 1 s tool call
        assert co.submit(f"a{turn}", 600, False, t, place=E0, session_id="agent", prompt_tokens=500).kind is Kind.ADMIT
        co.release(f"a{turn}", t + 0.5, {"prompt_tokens": 500, "cached_tokens": 400, "completion_tokens": 50})
        t += 1.5
    co.pump(t)
    assert all(co._programs[f"job{j}"].overdue_at == 0.5 + 3.0 for j in range(5))
    assert [co.ledger.holding(f"job{j}") for j in range(5)] == [0] * 5
    assert [a.kind for a in co.take_actions()] == ["ended"] * 5 and not co.gate.is_open


@settings(max_examples=200, deadline=None)
@given(ops=_programs(), cap=st.integers(800, 2500), engines=st.integers(1, 2), foresee=st.floats(0.05, 2.0),
       start=st.sampled_from([0.02, 0.1, 1.5]))
def test_the_gate_does_not_close_while_turns_wait_on_a_pool_foresight_says_pausing_pays(ops, cap, engines, foresee,
                                                                                      start):
    """Over random fleets, programs and event orders: whenever the gate is open and a turn waits for room on a
    pool where prefilling a ceiling takes foresee_cycles program cycles or more, the gate stays open. The re-
    prefill ratio is low then because the turns are held; closing on it sent every held turn at once, and the
    thrash that followed opened the gate again (many-programs: opened twice, closed once, 1.5-1.7M tokens
    re-prefilled against ~1.0M)."""
    places = [f"http://e{i}" for i in range(engines)]
    co = _fleet(cap, places, foresee, start=start, stop=start / 2)
    gate, real = co.gate, co.gate.update

    def reading(place):
        place = co.ledger.resolve_place(place)
        rate, cycle = co.prefill.per_token_s(place), gate.cycle.seconds()
        return None if rate is None or cycle is None or place is None else \
            co.ledger.ceiling_of(place) * rate / cycle

    def update_checked(now, n):
        waiting_on = {w.place for w in co._queue.values()} if gate.is_open else set()
        pays = any((r := reading(p)) is not None and r >= foresee for p in waiting_on)
        out = real(now, n)
        if pays:
            assert out, "the gate closed while a turn waited on a pool where pausing pays"
        return out

    gate.update = update_checked
    _drive(co, ops, places)
