"""The program policy's rules, one test each, with a hand-driven clock (no I/O): continuing turns never
wait, new programs start only with room, overflow pauses in-tool programs (victim rules), paused programs
resume as room frees (resume orders), aging, fail-open, cached_tokens corrections, per-engine places."""

import orjson
import pytest

from kvgate.admission.capacity import ClusterSnapshot, EngineCapacity
from kvgate.admission.coordinator import Kind
from kvgate.admission.ledger import Ledger
from kvgate.admission.program import Action, ProgramCoordinator, ProgramState
from kvgate.admission.reservation import estimate_request

E0, E1 = "http://e0", "http://e1"


def snap(now, engines, usage=0.0):
    return ClusterSnapshot.build({u: EngineCapacity.from_pools([(c, int(c * usage), usage)])
                                  for u, c in engines.items()}, now)


def make(engines=None, **kw):
    lg = Ledger(headroom=0.9, pressure_threshold=0.92, stale_after_s=kw.pop("stale_after_s", 1e6), lease_ttl_s=1e6)
    kw.setdefault("reclaim_after_s", None)  # the rules below one at a time; reclaiming has tests of its own
    co = ProgramCoordinator(lg, max_wait_s=kw.pop("max_wait_s", 30.0), **kw)
    co.reconcile(snap(0.0, engines or {E0: 10_000}), 0.0)
    return co, lg


class Prog:
    """One agent program: its context grows by each turn's output and tool result (token ids)."""

    def __init__(self, co, sid, prompt, place=E0, max_new=500, seed=0):
        self.co, self.sid, self.place, self.max_new = co, sid, place, max_new
        self.ids = [seed * 100_000 + i for i in range(prompt)]
        self.n = 0

    def submit(self, now, protected=False):
        self.n += 1
        self.ticket = f"{self.sid}-{self.n}"
        r = estimate_request("/generate", {"input_ids": self.ids, "sampling_params": {"max_new_tokens": self.max_new}},
                             expected_decode_cap=4096)
        return self.co.submit(self.ticket, r.tokens, protected, now, place=self.place, blocks=r.blocks,
                              session_id=self.sid, prompt_tokens=r.prompt_tokens)

    def answer(self, now, output=400, tool=300, cached=None):
        meta = {"prompt_tokens": len(self.ids), "completion_tokens": output,
                "cached_tokens": cached if cached is not None else 0}
        out = self.co.release(self.ticket, now, meta)
        base = len(self.ids) + 10 ** 7 * (self.n + 1)
        self.ids = self.ids + list(range(base, base + output + tool))
        return out


def test_continuing_turn_never_waits_and_reserves_its_increment():
    co, lg = make()  # ceiling 9,000
    a = Prog(co, "a", 2000)
    assert a.submit(0.0).kind is Kind.ADMIT and lg.reserved == 2500
    a.answer(1.0)
    assert co.state_of("a") is ProgramState.IN_TOOL and lg.reserved == 2400  # resident: prompt + output
    d = a.submit(2.0)  # 2,700 prompt (2,400 resident + 300 tool result) + 500 budget
    assert d.kind is Kind.ADMIT and lg.reserved == 3200  # the increment: 300 extend + 500 decode
    assert co.state_of("a") is ProgramState.LIVE
    a.answer(3.0)
    co.forget("a", 4.0)
    assert lg.reserved == 0 and co.state_of("a") is None


def test_new_program_starts_only_when_its_engine_has_room():
    co, lg = make()
    a, b = Prog(co, "a", 5000, seed=1), Prog(co, "b", 4000, seed=2)
    assert a.submit(0.0).kind is Kind.ADMIT  # 5,500
    w = b.submit(1.0)  # 4,500: 10,000 > 9,000
    assert w.kind is Kind.WAIT and w.reason == "capacity_exhausted"
    out = a.answer(2.0)  # resident 5,400: still no room for 4,500
    assert out == [] and co.waiting == 1
    co.forget("a", 3.0)  # the program ended
    out = co.pump(3.0)
    assert [(d.ticket, d.kind, d.waited_s) for d in out] == [("b-1", Kind.ADMIT, 2.0)]


def _three_in_tool(victim="smallest", resume="smallest", **kw):
    co, lg = make(victim=victim, resume=resume, **kw)  # ceiling 9,000
    progs = [Prog(co, "small", 1000, seed=1), Prog(co, "mid", 2000, seed=2), Prog(co, "big", 3000, seed=3)]
    for i, p in enumerate(progs):
        assert p.submit(float(i)).kind is Kind.ADMIT
    for i, p in enumerate(reversed(progs)):  # big answers first: it has been in its tool call longest
        p.answer(10.0 + i, output=100, tool=0)
    # residents 1,100 + 2,100 + 3,100 = 6,300; all three in a tool call
    assert lg.reserved == 6300
    return co, lg, progs


@pytest.mark.parametrize("victim,paused", [("smallest", ["small"]), ("largest", ["big"]),
                                           ("longest-idle", ["big"])])
