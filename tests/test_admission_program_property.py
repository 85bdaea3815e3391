"""Property test of the program policy: random turns, answers, cancels, forgets, capacity changes and time
keep the ledger consistent (reserved >= 0, one lease per forwarded turn), bring reserved back to 0 when every
lease ends and every program is gone, and never leave a turn waiting past max_wait_s after a pump. With a
resident bound N, no engine ever holds more than N resident programs (the fleet: N x its engines) besides
those that became resident by a bypass (protected, aged, degraded), and the bound's books match the
programs' states."""

from collections import Counter

from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvgate.admission.capacity import ClusterSnapshot, EngineCapacity
from kvgate.admission.victims import RESUME_ORDERS
from kvgate.admission.coordinator import Kind
from kvgate.admission.ledger import Ledger
from kvgate.admission.program import _NO_SEAT, ProgramCoordinator, ProgramState

PLACES = ["http://e0", "http://e1", None]
DT = st.one_of(st.just(0.0), st.floats(0, 3), st.floats(0, 20))


class ProgramMachine(RuleBasedStateMachine):
    @initialize(max_wait=st.sampled_from([0.0, 5.0, 30.0]), victim=st.sampled_from(["smallest", "largest", "longest-idle"]),
                resume=st.sampled_from(list(RESUME_ORDERS)), stale=st.sampled_from([8.0, 1e9]),
                cap=st.integers(2000, 30_000))
    def setup(self, max_wait, victim, resume, stale, cap):
        self._setup(max_wait, victim, resume, stale, cap)

    def _setup(self, max_wait, victim, resume, stale, cap, bound=None, overdue=3.0, deadline=None):
        self.lg = Ledger(headroom=0.9, pressure_threshold=0.92, stale_after_s=stale, lease_ttl_s=1e6)
        self.co = ProgramCoordinator(self.lg, max_wait_s=max_wait, victim=victim, resume=resume, program_ttl_s=50.0,
                                     max_resident=bound, overdue_multiple=overdue, overdue_default_s=10.0,
                                     resume_deadline_s=deadline)
        self.bypassed = set()  # programs that became resident by a bypass (the bound's documented excess)
        self.now = 0.0
        self.n = 0
        self.held = {}  # ticket -> program
        self.waiting = {}  # ticket -> (program, enqueued_at)
        self.context = {}  # program -> prompt token ids
        self._reconcile([(cap, 0.0), (cap, 0.0)])

    def _reconcile(self, caps):
        engines = {f"http://e{i}": EngineCapacity.from_pools([(c, int(c * u), u)]) for i, (c, u) in enumerate(caps)}
        self._deliver(self.co.reconcile(ClusterSnapshot.build(engines, self.now), self.now))

    def _deliver(self, decisions):
        for d in decisions:
            assert d.ticket in self.waiting, d
            assert d.kind is not Kind.WAIT
            prog, _ = self.waiting.pop(d.ticket)
            self._seated(prog, d)  # every waiting turn is a new program's or a paused one's
            if d.lease is not None:
                self.held[d.ticket] = prog
        self.co.take_actions()

    def _seated(self, prog, d):
        """A turn of ``prog`` that held no seat went: by a bypass (beyond the bound) or admitted (within it)."""
        if d.kind.is_bypass:
            self.bypassed.add(prog)
        elif d.kind is Kind.ADMIT:
            self.bypassed.discard(prog)

    def _busy(self, prog):
        return prog in self.held.values() or any(p == prog for p, _ in self.waiting.values())

    @rule(prog=st.integers(0, 5), grow=st.integers(0, 6000), place=st.sampled_from(PLACES), max_new=st.integers(0, 3000),
          protected=st.booleans(), dt=DT)
    def turn(self, prog, grow, place, max_new, protected, dt):
        self.now += dt
        if self._busy(prog):
            return
        if self.co.max_resident is not None:
            place = PLACES[prog % len(PLACES)]  # no moves: a program placement moves may exceed the bound
        p = self.co._programs.get(f"p{prog}")
        seatless = p is None or p.seat is _NO_SEAT
        ids = self.context.setdefault(prog, [])
        ids.extend(range(prog * 10 ** 7 + len(ids), prog * 10 ** 7 + len(ids) + grow))
        t = self.n
        self.n += 1
        from kvgate.admission.reservation import estimate_request
        r = estimate_request("/generate", {"input_ids": ids or [1], "sampling_params": {"max_new_tokens": max_new}},
                             expected_decode_cap=4096)
        d = self.co.submit(t, r.tokens, protected and grow % 7 == 0, self.now, place=place, blocks=r.blocks,
                           session_id=f"p{prog}", prompt_tokens=r.prompt_tokens)
        if d.kind is Kind.WAIT:
            self.waiting[t] = (prog, self.now)
            self._deliver(self.co.pump(self.now))
        else:
            if seatless:
                self._seated(prog, d)
            if d.lease is not None:
                self.held[t] = prog
        self.co.take_actions()

    @precondition(lambda self: self.held)
    @rule(data=st.data(), out=st.integers(0, 3000), cached=st.integers(0, 5000), answered=st.booleans(), dt=DT)
    def answer(self, data, out, cached, answered, dt):
        self.now += dt
        t = data.draw(st.sampled_from(sorted(self.held)))
        prog = self.held.pop(t)
        meta = {"prompt_tokens": len(self.context.get(prog, [])), "completion_tokens": out, "cached_tokens": cached} \
            if answered else None
        self._deliver(self.co.release(t, self.now, meta))
        assert not self.lg.holds(t)

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def cancel(self, data):
        t = data.draw(st.sampled_from(sorted(self.waiting)))
        assert self.co.cancel(t, self.now)
        del self.waiting[t]
        self._deliver(self.co.pump(self.now))

    @rule(prog=st.integers(0, 5))
    def forget(self, prog):
        self.co.forget(f"p{prog}", self.now)
        self.context.pop(prog, None)
        self._deliver(self.co.pump(self.now))

    @rule(caps=st.lists(st.tuples(st.integers(1000, 30_000), st.floats(0, 1)), min_size=2, max_size=2), dt=DT)
    def reconcile(self, caps, dt):
        self.now += dt
        self._reconcile(caps)

    @rule(dt=st.floats(0, 40))
    def time_passes(self, dt):
        self.now += dt
        self._deliver(self.co.pump(self.now))
        # nothing starves: after a pump no turn has waited max_wait_s or more
        assert all(self.now - at < self.co.max_wait_s for _, at in self.waiting.values())
        # the TTL rule, against a scan of every program: none idle for program_ttl_s is left unless a turn of
        # its own waits, and the next deadline comes no later than the first idle program's end
        waiting = {f"p{p}" for p, _ in self.waiting.values()}
        ttl = self.co.program_ttl_s
        for sid, p in self.co._programs.items():
            assert p.inflight or sid in waiting or self.now - p.since < ttl, (sid, p.since, self.now)
        ends = [p.since + ttl for sid, p in self.co._programs.items() if not p.inflight and sid not in waiting]
        d = self.co.next_deadline(self.now)
        assert not ends or (d is not None and d <= max(self.now, min(ends)))

    @invariant()
    def consistent(self):
        if not hasattr(self, "lg"):
            return
        assert self.lg.reserved >= 0
        assert self.lg.lease_count == len(self.held)
        assert set(self.co.waiting_tickets()) == set(self.waiting)
        # the per-place waiter counts the pump and the FIFO rule read agree with the queue itself
        q = list(self.co._queue.values())
        assert self.co._waiting_on == dict(Counter(w.place for w in q))
        assert self.co._resuming_on == dict(Counter(w.place for w in q if w.resume))
        for prog in set(self.held.values()):
            assert self.co.state_of(f"p{prog}") in (ProgramState.LIVE, None)
        co = self.co
        if co.max_resident is None:
            return
        # the bound's books match the programs' states
        resident = [p for p in co._programs.values() if p.state is ProgramState.LIVE
                    or p.state is ProgramState.IN_TOOL and p.last_end is not None]
        assert all(p.seat == p.place for p in resident)
        assert co._resident_on == dict(Counter(p.place for p in resident)) and co._resident_n == len(resident)
        claims = [p for p in co._programs.values() if p.claim is not None]
        assert all(p.state is ProgramState.PAUSED for p in claims)
        assert co._claims_on == dict(Counter(p.place for p in claims)) and co._claims_n == len(claims)
        # the bound: N per engine, N x 2 for the fleet, besides programs that a bypass made resident
        within = [p for p in resident if int(p.sid[1:]) not in self.bypassed]
        for place, n in Counter(p.place for p in within).items():
            assert n <= co.max_resident * (2 if place is None else 1), (place, n)
        assert len(within) <= 2 * co.max_resident

    def teardown(self):
        if not hasattr(self, "lg"):
            return
        for t in list(self.waiting):
            assert self.co.cancel(t, self.now)
        self.waiting.clear()
        for t in list(self.held):
            self.co.release(t, self.now, None)
        for prog in range(6):
            self.co.forget(f"p{prog}", self.now)
        assert self.co.waiting == 0
        assert self.lg.reserved == 0 and self.lg.lease_count == 0


ProgramMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
TestProgramProperty = ProgramMachine.TestCase


class BoundMachine(ProgramMachine):
    """The same rules under a resident bound, on engines roomy enough that the bound binds before the KV does
    (and tight ones, where both bind), each program on one place for good."""

    @initialize(max_wait=st.sampled_from([5.0, 30.0]), victim=st.sampled_from(["smallest", "largest", "ahead"]),
                resume=st.sampled_from(list(RESUME_ORDERS)), stale=st.sampled_from([8.0, 1e9]),
                cap=st.sampled_from([8000, 60_000, 200_000]), bound=st.sampled_from([1, 2]),
                overdue=st.sampled_from([0.0, 3.0]), deadline=st.sampled_from([None, 4.0]))
    def setup(self, max_wait, victim, resume, stale, cap, bound, overdue, deadline):
        self._setup(max_wait, victim, resume, stale, cap, bound, overdue, deadline)


BoundMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
TestProgramResidentBound = BoundMachine.TestCase
