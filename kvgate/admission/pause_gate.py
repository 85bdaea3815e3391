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
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

__all__ = ["PauseGate", "START_RATIO", "STOP_RATIO"]

#: The defaults, between the regimes measured above: pausing starts at 1.5 (2.2x the real CPU fleet's highest
#: seed, a quarter of the simulated GPU fleet's lowest) and stops below 0.2 (above what pausing leaves on the
#: CPU fleet, below what it leaves on the GPU-class one).
START_RATIO = 1.5
STOP_RATIO = 0.2


class PauseGate:
    """The re-prefill ratio (call seconds re-prefilling evicted KV per engine wall second) and whether pausing
    may pay.

    Args: start_ratio (>= 0): pausing starts when the ratio reaches it (0: always open, the gate is off);
    stop_ratio (0 <= stop_ratio <= start_ratio; None: half of start_ratio): pausing stops when the ratio falls
    below it; window_s (> 0): the sliding window, seconds; min_span_s (>= 0): no decision (closed) until the
    first answer is this old. Raises ValueError on bad values.
    """

    def __init__(self, start_ratio: float, stop_ratio: float | None = None, *, window_s: float = 60.0,
                 min_span_s: float = 10.0) -> None:
        if not (isinstance(start_ratio, (int, float)) and math.isfinite(start_ratio) and start_ratio >= 0):
            raise ValueError(f"start_ratio must be a finite number >= 0, got {start_ratio!r}")
        close = start_ratio / 2 if stop_ratio is None else stop_ratio
        if not (isinstance(close, (int, float)) and 0 <= close <= start_ratio):
            raise ValueError(f"stop_ratio must be in [0, start_ratio], got {stop_ratio!r}")
        if not (isinstance(window_s, (int, float)) and window_s > 0):
            raise ValueError(f"window_s must be > 0, got {window_s!r}")
        if not (isinstance(min_span_s, (int, float)) and min_span_s >= 0):
            raise ValueError(f"min_span_s must be >= 0, got {min_span_s!r}")
        self.start_ratio = float(start_ratio)
        self.stop_ratio = float(close)
        self.window_s = float(window_s)
        self.min_span_s = float(min_span_s)
        self.is_open = self.start_ratio == 0  # off: always open
        self._events: deque[tuple[float, float]] = deque()  # (time, re-prefill seconds) in the window
        self._sum = 0.0
        self._since: float | None = None  # the first answer's time
        self.reprefill_tokens = 0  # lifetime
        self.reprefill_s = 0.0
        self.opened = 0  # times it opened
        self.closed = 0
        self.peak = 0.0  # the highest ratio an update saw

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
        elif self.is_open and s < self.stop_ratio:
            self.is_open = False
            self.closed += 1
        return self.is_open

    def stats(self, now: float, engines: int) -> dict[str, Any]:
        """JSON-able figures: open, the ratio now and its peak, thresholds, lifetime re-prefill tokens and seconds,
        times opened and closed, the window."""
        s = self.ratio(now, engines)
        return {"open": self.is_open, "ratio": None if s is None else round(s, 4), "start_ratio": self.start_ratio,
                "stop_ratio": self.stop_ratio, "reprefill_tokens": self.reprefill_tokens,
                "reprefill_s": round(self.reprefill_s, 3), "opened": self.opened, "closed": self.closed,
                "peak_ratio": round(self.peak, 4), "window_s": self.window_s}