def test_overflow_pauses_in_tool_programs_by_the_victim_rule(victim, paused):
    co, lg, progs = _three_in_tool(victim)
    hog = Prog(co, "hog", 5000, seed=9, max_new=10)
    # a continuing turn is never held, so a live program growing big is what overflows: make hog live first
    co.forget("hog", 0.0)
    assert hog.submit(20.0).kind is Kind.WAIT  # a new program: 5,010 does not fit in 2,700 free
    co.forget("hog", 20.0)
    # the mid program's next turn grows it by 3,000 tool tokens: 6,300 - 2,100 + 5,600 = 9,800 > 9,000
    mid = progs[1]
    mid.ids += list(range(10 ** 8, 10 ** 8 + 3000))
    d = mid.submit(21.0)
    assert d.kind is Kind.ADMIT
    # 1,100 + 3,100 + (5,100 + 500) = 9,800 > 9,000: one victim is enough
    acts = co.take_actions()
    assert [a.session_id for a in acts] == paused and all(a.kind == "close" for a in acts)
    assert all(co.state_of(s) is ProgramState.PAUSED for s in paused)
    assert lg.reserved <= lg.ceiling
    assert sum(co.pauses.values()) == len(paused) and co.pauses == {E0: len(paused)}
    # the waiting hog was not admitted ahead of the paused programs' turns
    assert co.waiting == 1


def test_paused_program_waits_and_resumes_when_room_frees():
    co, lg, (small, mid, big) = _three_in_tool("largest")
    mid.ids += list(range(10 ** 8, 10 ** 8 + 3000))
    mid.submit(21.0)  # pauses big (see above)
    assert co.state_of("big") is ProgramState.PAUSED
    w = big.submit(22.0)  # its next turn waits in kvgate: its whole context (3,100) + 500 must fit again
    assert w.kind is Kind.WAIT
    assert mid.answer(23.0, output=100, tool=0) == []  # 1,100 + 5,200 resident: 2,700 free < 3,600
    co.forget("mid", 24.0)  # mid's program ends
    out = co.pump(24.0)
    assert [(d.ticket, d.kind) for d in out] == [("big-2", Kind.ADMIT)]
    assert co.state_of("big") is ProgramState.LIVE and co.resumes == {E0: 1}
    assert out[0].waited_s == 2.0


def test_a_program_paused_by_another_replica_resumes_here_by_the_resume_rules():
    co, lg = make({E0: 10_000})  # ceiling 9,000
    hog = Prog(co, "hog", 7000, max_new=500, seed=1)
    assert hog.submit(0.0).kind is Kind.ADMIT  # 7,500 reserved
    new = Prog(co, "new", 1000, max_new=500, seed=2)
    assert new.submit(1.0).kind is Kind.ADMIT  # fits: 9,000
    assert co.adopt_paused("away", E0, 2500, 2.0) is True
    assert co.adopt_paused("away", E0, 2500, 2.0) is False  # known here now
    assert co.adopt_paused("hog", E0, 10, 2.0) is False
    assert co.state_of("away") is ProgramState.PAUSED and co.resident_of("away") == 2500
    away = Prog(co, "away", 2000, max_new=500, seed=3)
    assert away.submit(3.0).kind is Kind.WAIT  # its whole context must fit again
    late = Prog(co, "late", 500, max_new=500, seed=4)
    assert late.submit(4.0).kind is Kind.WAIT  # a new program waits behind the paused one
    assert co.stats(4.0)["waiting_resume"] == 1
    hog.answer(5.0)
    co.forget("hog", 5.0)
    out = co.pump(5.0)
    assert [(d.ticket, d.kind) for d in out] == [("away-1", Kind.ADMIT), ("late-1", Kind.ADMIT)]
    assert co.resumes == {E0: 1} and co.state_of("away") is ProgramState.LIVE


def test_a_resume_that_fits_goes_though_a_larger_one_waits_ahead_of_it_in_either_order():
    """Work-conserving in both resume orders: small (1,600) fits in the 2,400 free while big (3,600) waits
    ahead of it, so small goes at once instead of waiting behind big."""
    for order in ("smallest", "fifo"):
        co, lg, (small, mid, big) = _three_in_tool(resume=order)
        mid.ids += list(range(10 ** 8, 10 ** 8 + 4000))
        mid.submit(21.0)  # 1,100 + 3,100 + 6,600 = 10,800: small is not enough, big goes too
        assert [a.session_id for a in co.take_actions()] == ["small", "big"]
        assert big.submit(22.0).kind is Kind.WAIT  # big asks to resume first, then small
        assert small.submit(22.5).kind is Kind.ADMIT  # 1,600 fits in 2,400 free: it does not wait behind big
        assert mid.answer(23.0, output=100, tool=0) == []  # 6,200 resident + small's 1,600: big does not fit
        co.forget("mid", 23.0)
        assert [d.ticket for d in co.pump(23.0)] == ["big-2"]


