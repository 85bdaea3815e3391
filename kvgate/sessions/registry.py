"""The session registry: what kvgate knows of each session, and when one should close (pure).

No I/O and no clock of its own: every call takes ``now`` (monotonic seconds). The shell
(kvgate.sessions.lifecycle) turns its decisions into /close_session calls.

A session moves active -> closing -> closed. A close is tracked per engine: each engine's close is
``sending`` (a call is out), ``pending`` (it failed: connect error, timeout, 5xx; retried after a
backoff), ``ok`` or ``failed`` (a 4xx, or retries used up). The session is ``closed`` once no engine
is sending or pending. A timeout is not success: the engine may not have the close, and a close is
idempotent on the engine (docs/simulator-fidelity.md, Sessions), so it is sent again.

A request for a closing or closed session re-opens it (SGLang 0.5.17+ re-opens and re-tags an id it
closed on the next request that carries it: mem_cache/unified_cache/session_ref_tracker.py,
ensure_session_generation): its pending retries are cancelled, since a late close would drop the
references of the continued session. Asking to close again (the client, the API) re-arms an
unfinished close at once, with fresh attempts.
"""

from __future__ import annotations

import heapq
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from types import MappingProxyType
from collections.abc import Mapping
from typing import Any

ACTIVE, CLOSING, CLOSED = "active", "closing", "closed"
SENDING, PENDING, OK, FAILED = "sending", "pending", "ok", "failed"
#: The last result of a close dropped because its engine left the fleet (the router no longer lists it).
ENGINE_GONE = "dropped: engine left the fleet"


@dataclass(frozen=True)
class CloseRetry:
    """How an engine's failed close is retried: after ``backoff_s`` x 2^(attempt-1) seconds, at most
    ``max_backoff_s``, for up to ``retries`` retries after the first attempt (then ``failed``)."""

    retries: int = 10
    backoff_s: float = 0.5
    max_backoff_s: float = 60.0

    def delay(self, attempts: int) -> float:
        """Seconds before the next try after ``attempts`` failed ones (>= 1)."""
        return min(self.max_backoff_s, self.backoff_s * (2 ** min(attempts - 1, 30)))


@dataclass(slots=True)
class EngineClose:
    """One engine's part of a session's close: state (sending|pending|ok|failed), failed attempts,
    the last result text ("ok" or an error) and, when pending, when the next try is due (monotonic s)."""

    state: str = SENDING
    attempts: int = 0
    last: str = "not attempted"
    next_at: float = 0.0


#: A session's engine closes before its first close: one shared read-only empty mapping, not a dict per
#: session (begin_close gives the session its own dict).
_NO_CLOSES: Mapping[str, EngineClose] = MappingProxyType({})


@dataclass(slots=True)
class Session:
    """One session's record. Times are monotonic seconds; wall times (for display) are epoch seconds.
    Slotted (no per-record __dict__): kvgate tracks up to max_tracked_sessions of them."""

    session_id: str
    source: str | None
    first_seen: float
    last_seen: float
    first_seen_wall: float
    state: str = ACTIVE
    turns: int = 0
    in_flight: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    retractions: int = 0  # times an engine retracted one of its turns (meta_info.num_retractions)
    usage_source: str | None = None
    close_reason: str | None = None
    closed_at: float | None = None
    engine_closes: dict[str, EngineClose] = field(default_factory=lambda: _NO_CLOSES)  # type: ignore[arg-type]
    close_gen: int = 0
    closes: int = 0
    reopened: int = 0
    parent: str | None = None  # the session a subagent's session belongs to (x-dynamo-parent-session-id)
    closed_elsewhere: bool = False  # its last close was another replica's (state_backend: redis): no calls here

    @property
    def close_results(self) -> dict[str, str]:
        """The last result per engine of the current (or last) close: "ok" or an error text."""
        return {u: e.last for u, e in self.engine_closes.items() if e.state != SENDING or e.attempts}

    def unfinished(self) -> list[str]:
        """Engines whose close is still sending or pending."""
        return [u for u, e in self.engine_closes.items() if e.state in (SENDING, PENDING)]

    def as_json(self, now: float, children: list[str] | None = None) -> dict[str, Any]:
        """A JSON-able view; ages are seconds before ``now``; ``children``: the subagents' sessions linked to
        this one (listed under it)."""
        return {
            "session_id": self.session_id,
            "source": self.source,
            "parent": self.parent,
            "children": children or [],
            "state": self.state,
            "turns": self.turns,
            "in_flight": self.in_flight,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
            "retractions": self.retractions,
            "usage_source": self.usage_source,
            "first_seen_unix": round(self.first_seen_wall, 3),
            "age_s": round(now - self.first_seen, 3),
            "idle_s": round(now - self.last_seen, 3) if self.in_flight == 0 else 0.0,
            "close_reason": self.close_reason,
            "closes": self.closes,
            "reopened": self.reopened,
            "close_results": self.close_results,
            "closed_by_other_replica": self.closed_elsewhere,
            "close_pending": {u: {"state": e.state, "attempts": e.attempts, "last": e.last,
                                  "retry_in_s": round(max(0.0, e.next_at - now), 3) if e.state == PENDING else None}
                              for u, e in self.engine_closes.items() if e.state in (SENDING, PENDING)},
        }


