"""Property test of the program policy over random fleets, programs and event orders: it is work-conserving
and no reservation outlives its evidence.

- No turn waits longer than one poll interval while a KV pool it may go to has room for its reservation (every
  engine when kvgate places sessions, its own place otherwise); programs that hold KV with no evidence they come
  back (one answered turn, no gap seen) do not count as holding it once the turn has waited that long. A turn
  that fits where it may go never waits at all.
- Pause only where it pays: a turn waits no longer than re-prefilling its own reservation would take at the
  prefill rate the coordinator has learned (what its admission displaces is at most that), for its program and
  for each call running where it may go, nor past the aging bound.
- No ended program holds a reservation: a closed session's program, a call without a session once answered,
  and a program idle past what its gaps predict (``program_states(now)`` shows none as ``ended``).

Programs are one-turn calls without a session, one-turn calls with one (a lifecycle-inferred job), and agents
of several turns; the clock advances through the coordinator's own deadlines, as the gate's timer does.
"""

from hypothesis import HealthCheck, event, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvgate.admission.capacity import ClusterSnapshot, EngineCapacity
from kvgate.admission.coordinator import Kind
from kvgate.admission.ledger import Grant, Ledger
from kvgate.admission.program import ProgramCoordinator, ProgramState

POLL_S = 2.0