def test_running_programs_are_marked_and_pause_at_the_end_of_their_turn():
    co, lg = make()
    a, b = Prog(co, "a", 4000, seed=1), Prog(co, "b", 4000, seed=2)
    assert a.submit(0.0).kind is Kind.ADMIT and b.submit(0.0).kind is Kind.ADMIT  # 9,000: full, both live
    a.answer(1.0, output=500, tool=1000)  # resident 4,500
    d = a.submit(2.0)  # 5,500 + 500: working set 6,000 + 4,500 > 9,000, nothing in a tool call
    assert d.kind is Kind.ADMIT and co.take_actions() == []  # nobody interrupted
    assert co.counters["marked"] == 1
    b.answer(3.0)  # b was marked: it pauses at the end of its turn instead of entering its tool call
    assert co.state_of("b") is ProgramState.PAUSED
    assert co.take_actions() == [Action("close", "b", E0)]
    assert lg.reserved == 6000


def test_aging_bounds_every_wait_and_the_aged_turn_reserves():
    co, lg = make(max_wait_s=5.0)
    a, b = Prog(co, "a", 8000, seed=1), Prog(co, "b", 4000, seed=2)
    a.submit(0.0)
    assert b.submit(1.0).kind is Kind.WAIT
    assert co.next_deadline(1.0) == 6.0
    assert co.pump(5.9) == []
    out = co.pump(6.0)
    assert [(d.ticket, d.kind) for d in out] == [("b-1", Kind.BYPASS_AGED)] and out[0].lease is not None
    assert lg.reserved == 8500 + 4500


def test_fail_open_degraded_bypasses_and_pauses_nothing():
    co, lg = make(stale_after_s=6.0)
    a, b = Prog(co, "a", 8000, seed=1), Prog(co, "b", 4000, seed=2)
    a.submit(0.0)
    assert b.submit(1.0).kind is Kind.WAIT
    out = co.pump(6.0)  # the snapshot from t=0 is stale now
    assert [(d.ticket, d.kind) for d in out] == [("b-1", Kind.BYPASS_DEGRADED)] and out[0].lease is None
    c = Prog(co, "c", 9000, seed=3)
    assert c.submit(7.0).kind is Kind.BYPASS_DEGRADED and co.take_actions() == []


def test_protected_turn_bypasses_and_reserves():
    co, lg = make()
    a, p = Prog(co, "a", 6000, seed=1, max_new=600), Prog(co, "p", 6000, seed=2, max_new=600)
    assert p.submit(0.0, protected=True).kind is Kind.BYPASS_PROTECTED and lg.reserved == 6600
    assert a.submit(1.0).kind is Kind.WAIT


def test_engine_reported_figures_correct_the_working_set():
    co, lg = make()
    # a text prompt: kvgate estimates 3 chars/token, the engine reports its own count
    body = {"text": "x" * 3000, "sampling_params": {"max_new_tokens": 100}}
    r = estimate_request("/generate", body, expected_decode_cap=4096)
    assert r.prompt_tokens == 1000
    co.submit("t1", r.tokens, False, 0.0, session_id="s", prompt_tokens=r.prompt_tokens)
    co.release("t1", 1.0, {"prompt_tokens": 750, "completion_tokens": 50, "cached_tokens": 0})
    assert co.resident_of("s") == 800 and lg.reserved == 800
    body["text"] += "y" * 600  # next turn: 3,600 chars = 1,200 estimated tokens -> 900 after the 0.75 correction
    r = estimate_request("/generate", body, expected_decode_cap=4096)
    d = co.submit("t2", r.tokens, False, 2.0, session_id="s", prompt_tokens=r.prompt_tokens)
    assert d.tokens == 900 + 100
    # the engine served only 200 of the 800 resident tokens from cache: 600 were evicted during the tool call
    co.release("t2", 3.0, {"prompt_tokens": 900, "completion_tokens": 50, "cached_tokens": 200})
    assert co.counters["prefix_miss_tokens"] == 600


def test_places_are_independent_and_unknown_engines_share_the_fleet():
    co, lg = make({E0: 10_000, E1: 10_000})
    a, b = Prog(co, "a", 8000, seed=1, place=E0), Prog(co, "b", 8000, seed=2, place=E1)
    assert a.submit(0.0).kind is Kind.ADMIT and b.submit(0.0).kind is Kind.ADMIT
    c = Prog(co, "c", 2000, seed=3, place=E0)
    assert c.submit(0.0).kind is Kind.WAIT  # e0 is full although the fleet has 1,000 more
    u = Prog(co, "u", 500, seed=4, place=None)
    assert u.submit(0.0).kind is Kind.ADMIT  # unknown engine: fleet rule, 17,000 + 1,000 <= 18,000
    assert co.program_states() == {E0: {"live": 1, "in_tool": 0, "paused": 0, "ended": 0},
                                   E1: {"live": 1, "in_tool": 0, "paused": 0, "ended": 0},
                                   "fleet": {"live": 1, "in_tool": 0, "paused": 0, "ended": 0}}
    orjson.dumps(co.stats(1.0))


