"""The admission shell: maps the pure coordinator's tickets to waiting requests (asyncio edge).

Flow per generate request:
  out of scope (or admission off) -> untouched, X-Kvgate-Admission: off
  protected -> bypass-protected; no fresh capacity snapshot -> bypass-degraded
  an earlier waiter or the ledger refuses -> wait in the one global FIFO (no upstream connection held)
  waited max_wait_s -> bypass-aged; FIFO empty and room -> admit with a lease
The lease is released when the upstream attempt ends (response relayed, error, or client gone).
A client that leaves while waiting is removed atomically (a lease granted in the same instant is
released). Every decision comes from the pure core (kvgate.admission.coordinator for ``admission_policy:
fifo``, kvgate.admission.program for ``program``); this module only delivers them and executes the
program policy's actions (closing a paused program's engine session through ``pause_session``).
Where a call goes was decided before admission, by the placement stage (RequestInfo.place: the engine kvgate
placed the session on, or the one the router named for its earlier turns; None: unknown, the fleet-wide rule
applies). A call kvgate places itself (RequestInfo.movable) that would wait on a full engine may be admitted on
another engine with room: the ticket's ``place`` says where, and the request path sends it there.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
from typing import Any, Callable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


from kvgate.admission.capacity import ClusterSnapshot, stale_after_s
from kvgate.admission.coordinator import ADMISSION_OFF, AdmissionCoordinator, Decision, Kind
from kvgate.admission.ledger import Ledger
from kvgate.admission.policy import ScopeRules, classify_scope
from kvgate.admission.program import ProgramCoordinator, ProgramState
from kvgate.admission.reservation import Estimator, load_tokenizer_counter
from kvgate.common.aio import cancel_tasks
from kvgate.common.memory import give_back
from kvgate.common.admission_seam import RequestInfo, Ticket
from kvgate.common.metrics import Metrics

log = logging.getLogger("kvgate.admission")

HEADER_DECISION = "X-Kvgate-Admission"
HEADER_QUEUE_MS = "X-Kvgate-Queue-Ms"
#: A FIFO that held at least this many requests gives their memory back once it empties (kvgate.common.memory).
GIVE_BACK_AFTER_WAITERS = 1000
#: Seconds after the FIFO empties: the waiters' handlers and connections have unwound by then.
GIVE_BACK_DELAY_S = 1.0
_QUEUE_MS_ZERO = (HEADER_QUEUE_MS, "0")  # most requests never wait: their header is made once
OFF_HEADERS = [(HEADER_DECISION, ADMISSION_OFF), (HEADER_QUEUE_MS, "0")]


class AdmissionGate:
    """Implements kvgate.common.admission_seam.Gate with the coordinator; ``poller`` feeds it capacity snapshots.

    cfg: the validated Config; metrics: the app's Metrics (series are added to its registry);
    clock: monotonic seconds; pause_session: called with a session id whose engine session the program policy
    wants closed.
    """

    reads_headers = True  # scope and protection rules read them

    def __init__(self, cfg, metrics: Metrics, clock: Callable[[], float] = time.monotonic, *,
                 pause_session: Callable[[str], Any] | None = None,
                 session_ended: Callable[[str], Any] | None = None):
        self.cfg = cfg
        self.clock = clock
        self.pause_session = pause_session
        self.session_ended = session_ended
        self.policy = cfg.admission_policy
        self.ledger = Ledger(headroom=cfg.agentic_admission_headroom,
                             pressure_threshold=cfg.agentic_admission_pressure_threshold,
                             stale_after_s=stale_after_s(cfg.admission_poll_interval_s),
                             lease_ttl_s=cfg.admission_lease_ttl_s, window_s=cfg.admission_window_s,
                             block_tokens=cfg.admission_prefix_block_tokens,
                             # A program between turns may sit in HiCache's host pool: SGLang loads it back
                             # instead of recomputing it. A request in flight needs the device pool: fifo.
                             count_host=self.policy == "program" and cfg.admission_host_cache)
        self._gate_seen = (0, 0, False)  # the pause gate's (opened, closed, foreseen) last logged
        self._has_actions = self.policy == "program"  # only the program policy asks the shell to act (pauses)
        if self.policy == "program":
            self.coord = ProgramCoordinator(self.ledger, cfg.agentic_admission_max_wait_s,
                                            window_s=cfg.admission_window_s, victim=cfg.admission_pause_victim,
                                            resume=cfg.admission_resume_order,
                                            program_ttl_s=cfg.admission_program_ttl_s,
                                            overdue_multiple=cfg.admission_program_overdue_multiple,
                                            overdue_default_s=cfg.admission_program_overdue_default_s,
                                            resume_deadline_s=cfg.admission_resume_deadline_s,
                                            max_resident=cfg.admission_program_max_resident,
                                            # KV held without evidence of return counts for one poll at most
                                            reclaim_after_s=cfg.admission_poll_interval_s,
                                            wait_bound=cfg.admission_wait_bound,
                                            pause_start_ratio=cfg.admission_pause_start_ratio,
                                            pause_stop_ratio=cfg.admission_pause_stop_ratio,
                                            # the re-prefill ratio now: over the last 20 polls (a window of
                                            # minutes would start pausing long after the KV began to thrash),
                                            # deciding nothing before 4 polls of answers
                                            pause_window_s=20 * cfg.admission_poll_interval_s,
                                            pause_min_span_s=4 * cfg.admission_poll_interval_s,
                                            pause_foresee_cycles=cfg.admission_foresee_cycles)
        else:
            self.coord = AdmissionCoordinator(self.ledger, cfg.agentic_admission_max_wait_s,
                                              window_s=cfg.admission_window_s, backfill=cfg.admission_backfill)
        self.rules = ScopeRules.from_config(cfg.agentic_admission_scope, cfg.admission_protected_rules,
                                            cfg.admission_eval_rules)
        self.tokenizer = load_tokenizer_counter(cfg.admission_tokenizer_file) if cfg.admission_tokenizer_file \
            else None
        self.metrics = metrics
        self.wait_hist = metrics.admission_wait
        metrics.registry.register(_AdmissionCollector(self))
        self._ids = itertools.count(1)
        self._futures: dict[int, asyncio.Future] = {}
        self._kick = asyncio.Event()
        self._timer: asyncio.Task | None = None
        self._sleep_until = -math.inf  # the deadline the timer sleeps to (inf: none; -inf: not sleeping)
        self._changed = asyncio.Event()
        self._watched = False  # a wait_until() caller holds self._changed: the next change must wake it
        # The settings every request's estimate reads, checked and looked up once.
        self._estimate = Estimator(expected_decode_cap=cfg.decode_cap, chars_per_token=cfg.admission_chars_per_token,
                                   tokenizer=self.tokenizer, context_length=cfg.admission_context_length,
                                   block_tokens=cfg.admission_prefix_block_tokens)
        self._peak_waiting = 0  # most requests waiting at once since the FIFO last emptied
        self._give_back: asyncio.TimerHandle | None = None
        self.given_back = 0  # times memory was given back after a drain
        # Replicas sharing state (kvgate.shared.redis_state.SharedState): a lease the ledger granted here
        # is also granted against the shared ceilings before the request goes out.
        self.shared = None
        self._shared_held: dict[int, tuple[list[str], str]] = {}
        self.shared_counts = {"granted": 0, "waited": 0, "aged": 0, "bypass": 0, "unreachable": 0}

    async def start(self) -> None:
        self._timer = asyncio.create_task(self._run_timer(), name="kvgate-admission-timer")

    async def stop(self) -> None:
        if self._give_back is not None:
            self._give_back.cancel()
        await cancel_tasks(self._timer)

    # --- the Gate protocol -------------------------------------------------------------------------

    async def acquire(self, info: RequestInfo) -> Ticket:
        c = info.classified
        body = c.body
        if not c.is_generate or body is None:
            return Ticket()  # not generation work: nothing to hold, no header
        protected, in_scope = classify_scope(c.path, info.headers, body, self.rules)
        if not in_scope:
            return Ticket(ADMISSION_OFF, headers=list(OFF_HEADERS))
        res = self._estimate(c.path, body, c.block_digests())
        del body  # a waiter keeps no reference to its parsed body (released below)
        ticket = next(self._ids)
        place = self._as_place(info.place)
        paused = (self.shared is not None and self.policy == "program" and info.session_id is not None
                  and await self._shared_paused(info.session_id, place))
        d = self.coord.submit(ticket, res.tokens, protected, self.clock(), place=place,
                              blocks=res.blocks, session_id=info.session_id, prompt_tokens=res.prompt_tokens,
                              movable=info.movable)
        if self._has_actions:
            self._run_actions()
        if self._watched:
            self._notify()
        if d.kind is Kind.WAIT:
            # A waiter holds only its raw bytes and the coordinator's record, not its parsed body (parsed
            # again if read after admission) nor its reservation (the record has the tokens and blocks).
            c.release_body()
            del res
            fut = asyncio.get_running_loop().create_future()
            self._futures[ticket] = fut
            self._peak_waiting = max(self._peak_waiting, len(self._futures))
            self.dispatch(self.coord.pump(self.clock()))  # retry on enqueue
            self._kick.set()  # the head's aging deadline may have changed
            try:
                d = await fut
            except asyncio.CancelledError:
                # Client gone while waiting: remove it, or release a lease granted in the same instant.
                if self.coord.cancel(ticket, self.clock()):
                    self.dispatch(self.coord.pump(self.clock()))
                raise
            finally:
                self._futures.pop(ticket, None)
                if not self._futures and self._peak_waiting >= GIVE_BACK_AFTER_WAITERS:
                    self._drained()
            self.wait_hist.observe(d.waited_s)
        waited = d.waited_s
        if paused:  # its program resumes (here): no replica holds it paused any more
            self.shared.program_unpaused(info.session_id)
        if self.shared is not None and d.lease is not None:
            try:
                # bypasses, and turns the policy never holds (a live program's next turn: a forced lease),
                # are held on the shared ceilings at once, without waiting
                waited += await self._shared_grant(ticket, d, force=d.kind.is_bypass or d.lease.forced)
            except asyncio.CancelledError:  # client gone while waiting for the shared ceiling
                self.dispatch(self.coord.release(ticket, self.clock()))
                raise
        self.coord.consumed(ticket)
        # bypasses hold a lease too (they never wait, but they count): release it like an admit's
        header = d.header
        moved = None
        if info.movable and d.lease is not None and d.lease.place != self.ledger.resolve_place(place):
            moved = self._as_target(d.lease.place)  # work-conserving: admitted on another engine with room
        return Ticket(header, waited, handle=ticket if d.lease is not None else None,
                      headers=[(HEADER_DECISION, header),
                               _QUEUE_MS_ZERO if not waited else (HEADER_QUEUE_MS, str(int(round(waited * 1000))))],
                      place=moved)

    async def _shared_grant(self, ticket: int, d: Decision, force: bool = False) -> float:
        """Hold the lease ``d`` granted here against the ceilings shared by every replica too (fleet, and
        its engine when known), in the one FIFO of every replica's waiters (kvgate.shared.redis_state,
        queue_grant): a replica admits only within what the others left, and only when no waiter of any
        replica arrived before. Refused: asked again as soon as any replica frees room, else after a short
        backoff (the answer keeps its place in the shared queue) until the rest of ``agentic_admission_max_wait_s``, then the request goes
        (counted ``aged``, as the ledger's aged bypass, and like it still reserving: its lease is forced
        in). ``force`` (a bypass here, protected or aged, or a turn the policy never holds: the program
        policy's continuing turns): held at once without waiting, so the other replicas count its tokens. Redis unreachable: it goes at once (fail-open).
        Returns the seconds spent waiting."""
        lease = d.lease
        keys = self.shared.lease_keys(lease.place)
        ceilings = [self.ledger.ceiling] + ([self.ledger.ceiling_of(lease.place)] if len(keys) > 1 else [])
        member = self.shared.lease_member(ticket, lease.charged)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        deadline = t0 + max(0.0, self.cfg.agentic_admission_max_wait_s - d.waited_s)
        delay, seq, aged = 0.005, 0, False
        try:
            while True:
                room = self.shared.room_event()  # taken before asking: a release meanwhile wakes it
                asked = self.shared.up
                r = await self.shared.queue_grant(keys, member, lease.charged, ceilings,
                                                  self.cfg.admission_lease_ttl_s, seq, self.cfg.admission_backfill,
                                                  force=force or aged)
                if r is None:
                    self.shared_counts["unreachable"] += 1
                    if asked:  # the call went out and failed: Redis may have granted it, so release it later
                        self._shared_held[ticket] = (keys, member)
                    break
                granted, seq = r
                if granted:
                    self._shared_held[ticket] = (keys, member)
                    if aged:
                        self.shared_counts["aged"] += 1
                    elif force:
                        self.shared_counts["bypass"] += 1
                    else:
                        self.shared_counts["granted"] += 1
                        self.shared_counts["waited"] += seq > 0
                    seq = 0
                    break
                if loop.time() >= deadline:
                    aged = True  # it goes now, still reserving: asked once more, forced
                    continue
                # Other replicas hold the room or wait before it: ask again when any replica frees room
                # (Redis pub/sub), else after a growing backoff (at most 0.2 s, well within the shared
                # queue's WAITER_TTL_S: a room that frees by lease expiry publishes nothing).
                try:
                    async with asyncio.timeout(min(delay, max(0.0, deadline - loop.time()))):
                        await room.wait()
                except TimeoutError:
                    delay = min(delay * 2, 0.2)
        finally:
            if seq:  # aged or cancelled while waiting in the shared queue: leave it
                self.shared.queue_leave(member)
        return loop.time() - t0

    def _drained(self) -> None:
        """The FIFO emptied after holding at least GIVE_BACK_AFTER_WAITERS requests: once their handlers have
        unwound (GIVE_BACK_DELAY_S later), give the memory they held back to the operating system."""
        self._peak_waiting = 0
        if self._give_back is None or self._give_back.cancelled():
            self._give_back = asyncio.get_running_loop().call_later(GIVE_BACK_DELAY_S, self._run_give_back)

    def _run_give_back(self) -> None:
        self._give_back = None
        if self._futures:  # a new burst: wait for it to drain too
            return
        took = give_back()
        self.given_back += 1
        self._notify()
        log.info("admission queue drained: memory given back in %.1f ms", took * 1000)

    async def _shared_paused(self, session_id: str, place: Any) -> bool:
        """Program policy, replicas sharing state: whether ``session_id``'s program is paused, here or by
        another replica (then adopted here as paused on ``place``, so its turn resumes by the resume rules)."""
        state = self.coord.state_of(session_id)
        if state is None:
            tokens = await self.shared.paused_program(session_id)
            if tokens is not None:
                self.coord.adopt_paused(session_id, place, tokens, self.clock())
                state = self.coord.state_of(session_id)
        return state is ProgramState.PAUSED

    @staticmethod
    def _as_place(where: tuple[str, int | None] | None) -> Any:
        """A RequestInfo place as the ledger's: engine URL, (URL, dp_rank), or None (unknown: fleet-wide)."""
        if where is None:
            return None
        url, rank = where
        return (url, rank) if rank is not None else url

    @staticmethod
    def _as_target(place: Any) -> tuple[str, int | None] | None:
        """The ledger's place as (engine URL, DP rank or None); None for the fleet."""
        if place is None:
            return None
        return (place[0], place[1]) if isinstance(place, tuple) else (place, None)

    def release(self, ticket: Ticket, observed: dict | None = None) -> None:
        """The upstream attempt ended; ``observed``: the response's meta_info (prompt_tokens,
        completion_tokens, cached_tokens) when read, for the program policy's working set."""
        if ticket.handle is not None:
            held = self._shared_held.pop(ticket.handle, None)
            if held is not None:
                self.shared.lease_release(*held)
            now = self.clock()
            out = self.coord.release(ticket.handle, now, observed)
            # The timer is woken only when a deadline now comes before the one it sleeps until: a lease granted
            # since it went to sleep (grants do not wake it), a program's idle end (the program policy). A
            # release that frees the last lease leaves nothing to watch: no wake-up per request.
            nxt = self.coord.next_deadline(now)
            self.dispatch(out, kick=bool(out) or (nxt is not None and nxt < self._sleep_until))

    def forget(self, session_id: str) -> None:
        """The client ended ``session_id``: its program (and resident KV) ends."""
        if self.shared is not None and self.policy == "program":
            self.shared.program_unpaused(session_id)
        self.coord.forget(session_id, self.clock())
        self.dispatch(self.coord.pump(self.clock()))

    def _run_actions(self) -> None:
        for a in self.coord.take_actions():
            if a.kind == "ended" and self.session_ended is not None:
                self.session_ended(a.session_id)  # never raises (the shell counts its own faults)
            if a.kind != "close" or self.pause_session is None:
                continue
            if self.shared is not None:  # its next turn through any replica resumes it
                self.shared.program_paused(a.session_id, self.coord.resident_of(a.session_id),
                                           self.cfg.admission_program_ttl_s)
            try:
                self.pause_session(a.session_id)
            except Exception:  # a failed close only leaves the KV to the engine's LRU
                log.exception("closing paused session %s failed", a.session_id)
                self.metrics.faults.labels("admission").inc()

    # --- feeding the core --------------------------------------------------------------------------

    def dispatch(self, decisions: list[Decision], kick: bool = True) -> None:
        """Deliver each decision to its waiter; a waiter that is gone gets its grant cancelled. ``kick``:
        wake the timer to recompute its deadline (False only when no deadline can have come sooner)."""
        for d in decisions:
            fut = self._futures.get(d.ticket)
            if fut is not None and not fut.done():
                fut.set_result(d)
            elif self.coord.cancel(d.ticket, self.clock()):
                self.dispatch(self.coord.pump(self.clock()))
        if self._has_actions:
            self._run_actions()
        if kick:
            self._kick.set()
        self._notify()

    def _notify(self) -> None:
        # Wakes wait_until() callers; a fresh Event each time so a late waiter never sees a stale set.
        # Nobody watching (the usual case: every request calls this): nothing to wake, no Event to make.
        if self._watched:
            self._watched = False
            self._changed.set()
            self._changed = asyncio.Event()

    async def wait_until(self, predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
        """Wait until ``predicate()`` holds, re-checking whenever the queue or the ledger changes
        (submit, grant, release, cancel, reconcile). Raises asyncio.TimeoutError after ``timeout_s``."""
        async def _wait() -> None:
            while not predicate():
                self._watched = True
                await self._changed.wait()
        await asyncio.wait_for(_wait(), timeout_s)

    def reconcile(self, snapshot: ClusterSnapshot) -> None:
        """A new capacity snapshot from the poller (taken at snapshot.taken_at)."""
        self.dispatch(self.coord.reconcile(snapshot, self.clock()))
        if self.policy == "program":
            self._log_pause_gate()

    def _log_pause_gate(self) -> None:
        # Once a poll: say when the program policy starts or stops pausing, and the ratio that decided it.
        # And, once, the foresight read when an engine's KV first overflowed (it opens the gate at its ratio).
        g = self.coord.gate
        seen = (g.opened, g.closed, g.foresight_first is not None)
        if seen == self._gate_seen:
            return
        first, turned = seen[2] and not self._gate_seen[2], seen[:2] != self._gate_seen[:2]
        self._gate_seen = seen
        ratio = g.ratio(self.clock(), len(self.ledger.engine_places()))
        if first:
            log.info("admission: an engine's working set outgrew its ceiling (or turns waited on it while pausing was "
                     "on); prefilling a whole ceiling takes %.2f "
                     "program cycles there (%s)", g.foresight_first,
                     "pausing is always on: admission_pause_start_ratio 0" if not g.start_ratio else
                     f"pausing starts at {g.foresee_cycles:g}" if g.foresee_cycles else "foresight off")
        if turned:
            by, reading = g.turned_by  # set whenever it opens or closes
            measured = "unknown" if ratio is None else f"{ratio:.2f}"
            if not g.is_open:
                why = (f"the re-prefill ratio fell to {reading:.2f}, below admission_pause_stop_ratio {g.stop_ratio:g}"
                       + (f", and no foresight reading reached {g.foresee_cycles:g} for {g.window_s:g} s"
                          if g.foresee_cycles else ""))
            elif by == "foresight":
                why = (f"prefilling a whole ceiling takes {reading:.2f} program cycles, at least "
                       f"admission_foresee_cycles {g.foresee_cycles:g} (re-prefill ratio {measured}; it stops below "
                       f"{g.stop_ratio:g} once no reading reached {g.foresee_cycles:g} for {g.window_s:g} s)")
            else:
                why = (f"the re-prefill ratio reached {reading:.2f}, at least admission_pause_start_ratio "
                       f"{g.start_ratio:g} (it stops below {g.stop_ratio:g})")
            log.info("admission: pausing %s: %s", "on" if g.is_open else "off", why)

    def invalidate(self) -> None:
        """No capacity signal at all: degraded at once, every waiter bypasses."""
        self.dispatch(self.coord.invalidate(self.clock()))

    async def _run_timer(self) -> None:
        # Aging, staleness and lease TTL have deadlines; sleep until the next one or until kicked.
        while True:
            now = self.clock()
            deadline = self.coord.next_deadline(now)
            self._kick.clear()
            timeout = None if deadline is None else max(0.0, deadline - now) + 1e-3
            self._sleep_until = math.inf if deadline is None else deadline
            try:
                # not wait_for: see kvgate.common.aio
                async with asyncio.timeout(timeout):
                    await self._kick.wait()
            except TimeoutError:
                pass
            finally:
                self._sleep_until = -math.inf
            try:
                self.dispatch(self.coord.pump(self.clock()))
            except Exception:  # a core fault must not stop the timer; requests would wait to max_wait
                log.exception("admission pump failed")
                self.metrics.faults.labels("admission").inc()
                await asyncio.sleep(0.1)

    def stats(self) -> dict[str, Any]:
        """GET /kvgate/stats: the coordinator's and ledger's figures (JSON)."""
        out = {"admission": "on", "policy": self.policy, **self.coord.stats(self.clock()),
               "memory_given_back": self.given_back}
        if self.shared is not None:
            out["shared_leases"] = {**self.shared_counts, "held": len(self._shared_held)}
        return out


class _AdmissionCollector:
    """Exposes the coordinator's and ledger's figures at scrape time (one source of truth)."""

    def __init__(self, gate: AdmissionGate):
        self.gate = gate

    def describe(self):
        return []

    def collect(self):
        g = self.gate
        s = g.coord.stats(g.clock())
        led = s["ledger"]
        p = "agentic_kv_"
        c = s["counters"]
        for name, key, doc in (("admission_admit", "admit", "Requests admitted with a lease"),
                               ("admission_wait", "wait", "Requests that had to wait in the FIFO"),
                               ("admission_cancelled", "cancelled", "Waiters whose client left before admission")):
            m = CounterMetricFamily(p + name, doc)
            m.add_metric([], c[key])
            yield m
        if g.shared is not None:
            m = CounterMetricFamily(p + "admission_shared_leases", "Leases held against the ceilings shared by "
                                    "replicas (state_backend: redis), by result: granted (waited: after other "
                                    "replicas freed room or waited before it), aged (went after max_wait, still "
                                    "reserving), bypass (held at once: a protected or aged bypass here, or a turn "
                                    "the policy never holds), "
                                    "unreachable (Redis down: went at once)", labels=["result"])
            for result, n in g.shared_counts.items():
                m.add_metric([result], n)
            yield m
        m = CounterMetricFamily(p + "admission_bypass", "Requests that bypassed the FIFO, by reason", labels=["reason"])
        for reason in ("protected", "degraded", "aged", "cost"):
            if "bypass_" + reason in c:  # cost: the program policy's alone
                m.add_metric([reason], c["bypass_" + reason])
        yield m
        gauges = [
            ("admission_waiting", s["waiting"], "Requests waiting in the FIFO now"),
            ("admission_defer_rate", s["defer_rate"], "wait / (admit + wait + bypass) over the window"),
            ("admission_degraded_rate", s["degraded_rate"], "bypass_degraded / (admit + wait + bypass) over the window"),
            ("budget_ceiling_tokens", led["ceiling"], "Sum of healthy engines' max_total_num_tokens x headroom"),
            ("budget_reserved_tokens", led["reserved"], "Tokens reserved by live leases"),
            ("budget_available_tokens", led["available_tokens"], "ceiling - reserved"),
            ("budget_reserved_utilization", led["reserved_utilization"], "reserved / ceiling"),
            ("budget_lease_count", led["lease_count"], "Live leases"),
            ("budget_epoch", led["epoch"], "Increments when the set of healthy engines changes"),
            ("budget_degraded", 1 if led["degraded"] else 0, "1 when the capacity signal is missing or stale"),
            ("kv_token_usage_mean", led["kv_token_usage_mean"], "Mean fleet token_usage over the window"),
            ("kv_token_usage_max", led["kv_token_usage_max"], "Max worst-engine token_usage over the window"),
        ]
        for name, value, doc in gauges:
            if value is None:
                continue
            m = GaugeMetricFamily(p + name, doc)
            m.add_metric([], float(value))
            yield m
        m = CounterMetricFamily(p + "budget_lease_expired", "Stranded leases reclaimed by TTL")
        m.add_metric([], led["lease_expired"])
        yield m
        m = CounterMetricFamily(p + "admission_backfilled", "Requests admitted ahead of a waiting head (backfill)")
        m.add_metric([], c.get("backfilled", 0))
        yield m
        yield from _program_metrics(s, p)


def _program_metrics(s: dict[str, Any], p: str):
    """The program policy's series: programs by engine and state, pauses and resumes by engine."""
    if s.get("policy") != "program":
        return
    m = GaugeMetricFamily(p + "programs", "Programs (sessions) by engine and state: live (a turn in flight), "
                          "in_tool (between turns), paused (held by kvgate)", labels=["engine", "state"])
    for engine, states in sorted(s["programs"].items()):
        for state, n in sorted(states.items()):
            m.add_metric([engine, state], n)
    yield m
    for name, key, doc in (("program_pauses", "pauses", "Programs paused (engine session closed) by engine"),
                           ("program_resumes", "resumes", "Paused programs resumed by engine")):
        m = CounterMetricFamily(p + name, doc, labels=["engine"])
        for engine, n in sorted(s[key].items()):
            m.add_metric([engine], n)
        yield m
    m = GaugeMetricFamily(p + "program_waiting_resume", "Turns of paused programs waiting to resume")
    m.add_metric([], s["waiting_resume"])
    yield m
    m = GaugeMetricFamily(p + "program_waiting_bound", "Turns waiting for a seat under "
                          "admission_program_max_resident (reason resident-bound)")
    m.add_metric([], s["waiting_bound"])
    yield m
    m = CounterMetricFamily(p + "program_resident_bound_waits", "Turns that had to wait for a seat under "
                            "admission_program_max_resident")
    m.add_metric([], s["counters"]["wait_resident_bound"])
    yield m
    m = GaugeMetricFamily(p + "program_seats_kept", "Seats kept for paused programs expected back, by engine "
                          "(admission_program_max_resident)", labels=["engine"])
    for engine, seat in sorted(s["seats"].items()):
        m.add_metric([engine], seat["kept_for_paused"])
    yield m
    m = CounterMetricFamily(p + "program_prefix_miss_tokens", "Tokens of a live program's own prefix the engine "
                            "no longer had cached at its next turn (evicted during the tool call)")
    m.add_metric([], s["counters"]["prefix_miss_tokens"])
    yield m
    for name, key, doc in (
            ("program_moved", "moved", "Turns admitted on another engine with room than the one they were placed on"),
            ("program_reclaimed", "reclaimed", "Programs paused because they held KV without evidence of return "
                                               "(one answered turn, no gap seen) while a turn waited a poll interval"),
            ("program_ended_paused", "pause_overdue", "Programs paused as they turned ended (idle past what their "
                                                      "own and their group's gaps between turns predict)"),
            ("program_admitted_not_pausing", "admit_gate_closed", "First turns and paused programs' turns admitted "
                                                                  "at once because re-prefill costs too little for "
                                                                  "pausing to pay (the pause gate was closed)"),
            ("program_transfer_refill_tokens", "transfer_refill_tokens", "Tokens of a program's own context a PD "
             "decode worker no longer held, sent again by the prefill worker (a transfer, not a re-prefill)")):
        m = CounterMetricFamily(p + name, doc)
        m.add_metric([], s["counters"][key])
        yield m
    gate = s["pause_gate"]
    m = GaugeMetricFamily(p + "program_pausing", "1 while the program policy holds turns and pauses programs (the "
                          "re-prefill ratio reached admission_pause_start_ratio, or its foresight "
                          "admission_foresee_cycles), 0 while every turn goes at once")
    m.add_metric([], 1.0 if gate["open"] else 0.0)
    yield m
    m = GaugeMetricFamily(p + "program_reprefill_ratio", "Call seconds spent re-prefilling KV the engines had "
                          "evicted, per engine second, over the last 20 capacity polls (NaN before it is measured)")
    m.add_metric([], float("nan") if gate["ratio"] is None else gate["ratio"])
    yield m
    m = GaugeMetricFamily(p + "program_pause_foresight", "Program cycles (turn + tool call) an engine needs to "
                          "prefill a whole ceiling, read when its working set last outgrew it, or turns waited on it while "
                          "pausing was on (NaN before either)")
    m.add_metric([], float("nan") if gate["foresight"] is None else gate["foresight"])
    yield m
    m = CounterMetricFamily(p + "program_reprefill_tokens", "Tokens of programs' own context the engines "
                            "re-prefilled (cached_tokens below what the program held, resumed programs included)")
    m.add_metric([], gate["reprefill_tokens"])
    yield m
