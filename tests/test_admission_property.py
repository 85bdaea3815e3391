"""Property test (issue 3 "Done when"): random acquire / release / cancel / reconcile / expire sequences keep
reserved >= 0 and equal to the live leases (bypasses hold leases too), bring it back to 0 when all leases end,
keep FIFO order (strict mode), and no waiter is left waiting past max_wait_s after a pump (both modes)."""

from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvgate.admission.capacity import ClusterSnapshot, EngineCapacity
from kvgate.admission.coordinator import AdmissionCoordinator, Kind
from kvgate.admission.ledger import Ledger

DT = st.one_of(st.just(0.0), st.floats(0, 2), st.floats(0, 10))


class AdmissionMachine(RuleBasedStateMachine):
    @initialize(
        max_wait=st.sampled_from([0.0, 5.0, 30.0]),
        ttl=st.sampled_from([20.0, 1000.0]),
        stale=st.sampled_from([6.0, 1e9]),
        cap=st.integers(1000, 20_000),
        backfill=st.booleans(),
    )
    def setup(self, max_wait, ttl, stale, cap, backfill):
        self.backfill = backfill
        self.lg = Ledger(headroom=0.9, pressure_threshold=0.92, stale_after_s=stale, lease_ttl_s=ttl, window_s=60.0)
        self.co = AdmissionCoordinator(self.lg, max_wait_s=max_wait, backfill=backfill)
        self.now = 0.0
        self.next_id = 0
        self.queue = []  # model FIFO of ticket ids
        self.held = {}  # ticket -> tokens, leases the shell believes it holds
        self.left_order = []  # tickets in the order they left the FIFO by admit/bypass
        self.enqueue_order = []
        self.raced = 0
        self.waited_since = {}
        self.co.reconcile(ClusterSnapshot.build({"http://e0": EngineCapacity.from_pools([(cap, 0, 0.0)])}, 0.0), 0.0)

    def _tick(self, dt):
        self.now += dt

    def _deliver(self, decisions):
        for d in decisions:
            # strict FIFO: whatever leaves the queue is the current head (backfill: any waiter, by admit)
            assert self.queue and d.ticket in self.queue, (d, self.queue)
            if not (self.backfill and d.kind is Kind.ADMIT):
                assert d.ticket == self.queue[0], (d, self.queue)
                self.left_order.append(d.ticket)
            self.queue.remove(d.ticket)
            assert d.kind is not Kind.WAIT
            assert d.waited_s >= 0
            if d.lease is not None:
                self.held[d.ticket] = d.tokens

    def _sync_expired(self):
        for t in [t for t in self.held if not self.lg.holds(t)]:
            del self.held[t]

    @rule(tokens=st.one_of(st.integers(0, 500), st.integers(0, 12_000), st.integers(10_000, 40_000)), protected=st.booleans(), dt=DT)
    def submit(self, tokens, protected, dt):
        self._tick(dt)
        t = self.next_id
        self.next_id += 1
        had_waiters = bool(self.queue)
        d = self.co.submit(t, tokens, protected, self.now)
        self._sync_expired()
        if d.kind is Kind.WAIT:
            self.queue.append(t)
            self.enqueue_order.append(t)
            self.waited_since[t] = self.now
            self._deliver(self.co.pump(self.now))
        else:
            assert not (had_waiters and d.kind is Kind.ADMIT and not self.backfill), "admitted past an earlier waiter"
            if d.lease is not None:
                self.held[t] = tokens

    @precondition(lambda self: self.held)
    @rule(data=st.data(), dt=DT, race=st.booleans())
    def release(self, data, dt, race):
        self._tick(dt)
        t = data.draw(st.sampled_from(sorted(self.held)))
        del self.held[t]
        out = self.co.release(t, self.now)
        self._deliver(out)
        self._sync_expired()
        assert not self.lg.holds(t)
        granted = [d.ticket for d in out if d.lease is not None and self.lg.holds(d.ticket)]
        if race and granted:
            # the pump granted a waiter whose client vanished in the same instant: cancel releases the lease
            g = granted[0]
            assert self.co.cancel(g, self.now) is True
            del self.held[g]
            assert not self.lg.holds(g)
            self.raced += 1
            self._deliver(self.co.pump(self.now))

    @precondition(lambda self: self.queue)
    @rule(data=st.data(), dt=DT)
    def cancel_waiter(self, data, dt):
        self._tick(dt)
        self._deliver(self.co.pump(self.now))  # time passed: the shell's timer would have pumped
        self._sync_expired()
        if not self.queue:
            return
        t = data.draw(st.sampled_from(self.queue))
        assert self.co.cancel(t, self.now) is True
        self.queue.remove(t)
        self._deliver(self.co.pump(self.now))

    @rule(
        caps=st.lists(st.tuples(st.integers(0, 20_000), st.floats(0, 1)), min_size=0, max_size=3),
        failed=st.booleans(),
        dt=DT,
    )
    def reconcile(self, caps, failed, dt):
        self._tick(dt)
        engines = {f"http://e{i}": (None if failed and i == 0 else EngineCapacity.from_pools([(c, int(c * u), u)])) for i, (c, u) in enumerate(caps)}
        self._deliver(self.co.reconcile(ClusterSnapshot.build(engines, self.now), self.now))
        self._sync_expired()

    @rule(dt=st.floats(0, 60))
    def expire(self, dt):
        self._tick(dt)
        self._deliver(self.co.pump(self.now))  # pump reclaims expired leases first
        self._sync_expired()
        # nothing starves: after a pump no waiter has waited max_wait_s or more
        assert all(self.now - self.waited_since[t] < self.co.max_wait_s for t in self.queue)

    @invariant()
    def ledger_consistent(self):
        if not hasattr(self, "lg"):
            return
        assert self.lg.reserved >= 0
        assert self.lg.reserved == sum(self.lg.lease(t).tokens for t in self.held)
        assert self.lg.lease_count == len(self.held)
        assert self.co.waiting_tickets() == self.queue
        # FIFO kept: tickets left the queue in enqueue order (cancelled ones skipped)
        pos = {t: i for i, t in enumerate(self.enqueue_order)}
        idx = [pos[t] for t in self.left_order]
        assert idx == sorted(idx)

    def teardown(self):
        if not hasattr(self, "lg"):
            return
        for t in list(self.queue):
            assert self.co.cancel(t, self.now)
            self.queue.remove(t)
        for t in list(self.held):
            self.co.release(t, self.now)
        assert self.co.waiting == 0
        assert self.lg.reserved == 0 and self.lg.lease_count == 0


AdmissionMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
TestAdmissionProperty = AdmissionMachine.TestCase