def test_idle_programs_end_after_the_ttl():
    co, lg = make(program_ttl_s=60.0)
    a = Prog(co, "a", 2000)
    a.submit(0.0)
    a.answer(1.0)
    assert co.next_deadline(1.0) == 61.0
    co.pump(61.0)
    assert co.state_of("a") is None and lg.reserved == 0 and co.counters["programs_ended"] == 1


def test_a_program_past_its_ttl_is_kept_while_its_turn_waits_and_ends_when_the_waiter_leaves():
    co, lg, (small, mid, big) = _three_in_tool("largest", program_ttl_s=11.5)
    mid.ids += list(range(10 ** 8, 10 ** 8 + 3000))
    mid.submit(21.0)  # pauses big at 21.0
    assert co.state_of("big") is ProgramState.PAUSED
    assert big.submit(22.0).kind is Kind.WAIT
    co.pump(33.0)  # big: idle since 21.0, past the TTL, but its turn waits; small (idle since 12.0) ends
    assert co.state_of("big") is ProgramState.PAUSED and co.state_of("small") is None
    # no wake-up at once for a program that cannot end yet: the next one is the waiter's aging (22 + 30)
    assert co.next_deadline(33.0) == 52.0
    assert co.cancel(big.ticket, 34.0)
    co.pump(34.0)
    assert co.state_of("big") is None and co.counters["programs_ended"] == 2


def test_idle_expiry_reads_only_what_is_due_and_keeps_its_entries_bounded():
    """Thousands of live programs: a request's expiry check and the timer's next deadline read the earliest
    idle deadline, not every program; the stale entries each turn leaves behind stay bounded."""
    co, lg = make({E0: 10 ** 9}, program_ttl_s=100.0, overdue_multiple=0)  # the TTL alone
    progs = [Prog(co, f"p{i}", 10, seed=i, max_new=1) for i in range(3000)]
    now = 0.0
    for _ in range(3):
        for p in progs:
            now += 0.01
            assert p.submit(now).kind is Kind.ADMIT
            p.answer(now, output=1, tool=0)
    assert len(co._idle) <= 2 * 3000 + 64
    first = progs[0]
    first_due = now - 0.01 * 2999 + 100.0  # its last turn ended 2,999 turns before the last one
    assert co.next_deadline(now) == pytest.approx(first_due)
    co.pump(first_due + 1e-6)
    assert co.state_of(first.sid) is None and co.state_of(progs[1].sid) is not None
    co.pump(now + 100.0)
    assert co.counters["programs_ended"] == 3000 and co._idle == [] and lg.reserved == 0


def test_cancel_of_a_racing_grant_restores_the_program():
    co, lg = make()
    a, b = Prog(co, "a", 5000, seed=1), Prog(co, "b", 4000, seed=2)
    a.submit(0.0)
    b.submit(0.5)
    out = co.forget("a", 1.0) or co.release("a-1", 1.0, None)
    assert [d.ticket for d in out] == ["b-1"]
    assert co.cancel("b-1", 1.0) is True  # the client left in the same instant
    assert lg.reserved == 0 and co.state_of("b") is ProgramState.IN_TOOL


def test_one_turn_requests_leave_nothing_behind():
    co, lg = make()
    assert co.submit("x", 500, False, 0.0).kind is Kind.ADMIT
    co.release("x", 1.0, {"prompt_tokens": 400, "completion_tokens": 100})
    assert lg.reserved == 0 and co.program_states() == {}


def test_bad_args():
    lg = Ledger()
    for kw in ({"victim": "random"}, {"resume": "lifo"}, {"program_ttl_s": 0}, {"max_wait_s": -1}):
        with pytest.raises(ValueError):
            ProgramCoordinator(lg, **kw)


def _victim_tradeoff(victim):
    """Ten in-tool programs with residents 600, 1,200 ... 6,000 tokens (33,000) on a 40,000-token engine (ceiling
    36,000); a live program's next turn grows to 9,000 tokens: 42,000, 6,000 over. Returns (programs paused,
    tokens paused, sum of c^2 over the paused contexts in millions: the re-prefill attention work)."""
    co, lg = make({E0: 40_000}, victim=victim)
    co.submit("x0", 100, False, 0.0, session_id="x")
    co.release("x0", 0.0, {"prompt_tokens": 100, "completion_tokens": 0})
    for i in range(10):
        co.submit(f"t{i}", 600 * (i + 1), False, float(i), session_id=f"p{i}")
        co.release(f"t{i}", 10.0 + (9 - i), {"prompt_tokens": 600 * (i + 1), "completion_tokens": 0})
    assert lg.reserved == 33_100
    co.submit("x1", 9000, False, 30.0, session_id="x")
    paused = [a.session_id for a in co.take_actions()]
    sizes = [600 * (int(s[1:]) + 1) for s in paused]
    assert lg.reserved <= lg.ceiling
    return len(paused), sum(sizes), round(sum(c * c for c in sizes) / 1e6, 2)


