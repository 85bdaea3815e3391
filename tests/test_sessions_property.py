"""Property test of the session lifecycle's pure core (registry, step tracker, client aborts) over random
interleavings of turns, aborts (client-asked and step boundaries), abandoned attempts and their retries,
closes (client, admin_api, idle, asked again), engine outages, calls that are lost or answered late, cache
flushes and time. Engines follow SGLang 0.5.17+ (python/sglang/srt/mem_cache/unified_cache/session_ref_tracker.py):
a request with an id re-opens it (tombstone cleared) and a completed one references its KV; a close drops the
references and tombstones the id; a flush drops every reference.

After everything ends (every engine back, every call answered, every retry due, failed closes asked again):
every closed session holds no references on any engine, no session is left closing, and every continuing
session's KV is referenced on the engine of its last completed turn (unless a flush or a close asked for
since dropped it) under an id that engine accepts. Deterministic: the core is driven with a hand clock, calls are delivered by the test.
Set KVGATE_PROPERTY_EXAMPLES for a longer run.
"""

from __future__ import annotations

import os

from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvgate.sessions.idle_policy import ClientAborts, StepTracker, ends_session
from kvgate.sessions.registry import ACTIVE, CLOSED, CLOSING, FAILED, PENDING, SENDING, CloseRetry, SessionRegistry

ENGINES = ["http://e0", "http://e1"]
SESSIONS = ["s0", "s1"]
OPEN, ACCEPTED, TOMBSTONED = "open", "accepted", "tombstoned"  # an engine's view of one session id


class Engine:
    """A simulated engine's session references, 0.5.17+ semantics."""

    def __init__(self) -> None:
        self.up = True
        self.ids: dict[str, str] = {}

    def request(self, sid: str, completed: bool) -> None:
        if completed:
            self.ids[sid] = OPEN  # re-opened if it was closed, and its KV referenced
        elif self.ids.get(sid) == TOMBSTONED:
            self.ids[sid] = ACCEPTED  # re-opened; an aborted request registers no references

    def close(self, sid: str) -> None:
        self.ids[sid] = TOMBSTONED

    def flush(self) -> None:
        self.ids = {s: (ACCEPTED if v == OPEN else v) for s, v in self.ids.items()}


