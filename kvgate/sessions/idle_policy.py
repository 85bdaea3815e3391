"""Ending sessions from what kvgate sees: adaptive idle close, training-step
boundaries, and abort (pure).

No I/O and no clock of its own: every call that cares about time takes ``now`` (monotonic seconds).

- :class:`IdlePolicy` learns the gaps between a session's turns (end of one request with nothing else
  in flight -> start of the next) over a window of the most recent gaps, and says a session idle
  longer than ``multiple x quantile(q)`` of them, clamped to [floor_s, ceiling_s], should close. A session
  whose own gaps were longer keeps a longer threshold (``multiple x`` its largest gap, same clamp).
  ``mode="fixed"`` is today's behaviour: one threshold, ``session_idle_close_s``.
- :class:`StepTracker` counts training-step boundaries (a successful pass-through to one of
  kvgate.common.classify.STEP_BOUNDARY_ROUTES: the engines' radix cache is flushed or released) and remembers,
  per session, the step in which it last put KV on the engines; a session without KV in the current
  step stays known but is not closed on the engines again.
- :func:`ends_session` and :class:`ClientAborts`: a turn that ended with finish_reason ``abort`` closes its
  session at once only when the client asked for that abort (/abort_request naming the turn's rid). An
  abort kvgate cannot attribute to the client (a weight update, a cache flush, a memory release, an engine
  fault) is a step boundary: the rollout continues the same session with prompt + partial output.
"""

from __future__ import annotations

import math
from array import array
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from kvgate.common.classify import STEP_BOUNDARY_ROUTES

FIXED, ADAPTIVE = "fixed", "adaptive"


class GapWindow:
    """The most recent ``size`` gaps (seconds) in a ring buffer; quantiles by sorting a copy, cached
    until the next ``add``. O(size log size) per quantile after a change, O(1) per add."""

    def __init__(self, size: int = 2048):
        if size < 1:
            raise ValueError("size must be >= 1")
        self.size = size
        self._buf = array("d")
        self._next = 0
        self.total = 0  # gaps ever added
        self._sorted: list[float] | None = None

    def __len__(self) -> int:
        return len(self._buf)

    def add(self, gap_s: float) -> None:
        if not (gap_s >= 0 and math.isfinite(gap_s)):
            return
        if len(self._buf) < self.size:
            self._buf.append(gap_s)
        else:
            self._buf[self._next] = gap_s
        self._next = (self._next + 1) % self.size
        self.total += 1
        self._sorted = None

    def quantile(self, q: float) -> float | None:
        """The q-quantile (nearest rank, q in [0, 1]) of the window; None when empty."""
        if not self._buf:
            return None
        if self._sorted is None:
            self._sorted = sorted(self._buf)
        s = self._sorted
        return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


class _Gaps:
    __slots__ = ("in_flight", "last_end", "max_gap")

    def __init__(self) -> None:
        self.in_flight = 0
        self.last_end: float | None = None
        self.max_gap = 0.0