def test_victim_rules_trade_pauses_for_re_prefill_work():
    # measured: smallest pauses the most programs but the least re-prefill work; largest the fewest programs
    assert _victim_tradeoff("smallest") == (4, 6000, 10.8)  # 600 + 1,200 + 1,800 + 2,400
    assert _victim_tradeoff("largest") == (1, 6000, 36.0)  # 6,000
    assert _victim_tradeoff("longest-idle") == (1, 6000, 36.0)  # p9 (6,000) has been in its tool call longest


def test_the_ahead_rule_pauses_the_program_furthest_ahead_of_its_group():
    """Two groups of two siblings (a group: the same first prompt), all in a tool call: a1 has 4 turns done
    and its sibling a2 1 (a1 is 1.5 ahead of its group's mean), b1 and b2 3 each (0 ahead). A live program's
    next turn overflows the engine by one program's worth: "ahead" pauses a1, though it is not the smallest;
    "smallest" pauses b2."""
    def run(victim):
        co, lg = make({E0: 20_000}, victim=victim, overdue_multiple=0)  # ceiling 18,000
        tasks = {"a": list(range(1, 200)), "b": list(range(1000, 1199))}
        sizes, turns = {"a1": 2000, "a2": 3000, "b1": 3000, "b2": 1500}, {"a1": 4, "a2": 1, "b1": 3, "b2": 3}
        t = 0.0
        for sid in sizes:
            blocks = estimate_request("/generate", {"input_ids": tasks[sid[0]]}, expected_decode_cap=1).blocks
            for n in range(turns[sid]):
                co.submit(f"{sid}-{n}", sizes[sid], False, t, place=E0, blocks=blocks if n == 0 else (),
                          session_id=sid, prompt_tokens=sizes[sid])
                co.release(f"{sid}-{n}", t, {"prompt_tokens": sizes[sid], "completion_tokens": 0})
                t += 0.1
        co.submit("l0", 100, False, t, place=E0, session_id="live")
        co.release("l0", t, {"prompt_tokens": 100, "completion_tokens": 0})
        assert lg.reserved == 9600
        co.submit("l1", 9000, False, t + 1, place=E0, session_id="live", prompt_tokens=8900)  # 18,500
        return [a.session_id for a in co.take_actions()]

    assert run("ahead") == ["a1"]
    assert run("smallest") == ["b2"]


def test_a_paused_turn_past_the_resume_deadline_makes_its_own_room():
    """Ceiling 9,000. p (3,000) is paused; its next turn (4,000) arrives at t=10 while q (2,500) and r (2,000)
    are in a tool call and s (1,500) is live: 6,000 + 4,000 > 9,000. Without a deadline it waits until room
    frees (here: the max wait, t=40). With resume_deadline_s 5 it goes at t=15, pausing r (victim rule
    smallest) to make its room; it never pauses the live s."""
    def run(deadline):
        co, lg = make(overdue_multiple=0, resume_deadline_s=deadline, victim="smallest")
        for sid, size in (("p", 3000), ("q", 2500), ("r", 2000)):
            co.submit(f"{sid}0", size, False, 0.0, place=E0, session_id=sid)
            co.release(f"{sid}0", 1.0, {"prompt_tokens": size, "completion_tokens": 0})
        assert co.submit("s0", 1500, False, 2.0, place=E0, session_id="s").kind is Kind.ADMIT
        co._pause(co._programs["p"], 3.0)
        assert co.submit("p1", 4000, False, 10.0, place=E0, session_id="p").kind is Kind.WAIT
        return co, lg

    co, lg = run(None)
    assert co.next_deadline(10.0) == 40.0 and co.pump(39.0) == []
    co, lg = run(5.0)
    assert co.next_deadline(10.0) == 15.0 and co.pump(14.9) == []
    out = co.pump(15.0)
    assert [(d.ticket, d.kind, d.waited_s) for d in out] == [("p1", Kind.ADMIT, 5.0)]
    assert co.state_of("r") is ProgramState.PAUSED and co.state_of("q") is ProgramState.IN_TOOL
    assert co.state_of("s") is ProgramState.LIVE and co.counters["resume_deadline"] == 1
    assert lg.reserved == 2500 + 1500 + 4000


