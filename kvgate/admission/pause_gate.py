"""Whether pausing programs can pay on this fleet, from what re-prefilling costs its calls (pure, injected ``now``).

A pause keeps other programs' KV resident, so the engines re-prefill less; it costs the paused program its wait,
on that program's own path to the end of the step. The most it can save is what re-prefilling prefixes the
engines had computed and then evicted costs the calls (Amdahl's law). Where that is small next to the engines'
time (a small model, short contexts, few programs per engine: the step is as long as its longest program's chain
of turns and tool calls) no pause repays its wait, and the program policy admits as lifecycle alone does; where
re-prefill dominates (KV thrashing on GPU engines holding tens of long programs, each call queued behind others'
re-prefills) pausing is what shortens the step.

Measured from the answers, not from a profile: a turn of a program that held ``before`` tokens whose engine
reports fewer ``cached_tokens`` re-prefilled the difference, which cost the call that many tokens at the
engine's learned marginal seconds per prefilled token (kvgate.admission.prefill_rate: the slope includes the
queueing a large prefill brings, so on a thrashing engine it exceeds the bare compute). The re-prefill ratio is
those seconds over the engines' wall seconds in a sliding window. Measured with pausing off
(docs/benchmark.md): 0.25-0.67 on the real CPU engines of ``real-programs`` (pausing made the step 2 s
longer), 6.2-7.1 in the simulator's GPU-class ``many-programs`` (pausing made it 1.5x shorter); with pausing on,
0.06-0.17 and 0.29-0.42. The gate opens at ``start_ratio`` and closes below ``stop_ratio`` (hysteresis: while
pausing works, the ratio it measures falls, and a single threshold would flap).

Foresight: that ratio needs evictions to measure, and they come after the working set has outgrown the pool, so
the thrash has begun before it opens. When a pool's working set outgrows its ceiling the policy also reads how many
program cycles (a turn plus a tool call, averaged from the answers: :class:`Cycle`) the engine takes to prefill a
whole ceiling at its learned marginal rate. Large where each prefilled token lengthens every call on a busy engine
(the learned slope includes the queueing), small where the engine keeps up; at ``foresee_cycles`` the gate opens
then, and it stays open at least a window after the last such reading (the measured ratio is still near 0). The
policy also reads it while the gate is open and turns wait for room (kvgate.admission.program_pause): the ratio
is low then because they are held, and closing would send them all at once.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

__all__ = ["Cycle", "FORESEE_CYCLES", "PauseGate", "START_RATIO", "STOP_RATIO"]

#: The defaults, between the regimes measured above: pausing starts at 1.5 (2.2x the real CPU fleet's highest
#: seed, a quarter of the simulated GPU fleet's lowest) and stops below 0.2 (above what pausing leaves on the
#: CPU fleet, below what it leaves on the GPU-class one).
START_RATIO = 1.5
STOP_RATIO = 0.2
#: Foresight's default: pausing starts ahead of the evidence where prefilling a whole ceiling takes 20 program
#: cycles or more. Read when an engine's working set first outgrew its ceiling, with foresight off (4 seeds
#: each, docs/benchmark.md): the simulated GPU-class many-programs 38-50 (peak 39-56); the real CPU engines of
#: real-programs 2.7-5.9 (peak 4.7-10.7), where pausing makes the step longer; real-regime 1.6-7.4 on the real
#: engines (peak 11.1), 0.6-10.5 simulated, and the simulated agentic-kv-bound 1.2-1.7 (peak 9.0), where pausing
#: neither helps nor hurts.
FORESEE_CYCLES = 20.0


class PauseGate:
    """The re-prefill ratio (call seconds re-prefilling evicted KV per engine wall second) and whether pausing
    may pay.

    Args: start_ratio (>= 0): pausing starts when the ratio reaches it (0: always open, the gate is off);
    stop_ratio (0 <= stop_ratio <= start_ratio; None: half of start_ratio): pausing stops when the ratio falls
    below it; window_s (> 0): the sliding window, seconds; min_span_s (>= 0): no decision (closed) until the
    first answer is this old. Raises ValueError on bad values.
    """

    def __init__(self, start_ratio: float, stop_ratio: float | None = None, *, window_s: float = 60.0,
                 min_span_s: float = 10.0, foresee_cycles: float = 0.0) -> None:
        if not (isinstance(start_ratio, (int, float)) and math.isfinite(start_ratio) and start_ratio >= 0):
            raise ValueError(f"start_ratio must be a finite number >= 0, got {start_ratio!r}")
        close = start_ratio / 2 if stop_ratio is None else stop_ratio
        if not (isinstance(close, (int, float)) and 0 <= close <= start_ratio):
            raise ValueError(f"stop_ratio must be in [0, start_ratio], got {stop_ratio!r}")
        if not (isinstance(window_s, (int, float)) and window_s > 0):
            raise ValueError(f"window_s must be > 0, got {window_s!r}")
        if not (isinstance(min_span_s, (int, float)) and min_span_s >= 0):
            raise ValueError(f"min_span_s must be >= 0, got {min_span_s!r}")
        if not (isinstance(foresee_cycles, (int, float)) and math.isfinite(foresee_cycles) and foresee_cycles >= 0):
            raise ValueError(f"foresee_cycles must be a finite number >= 0, got {foresee_cycles!r}")
        self.start_ratio = float(start_ratio)
        self.stop_ratio = float(close)
        self.window_s = float(window_s)
        self.min_span_s = float(min_span_s)
        self.foresee_cycles = float(foresee_cycles)
        self.is_open = self.start_ratio == 0  # off: always open
        self._events: deque[tuple[float, float]] = deque()  # (time, re-prefill seconds) in the window
        self._sum = 0.0
        self._since: float | None = None  # the first answer's time
        self.reprefill_tokens = 0  # lifetime
        self.reprefill_s = 0.0
        self.opened = 0  # times it opened
        self.closed = 0
        self.peak = 0.0  # the highest ratio an update saw
        self.foreseen = 0  # times it opened on foresight
        self.foresight: float | None = None  # the last foreseen ratio (None: none read yet)
        self.foresight_first: float | None = None  # the first
        self.foresight_peak = 0.0
        # what last opened or closed it: ("ratio", the ratio) or ("foresight", the reading); None before either
        self.turned_by: tuple[str, float] | None = None
        self._foreseen_at = -math.inf  # when the last foresight reached foresee_cycles
        self.cycle = Cycle()  # a program's mean turn and tool call (the foresight's unit), fed by the policy

    def observe(self, now: float, tokens: int, seconds: float | None) -> None:
        """One answer: the engine re-prefilled ``tokens`` the program had held, costing ``seconds`` (None: no
        prefill rate learned yet; the tokens count, the seconds do not)."""
        if self._since is None:
            self._since = now
        if tokens <= 0:
            return
        self.reprefill_tokens += tokens
        if seconds is None or not seconds > 0:
            return
        self.reprefill_s += seconds
        self._events.append((now, seconds))
        self._sum += seconds

    def started(self, now: float) -> None:
        """A turn was seen at ``now``: the window's span counts from the first one."""
        if self._since is None:
            self._since = now

    def ratio(self, now: float, engines: int) -> float | None:
        """The re-prefill ratio: re-prefill seconds over ``engines`` x the window's span ending at ``now``; None
        before min_span_s."""
        if self._since is None:
            return None
        span = min(self.window_s, now - self._since)
        if span < self.min_span_s or span <= 0:
            return None
        ev, horizon = self._events, now - self.window_s
        while ev and ev[0][0] < horizon:
            self._sum -= ev.popleft()[1]
        if not ev:
            self._sum = 0.0  # no float residue
        return max(0.0, self._sum) / (max(1, engines) * span)

    def update(self, now: float, engines: int) -> bool:
        """Whether pausing may pay at ``now`` (opens at start_ratio, closes below stop_ratio); ``engines``: the
        KV pools (engines or DP ranks) the fleet has."""
        if self.start_ratio == 0:
            return True
        s = self.ratio(now, engines)
        if s is None:
            return self.is_open
        if s > self.peak:
            self.peak = s
        if not self.is_open and s >= self.start_ratio:
            self.is_open = True
            self.opened += 1
            self.turned_by = ("ratio", s)
        elif self.is_open and s < self.stop_ratio and self.foresight_lapsed(now):
            self.is_open = False
            self.closed += 1
            self.turned_by = ("ratio", s)
        return self.is_open

    def foresight_lapsed(self, now: float) -> bool:
        """Whether a window has passed since the last foresight reading at foresee_cycles or more (only then may
        the ratio close the gate)."""
        return now - self._foreseen_at >= self.window_s

    def foresee(self, now: float, ratio: float) -> bool:
        """A pool's working set outgrew its ceiling at ``now``, or turns wait for room on it with the gate open;
        ``ratio``: program cycles its engine takes to prefill a whole ceiling. At foresee_cycles or more (and
        foresee_cycles > 0) the gate opens, and stays open until a window after the last such reading. Returns
        whether the gate is open."""
        self.foresight = ratio
        if self.foresight_first is None:
            self.foresight_first = ratio
        if ratio > self.foresight_peak:
            self.foresight_peak = ratio
        if not self.foresee_cycles or ratio < self.foresee_cycles:
            return self.is_open
        self._foreseen_at = now  # it stays open at least a window from now (the evidence comes later)
        if not self.is_open:
            self.is_open = True
            self.opened += 1
            self.foreseen += 1
            self.turned_by = ("foresight", ratio)
        return True

    def stats(self, now: float, engines: int) -> dict[str, Any]:
        """JSON-able figures: open, the ratio now and its peak, thresholds, lifetime re-prefill tokens and seconds,
        times opened and closed, the window; foresight's threshold, times it opened the gate, and its last, first and
        highest reading (None before any pool outgrew its ceiling)."""
        s = self.ratio(now, engines)
        return {"open": self.is_open, "ratio": None if s is None else round(s, 4), "start_ratio": self.start_ratio,
                "stop_ratio": self.stop_ratio, "reprefill_tokens": self.reprefill_tokens,
                "reprefill_s": round(self.reprefill_s, 3), "opened": self.opened, "closed": self.closed,
                "peak_ratio": round(self.peak, 4), "window_s": self.window_s,
                "foresee_cycles": self.foresee_cycles, "foreseen": self.foreseen,
                "foresight": None if self.foresight is None else round(self.foresight, 4),
                "foresight_first": None if self.foresight_first is None else round(self.foresight_first, 4),
                "foresight_peak": None if self.foresight_first is None else round(self.foresight_peak, 4)}


class Cycle:
    """A program's mean turn and mean tool call (seconds, exponentially weighted): how often a program comes
    back for its KV."""

    __slots__ = ("_turn", "_gap")

    def __init__(self) -> None:
        self._turn: float | None = None
        self._gap: float | None = None

    def turn(self, seconds: float) -> None:
        """One call took ``seconds``."""
        if seconds >= 0:
            self._turn = seconds if self._turn is None else self._turn + 0.05 * (seconds - self._turn)

    def gap(self, seconds: float) -> None:
        """One tool call (between a program's turns) took ``seconds``."""
        if seconds >= 0:
            self._gap = seconds if self._gap is None else self._gap + 0.05 * (seconds - self._gap)

    def seconds(self) -> float | None:
        """Turn + tool call, or None until both were seen."""
        if self._turn is None or self._gap is None or self._turn + self._gap <= 0:
            return None
        return self._turn + self._gap