class IdlePolicy:
    """When an idle session should close.

    mode: "fixed" (threshold = fixed_s; 0 = never) or "adaptive".
    fixed_s: today's session_idle_close_s; in adaptive mode, the threshold (clamped) until
      ``min_samples`` gaps are seen (0 there = ceiling_s).
    quantile, multiple: adaptive threshold = multiple x quantile of the recent gaps.
    floor_s, ceiling_s: the clamp, seconds (0 < floor_s <= ceiling_s).
    window: recent gaps kept. per_session: a session's own largest gap x multiple can raise its threshold.
    max_sessions: cap on per-session gap records (the longest idle dropped first).
    """

    def __init__(self, mode: str = FIXED, fixed_s: float = 300.0, quantile: float = 0.95, multiple: float = 3.0,
                 floor_s: float = 10.0, ceiling_s: float = 900.0, window: int = 2048, min_samples: int = 32,
                 per_session: bool = True, max_sessions: int = 100_000):
        if mode not in (FIXED, ADAPTIVE):
            raise ValueError(f"mode must be {FIXED} or {ADAPTIVE}")
        if not 0 < quantile <= 1 or multiple <= 0 or not 0 < floor_s <= ceiling_s or fixed_s < 0:
            raise ValueError("need 0 < quantile <= 1, multiple > 0, 0 < floor_s <= ceiling_s, fixed_s >= 0")
        self.mode = mode
        self.fixed_s = fixed_s
        self.q = quantile
        self.multiple = multiple
        self.floor_s = floor_s
        self.ceiling_s = ceiling_s
        self.min_samples = max(1, min_samples)
        self.per_session = per_session
        self.max_sessions = max_sessions
        self.gaps = GapWindow(window)
        self._sessions: OrderedDict[str, _Gaps] = OrderedDict()

    def _clamp(self, x: float) -> float:
        return min(self.ceiling_s, max(self.floor_s, x))

    def on_turn_start(self, session_id: str, now: float) -> float | None:
        """A request of the session starts. Returns the gap recorded (seconds since its previous request
        ended with nothing in flight), or None for a first turn or a parallel call."""
        g = self._sessions.get(session_id)
        if g is None:
            g = self._sessions[session_id] = _Gaps()
            while len(self._sessions) > self.max_sessions:
                self._sessions.popitem(last=False)
        else:
            self._sessions.move_to_end(session_id)
        gap = None
        if g.in_flight == 0 and g.last_end is not None:
            gap = max(0.0, now - g.last_end)
            self.gaps.add(gap)
            g.max_gap = max(g.max_gap, gap)
        g.in_flight += 1
        return gap

    def on_turn_end(self, session_id: str, now: float) -> None:
        """A request of the session ended (any outcome)."""
        g = self._sessions.get(session_id)
        if g is None:
            return
        g.in_flight = max(0, g.in_flight - 1)
        if g.in_flight == 0:
            g.last_end = now

    def forget(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)

    def global_threshold(self) -> float:
        """Seconds of idleness after which a session with no gaps of its own closes; 0 = never."""
        if self.mode == FIXED:
            return self.fixed_s
        if len(self.gaps) < self.min_samples:
            return self._clamp(self.fixed_s) if self.fixed_s > 0 else self.ceiling_s
        return self._clamp(self.multiple * (self.gaps.quantile(self.q) or 0.0))

    def threshold(self, session_id: str | None = None) -> float:
        """The session's idle threshold, seconds (0 = never): the global one, raised by the session's own
        largest gap x multiple in adaptive mode (within the ceiling)."""
        base = self.global_threshold()
        if self.mode == FIXED or not self.per_session or session_id is None:
            return base
        g = self._sessions.get(session_id)
        if g is None or g.max_gap <= 0:
            return base
        return max(base, self._clamp(self.multiple * g.max_gap))

    def sweep_threshold(self) -> float:
        """The smallest threshold any session can have: pass it to SessionRegistry.idle_sessions, then
        filter the result with :meth:`should_close`."""
        return self.global_threshold()

    def should_close(self, session_id: str, idle_s: float) -> bool:
        """True when a session idle for ``idle_s`` seconds (nothing in flight) should close."""
        th = self.threshold(session_id)
        return th > 0 and idle_s > th

    def stats(self) -> dict[str, Any]:
        q = self.gaps.quantile(self.q)
        return {"mode": self.mode, "threshold_s": round(self.global_threshold(), 3), "gaps_seen": self.gaps.total,
                "gaps_window": len(self.gaps), "gap_quantile_s": None if q is None else round(q, 3),
                "quantile": self.q, "multiple": self.multiple}


# --- step boundaries -----------------------------------------------------------------------------