def test_longest_idle_makes_the_deadline_pause_the_program_longest_in_its_tool_call():
    """Ceiling 9,000. p (3,000) is paused; its next turn (4,000) waits from t=10 while r (2,500, in its tool call
    since t=1) and q (2,000, since t=8) hold 4,500 and s (1,500) is live. At the deadline (t=15) one of them must
    pause. `longest-idle` pauses r, the one idle longest: q, back from a short tool call at t=16, goes at once.
    Under `smallest` (ThunderAgent's rule) q pauses instead, and its next turn waits for room."""
    def run(**kw):
        co, lg = make(overdue_multiple=0, resume_deadline_s=5.0, **kw)
        for sid, size, end in (("p", 3000, 1.0), ("r", 2500, 1.0), ("q", 2000, 8.0)):
            co.submit(f"{sid}0", size, False, 0.0, place=E0, session_id=sid)
            co.release(f"{sid}0", end, {"prompt_tokens": size, "completion_tokens": 0})
        assert co.submit("s0", 1500, False, 2.0, place=E0, session_id="s").kind is Kind.ADMIT
        co._pause(co._programs["p"], 3.0)
        assert co.submit("p1", 4000, False, 10.0, place=E0, session_id="p").kind is Kind.WAIT
        out = co.pump(15.0)
        assert [(d.ticket, d.kind, d.waited_s) for d in out] == [("p1", Kind.ADMIT, 5.0)]
        return co, lg, co.submit("q1", 2200, False, 16.0, place=E0, session_id="q")

    co, lg, d = run(victim="longest-idle")
    assert co.state_of("r") is ProgramState.PAUSED and d.kind is Kind.ADMIT and d.waited_s == 0.0
    assert lg.reserved == 2200 + 1500 + 4000
    co, lg, d = run(victim="smallest")
    assert co.state_of("q") is ProgramState.PAUSED and co.state_of("r") is ProgramState.IN_TOOL
    assert d.kind is Kind.WAIT and lg.reserved == 2500 + 1500 + 4000  # 2,200 more does not fit in 9,000


def test_a_paused_turn_past_the_deadline_waits_for_running_programs():
    co, lg = make(overdue_multiple=0, resume_deadline_s=5.0)
    co.submit("p0", 4000, False, 0.0, place=E0, session_id="p")
    co.release("p0", 1.0, {"prompt_tokens": 4000, "completion_tokens": 0})
    assert co.submit("s0", 5000, False, 2.0, place=E0, session_id="s").kind is Kind.ADMIT
    co._pause(co._programs["p"], 3.0)
    assert co.submit("p1", 4500, False, 10.0, place=E0, session_id="p").kind is Kind.WAIT
    assert co.pump(15.0) == [] and co.counters["pause"] == 1  # nothing in a tool call to pause
    assert co.next_deadline(15.0) == 40.0  # no busy loop on the passed deadline: aging is next
    out = co.release("s0", 16.0, {"prompt_tokens": 5000, "completion_tokens": 0})  # s's tool call starts
    assert [(d.ticket, d.kind) for d in out] == [("p1", Kind.ADMIT)] and co.state_of("s") is ProgramState.PAUSED


def test_new_args_are_checked():
    lg = Ledger()
    for kw in ({"overdue_multiple": -1}, {"overdue_quantile": 0}, {"overdue_default_s": 0},
               {"resume_deadline_s": -1}, {"victim": "behind"}):
        with pytest.raises(ValueError):
            ProgramCoordinator(lg, **kw)


# ---------------------------------------------------------------- the resident bound (max_resident)

def _turn(co, sid, tokens, now, place=E0, protected=False, n=0):
    """Submit one turn of ``tokens`` (all prompt) for ``sid``; returns its decision."""
    return co.submit(f"{sid}{n}", tokens, protected, now, place=place, session_id=sid, prompt_tokens=tokens)


def _answer(co, sid, tokens, now, n=0):
    return co.release(f"{sid}{n}", now, {"prompt_tokens": tokens, "completion_tokens": 0})


def test_the_resident_bound_holds_n_programs_and_the_next_waits_until_one_closes():
    """Room for all, bound 2: the third new program waits with reason resident-bound although its turn fits,
    a fourth waits behind it (arrival order), and each goes when a resident program's session closes."""
    co, lg = make({E0: 100_000}, max_resident=2)
    assert _turn(co, "a", 1000, 0.0).kind is Kind.ADMIT and _turn(co, "b", 1000, 0.0).kind is Kind.ADMIT
    w = _turn(co, "c", 1000, 1.0)
    assert (w.kind, w.reason) == (Kind.WAIT, "resident-bound")
    assert _answer(co, "a", 1000, 2.0) == []  # in a tool call, a still holds its KV and its seat
    d = _turn(co, "d", 1000, 3.0)
    assert (d.kind, d.reason) == (Kind.WAIT, "resident-bound")  # no seat for it either
    assert co.counters["wait_resident_bound"] == 2 and co.stats(3.0)["waiting_bound"] == 2
    assert co.seats(3.0) == {E0: {"resident": 2, "kept_for_paused": 0, "limit": 2}}
    co.forget("a", 4.0)
    assert [(x.ticket, x.kind, x.waited_s) for x in co.pump(4.0)] == [("c0", Kind.ADMIT, 3.0)]
    assert co.is_waiting("d0") and co.counters["wait_resident_bound"] == 2  # d now waits for a seat itself
    _answer(co, "b", 1000, 5.0)
    co.forget("b", 6.0)
    assert [x.ticket for x in co.pump(6.0)] == ["d0"]
    assert co.seats(6.0)[E0]["resident"] == 2 and lg.reserved == 2000
    # off (the default): all four start at once
    co, lg = make({E0: 100_000})
    assert all(_turn(co, s, 1000, 0.0).kind is Kind.ADMIT for s in "abcd") and co.seats(0.0) == {}


