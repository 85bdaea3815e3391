"""The session registry: what kvgate knows of each session, and when one should close (pure).

No I/O and no clock of its own: every call takes ``now`` (monotonic seconds). The shell
(kvgate.sessions.lifecycle) turns its decisions into /close_session fan-outs.

A session moves active -> closing -> closed. A request for a closed session reopens it: the agent
went on after all, and the engines tag its KV again.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

ACTIVE, CLOSING, CLOSED = "active", "closing", "closed"


@dataclass
class Session:
    """One session's record. Times are monotonic seconds; wall times (for display) are epoch seconds."""

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
    close_reason: str | None = None
    closed_at: float | None = None
    close_results: dict[str, str] = field(default_factory=dict)
    closes: int = 0
    reopened: int = 0

    def as_json(self, now: float) -> dict[str, Any]:
        """A JSON-able view; ages are seconds before ``now``."""
        return {
            "session_id": self.session_id,
            "source": self.source,
            "state": self.state,
            "turns": self.turns,
            "in_flight": self.in_flight,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
            "first_seen_unix": round(self.first_seen_wall, 3),
            "age_s": round(now - self.first_seen, 3),
            "idle_s": round(now - self.last_seen, 3) if self.in_flight == 0 else 0.0,
            "close_reason": self.close_reason,
            "closes": self.closes,
            "reopened": self.reopened,
            "close_results": dict(self.close_results),
        }


class SessionRegistry:
    """Tracks sessions by id, bounded to ``max_sessions`` (the oldest idle dropped first, counted).

    Methods take ``now`` in monotonic seconds; ``wall`` is only used for display.
    """

    def __init__(self, max_sessions: int = 100_000, wall=time.time):
        self.max_sessions = max_sessions
        self._wall = wall
        # Ordered by last activity: the first entry is the longest idle (move_to_end on each touch).
        self._sessions: OrderedDict[str, Session] = OrderedDict()
        self.dropped = 0

    def __len__(self) -> int:
        return len(self._sessions)

    def get(self, session_id: str) -> Session | None:
        return self._sessions.get(session_id)

    def request_started(self, session_id: str, source: str | None, now: float) -> Session:
        """Record the start of one request (one turn) of ``session_id``; returns its record."""
        s = self._sessions.get(session_id)
        if s is None:
            s = Session(session_id, source, now, now, self._wall())
            self._sessions[session_id] = s
            self._evict_over_cap()
        else:
            self._sessions.move_to_end(session_id)
            if s.state != ACTIVE:
                s.state = ACTIVE
                s.reopened += 1
                s.close_reason = None
        s.turns += 1
        s.in_flight += 1
        s.last_seen = now
        return s

    def request_finished(self, session_id: str, now: float, meta: dict[str, Any] | None = None) -> None:
        """Record the end of one request; ``meta`` is the response's meta_info (token counts) if seen."""
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

    def begin_close(self, session_id: str, reason: str, now: float) -> bool:
        """Mark a session closing. True when the caller should fan out a close; False when it is
        already closing or closed (close is idempotent). An id never seen is registered so its
        close shows in the registry (a client may close a session kvgate did not route)."""
        s = self._sessions.get(session_id)
        if s is None:
            s = Session(session_id, None, now, now, self._wall())
            self._sessions[session_id] = s
            self._evict_over_cap()
        if s.state != ACTIVE:
            return False
        s.state = CLOSING
        s.close_reason = reason
        return True

    def finish_close(self, session_id: str, results: dict[str, str], now: float) -> None:
        """Record the fan-out result per engine ("ok" or an error text) and mark the session closed."""
        s = self._sessions.get(session_id)
        if s is None:
            return
        s.close_results = dict(results)
        s.closes += 1
        s.closed_at = now
        if s.state == CLOSING:  # a request may have reopened it meanwhile
            s.state = CLOSED

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
        if limit <= 0:
            return {"counts": self.counts(), "tracked": len(self._sessions), "sessions": items}
        for s in reversed(self._sessions.values()):
            if state and s.state != state:
                continue
            if offset > 0:
                offset -= 1
                continue
            items.append(s.as_json(now))
            if len(items) >= limit:
                break
        return {"counts": self.counts(), "tracked": len(self._sessions), "sessions": items}

    def _evict_over_cap(self) -> None:
        while len(self._sessions) > self.max_sessions:
            victim = next((k for k, s in self._sessions.items() if s.in_flight == 0), None)
            if victim is None:
                return
            del self._sessions[victim]
            self.dropped += 1


def _int(v: Any) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) else 0