def flushes_kv(path: str, status: int | None, body: Mapping[str, Any] | None = None,
               method: str = "POST") -> bool:
    """True when a relayed request flushed the engines' KV: a POST to a STEP_BOUNDARY_ROUTES path that
    succeeded (status < 400) and did not opt out. Opt-outs (SGLang io_struct request classes):
    ``flush_cache: false`` on /update_weights_from_{disk,distributed,tensor}; ``tags`` without
    "kv_cache" on /release_memory_occupation. An unknown status (upstream error) is not a flush:
    closing a session whose KV is gone costs one fan-out, missing a close costs cache priority."""
    if method != "POST" or path not in STEP_BOUNDARY_ROUTES or status is None or status >= 400:
        return False
    if isinstance(body, Mapping):
        if path.startswith("/update_weights_from_") and body.get("flush_cache") is False:
            return False
        tags = body.get("tags")
        if path == "/release_memory_occupation" and isinstance(tags, list) and "kv_cache" not in tags:
            return False
    return True


class StepTracker:
    """Training steps seen through kvgate and, per session, the step in which it last had KV.

    ``step`` starts at 0 and advances on each flush. A session "has KV" when it ran a request
    (start or end) in the current step. Bounded to ``max_sessions`` records (oldest dropped)."""

    def __init__(self, max_sessions: int = 100_000):
        self.step = 0
        self.max_sessions = max_sessions
        self.boundaries: dict[str, int] = {}
        self._kv_step: OrderedDict[str, int] = OrderedDict()

    def on_boundary(self, path: str, status: int | None, body: Mapping[str, Any] | None = None,
                    method: str = "POST") -> bool:
        """Record a relayed request; True when it advanced the step (see :func:`flushes_kv`)."""
        if not flushes_kv(path, status, body, method):
            return False
        self.step += 1
        self.boundaries[path] = self.boundaries.get(path, 0) + 1
        return True

    def on_kv(self, session_id: str) -> None:
        """The session put KV on the engines in the current step (call at request start and end)."""
        self._kv_step[session_id] = self.step
        self._kv_step.move_to_end(session_id)
        while len(self._kv_step) > self.max_sessions:
            self._kv_step.popitem(last=False)

    def kv_step(self, session_id: str) -> int | None:
        return self._kv_step.get(session_id)

    def has_kv(self, session_id: str) -> bool:
        """Whether closing the session on the engines can free anything. An unknown session is assumed
        to have KV (a client may close a session kvgate did not see)."""
        s = self._kv_step.get(session_id)
        return s is None or s == self.step

    def forget(self, session_id: str) -> None:
        self._kv_step.pop(session_id, None)

    def as_json(self) -> dict[str, Any]:
        return {"step": self.step, "boundaries": dict(self.boundaries)}


class ClientAborts:
    """Request ids a client asked to abort (/abort_request {"rid": ...} relayed by kvgate), the most recent
    ``max_rids`` kept. ``abort_all`` is not remembered: a trainer aborts everything at a weight update,
    and the rollouts go on with the same sessions afterwards."""

    def __init__(self, max_rids: int = 100_000):
        self.max_rids = max(1, max_rids)
        self._rids: OrderedDict[str, None] = OrderedDict()

    def note(self, rid: Any) -> None:
        """Remember ``rid`` (a string, or a list of strings as SGLang's batch form)."""
        for r in (rid if isinstance(rid, list) else [rid]):
            if isinstance(r, str) and r:
                self._rids[r] = None
                self._rids.move_to_end(r)
        while len(self._rids) > self.max_rids:
            self._rids.popitem(last=False)

    def asked(self, rid: Any) -> bool:
        """True when the client asked to abort ``rid``."""
        return isinstance(rid, str) and rid in self._rids


def ends_session(finish_type: str | None) -> bool:
    """True when a turn ended in an abort (SGLang's meta_info.finish_reason.type, or choices[0].finish_reason
    on the OpenAI routes). Whether that ends the session depends on who asked (:class:`ClientAborts`)."""
    return finish_type == "abort"