def test_the_bound_is_per_kv_pool_and_the_fleet_has_n_per_pool():
    co, lg = make({E0: 100_000, E1: 100_000}, max_resident=1)
    assert _turn(co, "a", 1000, 0.0, place=E0).kind is Kind.ADMIT
    assert _turn(co, "b", 1000, 0.0, place=E0).reason == "resident-bound"  # e0's one seat is taken
    assert _turn(co, "c", 1000, 0.0, place=E1).kind is Kind.ADMIT  # e1 has its own
    # a program whose engine is unknown counts against the fleet's 1 x 2 pools: both taken
    assert _turn(co, "u", 1000, 0.0, place=None).reason == "resident-bound"
    _answer(co, "c", 1000, 1.0)
    co.forget("c", 1.0)
    assert [x.ticket for x in co.pump(1.0)] == ["u0"]
    assert co.seats(1.0) == {E0: {"resident": 1, "kept_for_paused": 0, "limit": 1},
                             "fleet": {"resident": 1, "kept_for_paused": 0, "limit": 2}}
    # e1 now holds no program but the fleet's two seats are taken (a on e0, u unplaced): b still waits
    assert co.is_waiting("b0") and _turn(co, "e", 1000, 1.0, place=E1).reason == "resident-bound"


def test_an_ended_program_is_paused_to_free_its_seat():
    """Bound 1. a answered at t=1 and is in a tool call; no gap between turns has been seen, so it counts as
    ended 10 s later (overdue_default_s). b waits for the seat until then, and goes at t=11 with a paused
    (its engine session closed); a keeps no seat. a was only slow: its next turn resumes when b's ends."""
    co, lg = make({E0: 100_000}, max_resident=1, overdue_default_s=10.0, max_wait_s=100.0)
    _turn(co, "a", 2000, 0.0)
    _answer(co, "a", 2000, 1.0)
    assert _turn(co, "b", 1000, 2.0).reason == "resident-bound"
    assert co.next_deadline(2.0) == 11.0 and co.pump(10.9) == []
    assert [(x.ticket, x.kind) for x in co.pump(11.0)] == [("b0", Kind.ADMIT)]
    assert co.take_actions() == [Action("close", "a", E0)] and co.counters["pause_overdue"] == 1
    assert co.seats(11.0) == {E0: {"resident": 1, "kept_for_paused": 0, "limit": 1}}
    assert _turn(co, "a", 2500, 12.0, n=1).reason == "resident-bound"  # its resume waits for b's seat
    _answer(co, "b", 1000, 13.0)
    co.forget("b", 13.0)
    assert [x.ticket for x in co.pump(13.0)] == ["a1"] and co.state_of("a") is ProgramState.LIVE


def _paused_with_a_kept_seat(max_resident, **kw):
    """Ceiling 9,000, bound 2 (or off). a (2,000) in a tool call and b (3,000) resident; b's next turn grows to
    7,500: 9,500 > 9,000 pauses a at t=2 (expected back: no gap known, overdue_default_s after its last turn)."""
    co, lg = make(max_resident=max_resident, **kw)
    for sid, size in (("a", 2000), ("b", 3000)):
        assert _turn(co, sid, size, 0.0).kind is Kind.ADMIT
        _answer(co, sid, size, 1.0)
    assert _turn(co, "b", 7500, 2.0, n=1).kind is Kind.ADMIT
    assert co.state_of("a") is ProgramState.PAUSED and co.take_actions() == [Action("close", "a", E0)]
    return co, lg


def test_a_paused_program_keeps_its_seat_against_new_programs_and_resumes_first():
    """Without the bound, new program c takes the room a's pause freed (7,500 + 1,000 fit); with it, c waits:
    one resident (b) + one seat kept for a = 2. a's resume counts resident programs only; when b's session
    closes, a resumes first and c goes after it."""
    co, lg = _paused_with_a_kept_seat(None)
    assert _turn(co, "c", 1000, 3.0).kind is Kind.ADMIT
    co, lg = _paused_with_a_kept_seat(2)
    assert co.seats(2.0) == {E0: {"resident": 1, "kept_for_paused": 1, "limit": 2}}
    assert _turn(co, "c", 1000, 3.0).reason == "resident-bound"
    w = _turn(co, "a", 2500, 4.0, n=1)
    assert (w.kind, w.reason) == (Kind.WAIT, "capacity_exhausted")  # a seat is there for it; room is not
    _answer(co, "b", 7500, 5.0, n=1)
    co.forget("b", 6.0)
    assert [(x.ticket, x.kind) for x in co.pump(6.0)] == [("a1", Kind.ADMIT), ("c0", Kind.ADMIT)]
    assert co.resumes == {E0: 1} and co.seats(6.0) == {E0: {"resident": 2, "kept_for_paused": 0, "limit": 2}}