class SessionRegistry:
    """Tracks sessions by id, bounded to ``max_sessions`` (the oldest idle dropped first, counted; a session
    whose close is unfinished is never dropped). ``retry``: how failed engine closes are retried.

    Methods take ``now`` in monotonic seconds; ``wall`` is only used for display.
    """

    def __init__(self, max_sessions: int = 100_000, wall=time.time, retry: CloseRetry | None = None):
        self.max_sessions = max_sessions
        self.retry = retry or CloseRetry()
        self._wall = wall
        # Ordered by last activity: the first entry is the longest idle (move_to_end on each touch).
        self._sessions: OrderedDict[str, Session] = OrderedDict()
        self._closing: dict[str, None] = {}  # sessions in CLOSING (their closes are unfinished)
        self._due: list[tuple[float, str, int, str]] = []  # heap of (next_at, sid, close_gen, url)
        self.dropped = 0
        # Engine close calls: ok, failed attempts, retries sent, given up (retries used up or 4xx),
        # cancelled (the session came back before the engine had the close), dropped (its engine left the
        # fleet while the close waited for a retry).
        self.close_stats = {"ok": 0, "failed_attempts": 0, "retries": 0, "given_up": 0, "cancelled": 0,
                            "dropped": 0}
        self._unfinished = {SENDING: 0, PENDING: 0}  # engine closes by state, kept as they move
        # parent session id -> its subagents' session ids (insertion-ordered), for listing and for closing
        # them with the parent; an entry goes when its last child leaves the registry.
        self._children: dict[str, dict[str, None]] = {}

    def _move(self, e: EngineClose, state: str) -> None:
        if e.state in self._unfinished:
            self._unfinished[e.state] -= 1
        if state in self._unfinished:
            self._unfinished[state] += 1
        e.state = state

    def __len__(self) -> int:
        return len(self._sessions)

    def get(self, session_id: str) -> Session | None:
        return self._sessions.get(session_id)

    def _new(self, session_id: str, source: str | None, now: float) -> Session:
        s = Session(session_id, source, now, now, self._wall())
        self._sessions[session_id] = s
        self._evict_over_cap(keep=session_id)
        return s

    def request_started(self, session_id: str, source: str | None, now: float) -> Session:
        """Record the start of one request (one turn) of ``session_id``; returns its record. A closing or
        closed session re-opens: its unfinished engine closes are cancelled."""
        s = self._sessions.get(session_id)
        if s is None:
            s = self._new(session_id, source, now)
        else:
            self._sessions.move_to_end(session_id)
            if s.state != ACTIVE:
                self._reopen(s)
        s.turns += 1
        s.in_flight += 1
        s.last_seen = now
        return s

    def _reopen(self, s: Session) -> None:
        self.close_stats["cancelled"] += len(s.unfinished())
        for e in s.engine_closes.values():
            self._move(e, OK if e.state == OK else FAILED)  # out of the unfinished counts
        s.state = ACTIVE
        s.reopened += 1
        s.close_reason = None
        s.closed_elsewhere = False
        s.close_gen += 1  # results of calls still out are ignored
        s.engine_closes = _NO_CLOSES  # type: ignore[assignment]
        self._closing.pop(s.session_id, None)

    def request_finished(self, session_id: str, now: float, meta: dict[str, Any] | None = None,
                         usage_source: str | None = None) -> None:
        """Record the end of one request; ``meta`` holds its token counts if seen (prompt_tokens,
        completion_tokens, cached_tokens; num_retractions on /generate) and ``usage_source`` says where they
        came from (meta_info, usage, counted)."""
        s = self._sessions.get(session_id)
        if s is None:
            return
        s.in_flight = max(0, s.in_flight - 1)
        s.last_seen = now
        self._sessions.move_to_end(session_id)
        if meta:
            s.prompt_tokens += _int(meta.get("prompt_tokens"))
            s.completion_tokens += _int(meta.get("completion_tokens"))
            s.cached_tokens += _int(meta.get("cached_tokens"))
            s.retractions += _int(meta.get("num_retractions"))
            if usage_source:
                s.usage_source = usage_source

    def request_refused(self, session_id: str) -> bool:
        """Record the end of a request of ``session_id`` the upstream refused (a 4xx: nothing ran on an engine):
        it is no turn, so the turn :meth:`request_started` counted is taken back. A session no turn is left of
        (active, none in flight: refused requests alone made it) is dropped. Returns True when it was dropped."""
        s = self._sessions.get(session_id)
        if s is None:
            return False
        s.in_flight = max(0, s.in_flight - 1)
        s.turns = max(0, s.turns - 1)
        if s.turns == 0 and s.in_flight == 0 and s.state == ACTIVE:
            self._unlink(s)
            del self._sessions[session_id]
            return True
        return False

    def link_parent(self, session_id: str, parent: str) -> bool:
        """Record that ``session_id`` is a subagent's session of ``parent`` (which may not be tracked yet). A
        session names one parent: a later, different parent moves it. False when nothing changed (unknown
        session, the same parent already, or the session named itself)."""
        s = self._sessions.get(session_id)
        if s is None or parent == session_id or s.parent == parent:
            return False
        if s.parent is not None:
            self._unlink(s)
        s.parent = parent
        self._children.setdefault(parent, {})[session_id] = None
        return True

    def _unlink(self, s: Session) -> None:
        kids = self._children.get(s.parent) if s.parent is not None else None
        if kids is not None:
            kids.pop(s.session_id, None)
            if not kids:
                del self._children[s.parent]

    def children(self, session_id: str) -> list[str]:
        """The subagents' sessions linked to ``session_id``, in the order they were linked."""
        kids = self._children.get(session_id)
        return list(kids) if kids else []

    def session_json(self, session_id: str, now: float) -> dict[str, Any] | None:
        """One session as JSON, its children listed under it; None when it is not tracked."""
        s = self._sessions.get(session_id)
        return s.as_json(now, self.children(session_id)) if s is not None else None

    def touch(self, session_id: str, last_seen: float) -> None:
        """Another replica served ``session_id`` at ``last_seen`` (monotonic s, this replica's clock):
        its last activity moves forward to it (never back)."""
        s = self._sessions.get(session_id)
        if s is not None and last_seen > s.last_seen:
            s.last_seen = last_seen
            self._sessions.move_to_end(session_id)

    # --- closing -----------------------------------------------------------------------------------

    def begin_close(self, session_id: str, reason: str, now: float) -> bool:
        """Ask for a session's close. True when the caller should send closes (:meth:`to_send`): the session
        was active, or its close was unfinished or had failed on an engine (asking again re-arms those
        engines at once, with fresh attempts). False when it is closed on every engine it was sent to, or
        its calls are all still out. An id never seen is registered, so its close shows in the registry
        (a client may close a session kvgate did not route)."""
        s = self._sessions.get(session_id)
        if s is None:
            s = self._new(session_id, None, now)
        if s.state == ACTIVE:
            s.state = CLOSING
            s.close_reason = reason
            s.closed_elsewhere = False
            s.close_gen += 1
            s.engine_closes = {}
            self._closing[session_id] = None
            return True
        rearm = [e for e in s.engine_closes.values() if e.state in (PENDING, FAILED)]
        for e in rearm:
            self._move(e, PENDING)
            e.attempts, e.next_at = 0, now
        if rearm and s.state == CLOSED:
            s.state = CLOSING
            self._closing[session_id] = None
        return bool(rearm)

    def to_send(self, session_id: str, urls: list[str], now: float) -> list[str]:
        """The engines (of ``urls``) to send the session's close to now: those without one yet and those
        pending and due. They are marked sending. Empty when the session is not closing. A pending close of an
        engine no longer in ``urls`` (re-armed by a new close after its engine left) is dropped
        (:meth:`drop_close`): nothing would ever send it. With no engine known at all (``urls`` empty and
        none asked yet: kvgate just started, or the router lists none) the session stays closing, its close
        owed to the engines listed next (:meth:`awaiting_engines`)."""
        s = self._sessions.get(session_id)
        if s is None or s.state != CLOSING:
            return []
        if any(e.state == PENDING and u not in urls for u, e in s.engine_closes.items()):
            listed = set(urls)
            for u in [u for u, e in s.engine_closes.items() if e.state == PENDING and u not in listed]:
                self.drop_close(session_id, u, now, ENGINE_GONE)
            if s.state != CLOSING:
                return []
        out = []
        for u in urls:
            e = s.engine_closes.get(u)
            if e is None:
                s.engine_closes[u] = e = EngineClose(state=OK)
                self._move(e, SENDING)
                out.append(u)
            elif e.state == PENDING and e.next_at <= now:
                self._move(e, SENDING)
                out.append(u)
        return out

    def awaiting_engines(self) -> list[str]:
        """The closing sessions whose close no engine was asked for yet (none was known when it began)."""
        return [sid for sid in self._closing if not self._sessions[sid].engine_closes]

    def close_result(self, session_id: str, gen: int, url: str, result: str, now: float,
                     final: bool = False) -> str | None:
        """Record one engine's answer to a close call sent for close generation ``gen``: "ok" or an error
        text; ``final``: an error not worth retrying (a 4xx). Returns the engine close's new state, or
        None when the result is stale (the session re-opened, or was re-armed meanwhile)."""
        s = self._sessions.get(session_id)
        if s is None or s.close_gen != gen or s.state != CLOSING:
            return None
        e = s.engine_closes.get(url)
        if e is None or e.state != SENDING:
            return None
        e.last = result
        if result == "ok":
            self._move(e, OK)
            self.close_stats["ok"] += 1
        else:
            e.attempts += 1
            self.close_stats["failed_attempts"] += 1
            if final or e.attempts > self.retry.retries:
                self._move(e, FAILED)
                self.close_stats["given_up"] += 1
            else:
                self._move(e, PENDING)
                e.next_at = now + self.retry.delay(e.attempts)
                heapq.heappush(self._due, (e.next_at, session_id, gen, url))
        if not s.unfinished():
            self._closed(s, now)
        return e.state

    def defer(self, session_id: str, gen: int, url: str, until: float) -> bool:
        """Put back a close marked sending that was not sent (its engine is failing and another call is
        probing it): pending again until ``until``, no attempt counted. False when it is stale."""
        s = self._sessions.get(session_id)
        e = s.engine_closes.get(url) if s is not None and s.close_gen == gen and s.state == CLOSING else None
        if e is None or e.state != SENDING:
            return False
        self._move(e, PENDING)
        e.next_at = until
        heapq.heappush(self._due, (until, session_id, gen, url))
        return True

    def drop_close(self, session_id: str, url: str, now: float, reason: str = "dropped") -> bool:
        """Give up ``url``'s pending close of ``session_id`` without another try (its engine left the fleet):
        ``failed`` with ``reason`` as its last result, counted in close_stats["dropped"]. The session is
        closed once nothing else is unfinished. Returns whether a pending close was dropped; asking to close
        the session again re-arms it, as any failed close."""
        s = self._sessions.get(session_id)
        e = s.engine_closes.get(url) if s is not None and s.state == CLOSING else None
        if e is None or e.state != PENDING:
            return False
        self._move(e, FAILED)
        e.last = reason
        self.close_stats["dropped"] += 1
        if not s.unfinished():
            self._closed(s, now)
        return True

    def drop_engine(self, url: str, now: float, reason: str = ENGINE_GONE) -> list[str]:
        """:meth:`drop_close` for every pending close of ``url`` (one walk over the closing sessions). Closes
        still marked sending (queued or on the wire) are left to their call. Returns the sessions whose
        close was dropped."""
        return [sid for sid in list(self._closing) if self.drop_close(sid, url, now, reason)]

    def unfinished_on(self, url: str) -> int:
        """Closes of ``url`` still sending or pending (one walk over the closing sessions)."""
        n = 0
        for sid in self._closing:
            e = self._sessions[sid].engine_closes.get(url) if sid in self._sessions else None
            n += e is not None and e.state in (SENDING, PENDING)
        return n

    def closed_by_other_replica(self, session_id: str) -> None:
        """Mark a closing session's close as another replica's (it sends the calls; none go from here)."""
        s = self._sessions.get(session_id)
        if s is not None and s.state == CLOSING:
            s.closed_elsewhere = True

    def skip_close(self, session_id: str, now: float) -> None:
        """Mark a closing session closed without calling any engine (its KV is already gone)."""
        s = self._sessions.get(session_id)
        if s is not None and s.state == CLOSING:
            self._closed(s, now)

    def cancel_close(self, session_id: str, now: float) -> int:
        """The closing session came back through another replica (which re-opened it on the engine): drop
        its unfinished engine closes (counted cancelled; results of calls still out are ignored) and mark it
        closed here. Returns the engine closes dropped (0 when it was not closing)."""
        s = self._sessions.get(session_id)
        if s is None or s.state != CLOSING:
            return 0
        n = len(s.unfinished())
        self.close_stats["cancelled"] += n
        for e in s.engine_closes.values():
            if e.state in (SENDING, PENDING):
                e.last = "cancelled: the session came back through another replica"
            self._move(e, OK if e.state == OK else FAILED)
        s.close_gen += 1
        self._closed(s, now)
        return n

    def _closed(self, s: Session, now: float) -> None:
        s.state = CLOSED
        s.closes += 1
        s.closed_at = now
        self._closing.pop(s.session_id, None)

    def due_retries(self, now: float) -> list[tuple[str, int, str]]:
        """Pending engine closes due by ``now``, as (session_id, close_gen, url), each marked sending. The
        caller sends each (:meth:`note_retry`) or puts it back (:meth:`defer`)."""
        out = []
        while self._due and self._due[0][0] <= now:
            at, sid, gen, url = heapq.heappop(self._due)
            s = self._sessions.get(sid)
            if s is None or s.close_gen != gen or s.state != CLOSING:
                continue
            e = s.engine_closes.get(url)
            if e is None or e.state != PENDING or e.next_at != at:
                continue
            self._move(e, SENDING)
            out.append((sid, gen, url))
        return out

    def note_retry(self) -> None:
        """Count one close call sent again after a failure."""
        self.close_stats["retries"] += 1

    def next_due(self) -> float | None:
        """When the earliest pending retry is due (monotonic s; may be a stale entry), or None."""
        return self._due[0][0] if self._due else None

    def engine_back(self, url: str, now: float) -> int:
        """An engine answered a close again: its pending closes become due now. Returns how many."""
        n = 0
        for sid in self._closing:
            s = self._sessions.get(sid)
            e = s.engine_closes.get(url) if s is not None else None
            if e is not None and e.state == PENDING and e.next_at > now:
                e.next_at = now
                heapq.heappush(self._due, (now, sid, s.close_gen, url))
                n += 1
        return n

    def close_counts(self) -> dict[str, int]:
        """Engine closes not finished: {"sending": queued or out, "pending": waiting for a retry}. O(1)."""
        return dict(self._unfinished)

    def idle_sessions(self, now: float, idle_close_s: float) -> list[str]:
        """Active sessions with nothing in flight, idle for more than ``idle_close_s`` seconds."""
        if idle_close_s <= 0:
            return []
        out = []
        for s in self._sessions.values():  # oldest activity first: stop at the first recent one
            if now - s.last_seen <= idle_close_s:
                break
            if s.state == ACTIVE and s.in_flight == 0:
                out.append(s.session_id)
        return out

    def counts(self) -> dict[str, int]:
        """Number of sessions per state, plus the number dropped by the cap."""
        c = {ACTIVE: 0, CLOSING: 0, CLOSED: 0}
        for s in self._sessions.values():
            c[s.state] += 1
        c["dropped"] = self.dropped
        return c

    def as_json(self, now: float, limit: int = 1000, state: str | None = None, offset: int = 0) -> dict[str, Any]:
        """The registry as JSON: counts and up to ``limit`` sessions, most recently active first, after
        skipping the first ``offset`` (a page)."""
        items = []
        for s in reversed(self._sessions.values()) if limit > 0 else ():
            if len(items) >= limit:
                break
            if state and s.state != state:
                continue
            if offset > 0:
                offset -= 1
                continue
            items.append(s.as_json(now, self.children(s.session_id)))
        return {"counts": self.counts(), "tracked": len(self._sessions), "sessions": items,
                "closes": {**self.close_counts(), **self.close_stats}}

    def _evict_over_cap(self, keep: str | None = None) -> None:
        """Drop the longest-idle sessions over ``max_sessions``, never ``keep`` (the one being added), one in
        flight or one whose close calls are unfinished; when only closing ones are left, a close no engine was
        asked for yet (none known) goes."""
        while len(self._sessions) > self.max_sessions:
            victim = next((k for k, s in self._sessions.items()
                           if s.in_flight == 0 and s.state != CLOSING and k != keep), None)
            if victim is None:
                victim = next((k for k in self._closing if not self._sessions[k].engine_closes
                               and self._sessions[k].in_flight == 0 and k != keep), None)
                if victim is None:
                    return
                del self._closing[victim]
            self._unlink(self._sessions[victim])
            del self._sessions[victim]
            self.dropped += 1


def _int(v: Any) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) else 0