class LifecycleMachine(RuleBasedStateMachine):
    @initialize(retries=st.sampled_from([0, 2, 5]), backoff=st.sampled_from([0.5, 2.0]))
    def setup(self, retries, backoff):
        self.reg = SessionRegistry(max_sessions=100, wall=lambda: 0.0,
                                   retry=CloseRetry(retries=retries, backoff_s=backoff, max_backoff_s=8.0))
        self.steps = StepTracker()
        self.aborts = ClientAborts()
        self.engines = {u: Engine() for u in ENGINES}
        self.now = 0.0
        self.wire: list[tuple[str, int, str]] = []  # close calls sent, not answered yet
        self.last_engine: dict[str, str] = {}       # engine of each session's last completed turn
        self.dropped_since: dict[str, bool] = {}    # a flush or a close came after that turn
        self.rid = 0

    # --- the shell, as kvgate.sessions.lifecycle does it -------------------------------------------

    def _close(self, sid: str, reason: str) -> None:
        s = self.reg.get(sid)
        fresh = s is None or s.state == ACTIVE
        if not self.reg.begin_close(sid, reason, self.now):
            return
        self.dropped_since[sid] = True
        if fresh and reason in ("idle", "abort") and not self.steps.has_kv(sid):
            self.reg.skip_close(sid, self.now)
            return
        gen = self.reg.get(sid).close_gen
        self.wire += [(sid, gen, u) for u in self.reg.to_send(sid, ENGINES, self.now)]

    def _answer(self, i: int, fate: str) -> None:
        sid, gen, url = self.wire.pop(i)
        eng = self.engines[url]
        if not eng.up:
            result = "connect error"
        elif fate == "ok":
            eng.close(sid)
            result = "ok"
        elif fate == "late":  # the engine has it, kvgate timed out first
            eng.close(sid)
            result = "timeout after 0.5s"
        else:  # lost on the way: the engine never had it
            result = "timeout after 0.5s"
        self.reg.close_result(sid, gen, url, result, self.now)

    # --- rules ---------------------------------------------------------------------------------------

    @rule(sid=st.sampled_from(SESSIONS), url=st.sampled_from(ENGINES),
          outcome=st.sampled_from(["complete", "complete", "abandoned", "abort-step", "abort-client"]))
    def turn(self, sid, url, outcome):
        """One turn on an engine that is up (the router sends none to a down one). A retried turn is
        another turn of the same session; an abandoned attempt is one the client gave up on."""
        eng = self.engines[url]
        if not eng.up:
            return
        # before_turn: close calls of this session on the wire are answered before the request goes out
        for i in reversed([i for i, w in enumerate(self.wire) if w[0] == sid]):
            self._answer(i, "ok")
        self.reg.request_started(sid, "header", self.now)
        self.steps.on_kv(sid)
        completed = outcome != "abandoned" and not outcome.startswith("abort")
        eng.request(sid, completed)
        rid = f"r{self.rid}"
        self.rid += 1
        if outcome == "abort-client":
            self.aborts.note(rid)
        self.reg.request_finished(sid, self.now, None)
        self.steps.on_kv(sid)
        if completed:
            self.last_engine[sid] = url
            self.dropped_since[sid] = False
        if ends_session("abort" if outcome.startswith("abort") else None) and self.aborts.asked(rid):
            self._close(sid, "abort")

    @rule(sid=st.sampled_from(SESSIONS), reason=st.sampled_from(["client", "admin_api", "idle"]))
    def close(self, sid, reason):
        if reason == "idle" and (self.reg.get(sid) is None or self.reg.get(sid).state != ACTIVE):
            return  # the idle sweep only closes active sessions
        self._close(sid, reason)

    @precondition(lambda self: self.wire)
    @rule(i=st.integers(0, 50), fate=st.sampled_from(["ok", "ok", "lost", "late"]))
    def answer(self, i, fate):
        self._answer(i % len(self.wire), fate)

    @rule(url=st.sampled_from(ENGINES))
    def outage(self, url):
        self.engines[url].up = not self.engines[url].up

    @precondition(lambda self: all(e.up for e in self.engines.values()))
    @rule()
    def flush(self):
        """A step boundary relayed by kvgate (/flush_cache, a weight update): every engine drops its KV."""
        for e in self.engines.values():
            e.flush()
        assert self.steps.on_boundary("/flush_cache", 200, None)
        for sid in self.dropped_since:
            self.dropped_since[sid] = True

    @rule(dt=st.sampled_from([0.1, 1.0, 3.0, 10.0]))
    def advance(self, dt):
        self.now += dt
        self.wire += self.reg.due_retries(self.now)

    # --- invariants ----------------------------------------------------------------------------------

    @invariant()
    def counts_match_the_records(self):
        if not hasattr(self, "reg"):
            return
        c = {SENDING: 0, PENDING: 0}
        for sid in SESSIONS:
            s = self.reg.get(sid)
            if s is None:
                continue
            for e in s.engine_closes.values():
                if e.state in c:
                    c[e.state] += 1
            assert (s.state == CLOSING) == bool(s.unfinished()) or (s.state == CLOSING and not s.engine_closes)
        assert self.reg.close_counts() == c
        assert c[SENDING] == len(self.wire)  # every call marked sending is on the wire, and only those

    def teardown(self):
        if not hasattr(self, "reg"):
            return
        for e in self.engines.values():
            e.up = True
        for _ in range(1000):
            while self.wire:
                self._answer(0, "ok")
            for sid in SESSIONS:  # the client (or the API) asks again for closes that were given up
                s = self.reg.get(sid)
                if s is not None and s.state == CLOSED and any(e.state == FAILED for e in s.engine_closes.values()):
                    self._close(sid, "client")
            nxt = self.reg.next_due()
            if not self.wire and nxt is None:
                break
            if nxt is not None:
                self.now = max(self.now, nxt)
                self.wire += self.reg.due_retries(self.now)
        assert not self.wire and self.reg.close_counts() == {SENDING: 0, PENDING: 0}
        for sid in SESSIONS:
            s = self.reg.get(sid)
            if s is None:
                continue
            assert s.state != CLOSING, (sid, s)
            if s.state == CLOSED:
                held = [u for u, e in self.engines.items() if e.ids.get(sid) == OPEN]
                assert not held, f"{sid} closed in kvgate but still referenced on {held}"
            elif sid in self.last_engine and not self.dropped_since[sid]:
                view = self.engines[self.last_engine[sid]].ids.get(sid)
                assert view == OPEN, f"{sid} continues but its last engine has it {view}"


LifecycleMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("KVGATE_PROPERTY_EXAMPLES", "100")), stateful_step_count=50, deadline=None)
TestLifecycleProperty = LifecycleMachine.TestCase