def test_the_seat_kept_for_a_paused_program_lapses_when_its_predicted_gap_has_passed():
    """a's last turn ended at t=1 and nothing is known of its gaps: it is expected back within
    overdue_default_s (20 s). Its kept seat lapses at t=21 and c, waiting since t=3, goes then."""
    co, lg = _paused_with_a_kept_seat(2, overdue_default_s=20.0, max_wait_s=100.0)
    assert _turn(co, "c", 1000, 3.0).reason == "resident-bound"
    assert co.next_deadline(3.0) == 21.0 and co.pump(20.9) == []
    assert [x.ticket for x in co.pump(21.0)] == ["c0"]
    assert co.state_of("a") is ProgramState.PAUSED  # still paused; a turn of its own would resume it


def test_the_resume_deadline_makes_a_seat_and_aging_bounds_the_wait():
    """Bound 1, ceiling 9,000, overdue off. p (4,000) is in a tool call; protected q (6,000) overflows e0 and
    p pauses; q answers and holds the seat. p's next turn waits for the seat: without a resume deadline until
    it ages (t=40, bypass-aged, still reserving); with resume_deadline_s 5 it goes at t=15, pausing q."""
    def run(deadline):
        co, lg = make(max_resident=1, overdue_multiple=0, resume_deadline_s=deadline)
        _turn(co, "p", 4000, 0.0)
        _answer(co, "p", 4000, 1.0)
        assert _turn(co, "q", 6000, 2.0, protected=True).kind is Kind.BYPASS_PROTECTED
        assert co.state_of("p") is ProgramState.PAUSED
        _answer(co, "q", 6000, 3.0)
        assert _turn(co, "p", 4500, 10.0, n=1).reason == "resident-bound"
        return co, lg

    co, lg = run(None)
    assert co.next_deadline(10.0) == 40.0 and co.pump(39.9) == []
    assert [(x.ticket, x.kind) for x in co.pump(40.0)] == [("p1", Kind.BYPASS_AGED)]
    co, lg = run(5.0)
    assert co.next_deadline(10.0) == 15.0 and co.pump(14.9) == []
    assert [(x.ticket, x.kind, x.waited_s) for x in co.pump(15.0)] == [("p1", Kind.ADMIT, 5.0)]
    assert co.state_of("q") is ProgramState.PAUSED and co.counters["resume_deadline"] == 1
    assert lg.reserved == 4500
    # q paused while expected back (overdue off: until its session closes): a new program waits for p or q
    assert co.seats(15.0) == {E0: {"resident": 1, "kept_for_paused": 1, "limit": 1}}
    assert _turn(co, "r", 100, 16.0).reason == "resident-bound"
    co.forget("q", 17.0)
    _answer(co, "p", 4500, 18.0, n=1)
    co.forget("p", 18.0)
    assert [x.ticket for x in co.pump(18.0)] == ["r0"]


def test_protected_and_degraded_turns_bypass_the_bound():
    co, lg = make({E0: 100_000}, max_resident=1, stale_after_s=6.0)
    assert _turn(co, "a", 1000, 0.0).kind is Kind.ADMIT
    assert _turn(co, "p", 1000, 0.0, protected=True).kind is Kind.BYPASS_PROTECTED
    assert co.seats(0.0)[E0] == {"resident": 2, "kept_for_paused": 0, "limit": 1}  # the documented excess
    assert _turn(co, "b", 1000, 1.0).reason == "resident-bound"
    assert [(x.ticket, x.kind) for x in co.pump(6.0)] == [("b0", Kind.BYPASS_DEGRADED)]  # the figures are stale
    assert _turn(co, "c", 1000, 7.0).kind is Kind.BYPASS_DEGRADED


def test_a_program_whose_only_turn_was_cancelled_holds_no_seat():
    co, lg = make({E0: 100_000}, max_resident=1)
    _turn(co, "a", 1000, 0.0)
    assert _turn(co, "b", 1000, 1.0).reason == "resident-bound"
    co.forget("a", 2.0)  # a's turn is in flight: its seat goes when the turn ends
    assert co.pump(2.0) == []
    assert [x.ticket for x in co.release("a0", 3.0, None)] == ["b0"]
    assert co.cancel("b0", 3.0)  # b's client left in the same instant: b never answered a turn
    assert co.state_of("b") is ProgramState.IN_TOOL and co.seats(3.0) == {}
    assert _turn(co, "c", 1000, 4.0).kind is Kind.ADMIT
    # b's client tries again: b holds nothing, so its turn waits for a seat like a new program's
    assert _turn(co, "b", 1000, 5.0, n=1).reason == "resident-bound"
    _answer(co, "c", 1000, 6.0)
    co.forget("c", 6.0)
    assert [x.ticket for x in co.pump(6.0)] == ["b1"] and co.resumes == {}


def test_the_resident_bound_is_checked():
    lg = Ledger()
    for bad in (0, -1, True, 1.5, "auto", "2"):
        with pytest.raises(ValueError, match="max_resident"):
            ProgramCoordinator(lg, max_resident=bad)
    assert ProgramCoordinator(lg, max_resident=3).max_resident == 3