class WorkConserving(RuleBasedStateMachine):
    @initialize(caps=st.lists(st.integers(2_000, 8_000), min_size=1, max_size=4),
                movable=st.booleans(), hot=st.booleans(), victim=st.sampled_from(["ahead", "smallest", "longest-idle"]),
                resume=st.sampled_from(["fifo", "smallest"]),
                per_token=st.sampled_from([None, 2e-4, 1e-3, 4e-3]))
    def setup(self, caps, movable, hot, victim, resume, per_token):
        self.lg = Ledger(headroom=0.9, pressure_threshold=0.92, stale_after_s=1e9, lease_ttl_s=1e9)
        self.co = ProgramCoordinator(self.lg, max_wait_s=30.0, victim=victim, resume=resume, program_ttl_s=300.0,
                                     overdue_default_s=20.0, reclaim_after_s=POLL_S,
                                     wait_bound="reprefill")
        self.movable = movable
        self.places = [f"http://e{i}" for i in range(len(caps))]
        if per_token is not None:  # the rate the engines' answers taught it (seconds = 0.05 + per_token x prefilled)
            for i in range(12):
                self.co.prefill.observe(self.places[i % len(self.places)], 0.05 + per_token * (100 + 97 * i)
                                        + 0.01 * (i % 3), 100 + 97 * i, i % 3)
        usage = [0.95 if hot and i == 0 and len(caps) > 1 else 0.0 for i in range(len(caps))]
        self._engines = {u: EngineCapacity.from_pools([(c, int(c * us), us)])
                         for u, c, us in zip(self.places, caps, usage)}
        snap = ClusterSnapshot.build(self._engines, 0.0)
        self.now = 0.0
        self.n = 0
        self.inflight = {}  # ticket -> program id
        self.prompt = {}  # ticket -> its prompt tokens (what the engine reports back)
        self.waiting = {}  # ticket -> (program id, enqueued_at, place, tokens)
        self.bound = {}  # waiting ticket -> the longest it may wait (the aging bound, or its re-prefill cost)
        self.turns = {}  # program id -> turns answered
        self.kind = {}  # program id -> "call" (no session) | "job" (one turn) | "agent"
        self.ended = set()  # programs the client ended (closed, or a call without a session answered)
        self.idle = set()  # programs between turns (a tool call runs)
        self._deliver(self.co.reconcile(snap, 0.0))

    # --------------------------------------------------------------------------------------- the shell
    def _deliver(self, decisions):
        for d in decisions:
            assert d.kind is not Kind.WAIT
            sid, _, _, _ = self.waiting.pop(d.ticket)
            self.inflight[d.ticket] = sid
        self.co.take_actions()

    def _submit(self, sid, tokens, place):
        self.n += 1
        t = f"t{self.n}"
        self.prompt[t] = tokens // 2
        self.idle.discard(sid)
        d = self.co.submit(t, tokens, False, self.now, place=place, session_id=None if self.kind[sid] == "call" else sid,
                           prompt_tokens=tokens // 2, movable=self.movable)
        self.co.take_actions()
        if d.kind is Kind.WAIT:
            event("a turn waited")
            self.waiting[t] = (sid, self.now, place, tokens)
            rate = self.co.prefill.per_token_s(self.lg.resolve_place(place))
            allowed = self.places if self.movable else [place]
            running = max(self.lg.leases_on(pl) for pl in allowed)  # each stalls while the displaced KV re-prefills
            self.bound[t] = (min(self.co.max_wait_s, tokens * rate * (1 + running)) if rate is not None
                             else self.co.max_wait_s)
        else:
            self.inflight[t] = sid
        self._deliver(self.co.pump(self.now))

    # --------------------------------------------------------------------------------------- events
    @rule(kind=st.sampled_from(["call", "job", "agent"]), tokens=st.integers(100, 4_000), i=st.integers(0, 3))
    def start(self, kind, tokens, i):
        sid = f"p{self.n}"
        self.kind[sid] = kind
        self.turns[sid] = 0
        self._submit(sid, tokens, self.places[i % len(self.places)])

    @precondition(lambda self: self.inflight)
    @rule(data=st.data(), output=st.integers(0, 2_000))
    def answer(self, data, output):
        t = data.draw(st.sampled_from(sorted(self.inflight)))
        sid = self.inflight.pop(t)
        self.turns[sid] += 1
        # no cached_tokens: the answers teach no new rate (time stands still between events here)
        self._deliver(self.co.release(t, self.now, {"prompt_tokens": self.prompt[t], "completion_tokens": output}))
        if self.kind[sid] == "call":
            self.ended.add(sid)
        elif not any(s == sid for s in self.inflight.values()):
            self.idle.add(sid)

    @precondition(lambda self: self.idle)
    @rule(data=st.data(), tokens=st.integers(100, 9_000))
    def next_turn(self, data, tokens):
        sid = data.draw(st.sampled_from(sorted(self.idle)))
        if self.kind[sid] == "agent" and sid not in self.ended:
            place = self.places[hash(sid) % len(self.places)]
            self._submit(sid, tokens, place)

    @precondition(lambda self: self.idle)
    @rule(data=st.data())
    def close(self, data):
        sid = data.draw(st.sampled_from(sorted(self.idle)))
        self.idle.discard(sid)
        self.ended.add(sid)
        self.co.forget(sid, self.now)
        self._deliver(self.co.pump(self.now))

    @rule()
    def signal_lost(self):
        """The capacity signal goes (router unreachable): everything bypasses, nothing is paused."""
        self._deliver(self.co.invalidate(self.now))

    @rule()
    def signal_back(self):
        self._deliver(self.co.reconcile(ClusterSnapshot.build(self._engines, self.now), self.now))

    @rule(dt=st.sampled_from([0.1, 1.0, 2.0, 5.0, 25.0]))
    def advance(self, dt):
        """Time passes; the gate's timer pumps at every deadline the coordinator names on the way."""
        end = self.now + dt
        for _ in range(1000):
            nxt = self.co.next_deadline(self.now)
            if nxt is None or nxt > end:
                break
            # a deadline the pump at it does not move on would spin the gate's timer
            assert nxt > self.now or self.co.pump(self.now) or self.co.next_deadline(self.now) > self.now, \
                f"next_deadline({self.now}) stays at {nxt}"
            self.now = nxt
            self._deliver(self.co.pump(self.now))
        else:
            raise AssertionError("over 1000 deadlines in one step")
        self.now = end
        self._deliver(self.co.pump(self.now))

    def teardown(self):
        if hasattr(self, "co"):
            for name in ("moved", "reclaimed", "pause_overdue", "pause", "bypass_cost"):
                if self.co.counters[name]:
                    event(f"counted {name}")

    # --------------------------------------------------------------------------------------- properties
    def _reclaimable(self, place):
        """Tokens held on ``place`` by programs with one answered turn and no turn since (no evidence of return)."""
        out = 0
        for sid in self.idle:
            if self.turns[sid] == 1 and self.kind[sid] != "call" and self.co.state_of(sid) is ProgramState.IN_TOOL:
                if self.lg.holding_place(sid) == self.lg.resolve_place(place):
                    out += self.lg.holding(sid)
        return out

    @invariant()
    def no_turn_waits_beside_room(self):
        if not hasattr(self, "co"):
            return
        lg = self.lg
        if lg.is_degraded(self.now):
            assert not self.waiting, "a turn waits while the capacity signal is missing"
            return
        for t, (sid, at, place, tokens) in self.waiting.items():
            waited = self.now - at
            allowed = self.places if self.movable and place is not None else [place]
            for pl in allowed:
                if lg.usage_of(pl) >= lg.pressure_threshold:
                    continue
                extra = self._reclaimable(pl) if waited >= POLL_S else 0
                charge = lg.charge(pl, tokens)
                fits = (lg.reserved_on(pl) - extra + charge <= lg.ceiling_of(pl)
                        and lg.reserved - extra + charge <= lg.ceiling)
                assert not fits, (f"{t} of {sid} ({self.kind[sid]}) waited {waited:.1f} s for {charge} tokens while "
                                  f"{pl} had room: reserved {lg.reserved_on(pl)} (reclaimable {extra}) of "
                                  f"{lg.ceiling_of(pl)}")

    @invariant()
    def no_wait_past_its_cost(self):
        if not hasattr(self, "co"):
            return
        for t, (sid, at, place, tokens) in self.waiting.items():
            assert self.now - at <= self.bound[t] + 1e-9, (
                f"{t} of {sid} waited {self.now - at:.3f} s; re-prefilling its {tokens} tokens costs "
                f"{self.bound[t]:.3f} s")

    @invariant()
    def no_ended_program_holds(self):
        if not hasattr(self, "co"):
            return
        for sid in self.ended:
            assert self.lg.holding(sid) == 0, f"{sid} ({self.kind[sid]}) ended but holds {self.lg.holding(sid)}"
        if self.lg.is_degraded(self.now):
            return  # nothing is paused without a capacity signal (fail-open)
        ended = sum(s["ended"] for s in self.co.program_states(self.now).values())
        assert ended == 0, f"{ended} programs idle past their predicted gap still hold their KV"


TestWorkConserving = WorkConserving.TestCase
TestWorkConserving.settings = settings(max_examples=400, stateful_step_count=60, deadline=None,
                                       suppress_health_check=[HealthCheck.too_slow])
