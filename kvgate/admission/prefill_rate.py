"""What re-prefilling costs on an engine, learned online from the calls kvgate sees (pure, no clock of its own).

Each answered call gives (seconds from forward to answer, tokens the engine prefilled = prompt_tokens -
cached_tokens, tokens it decoded = completion_tokens). A least-squares fit of

    seconds = fixed + per_prefill_token x prefilled + per_output_token x decoded

with exponential forgetting (recent calls weigh most: the rate under today's load, batch sizes included) gives
the marginal seconds a prefilled token costs. No call can take less than its own prefill (the fixed part, the
decode and any queueing only add), so the slope is at most any recent call's seconds / prefilled: a fit from a
few calls of nearly one size (an ill-posed slope) is held to what the calls themselves allow. That bound
relaxes by 1/forget a call, as the weights fade. A re-prefill of N tokens then costs ``N x per_prefill_token``: the
fixed part is paid by the next turn anyway. The figures come from the answers themselves (the engine's own
token counts, kvgate's own wall clock), not from a profile, so one rule holds on a CPU engine where a 1,000-token
context re-prefills in ~0.4 s and on a GPU fleet where a 60k-token one takes seconds.

Until a place has ``min_samples`` calls the fleet's fit stands in; until the fleet has them there is no figure
(``seconds`` returns None) and the caller keeps its configured bound.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Hashable

__all__ = ["PrefillRate", "WAIT_BOUNDS"]

#: How long the program policy lets a turn wait for room: "reprefill" (what re-prefilling the KV its admission
#: displaces would cost, within the aging bound) or "aging" (the aging bound alone).
WAIT_BOUNDS = ("reprefill", "aging")


class _Fit:
    """Weighted normal equations of y on (1, x1, x2), with forgetting, and ``cap``: the smallest y / x1 of the
    calls, each relaxed by 1/forget per later call (None before a call with x1 > 0)."""

    __slots__ = ("s", "n", "cap")

    def __init__(self) -> None:
        # sums of w, w x1, w x2, w x1^2, w x1 x2, w x2^2, w y, w x1 y, w x2 y
        self.s = [0.0] * 9
        self.n = 0
        self.cap: float | None = None

    def add(self, y: float, x1: float, x2: float, forget: float) -> None:
        cap = self.cap
        if cap is not None:
            cap /= forget
        if x1 > 0 and (cap is None or y < cap * x1):
            cap = y / x1
        self.cap = cap
        s = self.s
        for i in range(9):
            s[i] *= forget
        s[0] += 1.0
        s[1] += x1
        s[2] += x2
        s[3] += x1 * x1
        s[4] += x1 * x2
        s[5] += x2 * x2
        s[6] += y
        s[7] += x1 * y
        s[8] += x2 * y
        self.n += 1

    def slope(self) -> float | None:
        """The fitted seconds per x1 (prefilled token), at most ``cap``, or None if the data cannot tell it (too
        few or collinear calls, or a slope <= 0). Falls back to the fit without x2 when the full one is
        ill-posed."""
        v = self._slope()
        return v if v is None or self.cap is None or v <= self.cap else (self.cap or None)

    def _slope(self) -> float | None:
        w, a, b, aa, ab, bb, y, ay, by = self.s
        # full fit: solve the 3x3 system by Cramer's rule
        m = ((w, a, b), (a, aa, ab), (b, ab, bb))
        det = _det3(m)
        scale = max(1e-300, abs(w * aa * bb))
        if abs(det) > 1e-9 * scale:
            mx = ((w, y, b), (a, ay, ab), (b, by, bb))
            slope = _det3(mx) / det
            mz = ((w, a, y), (a, aa, ay), (b, ab, by))
            per_out = _det3(mz) / det
            if slope > 0 and per_out >= 0:
                return slope
        # without the decode term: y on (1, x1)
        det2 = w * aa - a * a
        if det2 > 1e-9 * max(1e-300, w * aa):
            slope = (w * ay - a * y) / det2
            if slope > 0:
                return slope
        return None


def _det3(m: tuple) -> float:
    return (m[0][0] * (m[1][1] * m[2][2] - m[1][2] * m[2][1])
            - m[0][1] * (m[1][0] * m[2][2] - m[1][2] * m[2][0])
            + m[0][2] * (m[1][0] * m[2][1] - m[1][1] * m[2][0]))


class PrefillRate:
    """Seconds per prefilled token, per place (an engine or DP rank) and fleet-wide, learned from answers.

    Args: forget in (0, 1]: each new call multiplies the weight of the ones before by this (0.98: the last
    ~50 calls count); min_samples >= 3: calls a fit needs before it is used. Raises ValueError on bad values.
    """

    def __init__(self, forget: float = 0.98, min_samples: int = 8) -> None:
        if not (isinstance(forget, (int, float)) and 0 < forget <= 1):
            raise ValueError(f"forget must be in (0, 1], got {forget!r}")
        if isinstance(min_samples, bool) or not isinstance(min_samples, int) or min_samples < 3:
            raise ValueError(f"min_samples must be an int >= 3, got {min_samples!r}")
        self.forget = float(forget)
        self.min_samples = min_samples
        self._places: dict[Hashable, _Fit] = {}
        self._fleet = _Fit()
        self._cache: dict[Any, float | None] = {}  # place -> slope, until the next observation there

    def observe(self, place: Hashable, seconds: float, prefilled: int, decoded: int) -> None:
        """One answered call on ``place``: ``seconds`` from forward to answer (wall), ``prefilled`` tokens the
        engine computed (prompt_tokens - cached_tokens), ``decoded`` tokens it wrote. Ignores values that
        are not finite and >= 0."""
        if not (seconds >= 0 and prefilled >= 0 and decoded >= 0) or seconds == float("inf"):
            return
        fit = self._places.get(place)
        if fit is None:
            fit = self._places[place] = _Fit()
        fit.add(float(seconds), float(prefilled), float(decoded), self.forget)
        self._fleet.add(float(seconds), float(prefilled), float(decoded), self.forget)
        self._cache.clear()

    def observe_answer(self, place: Hashable, seconds: float, meta: Any) -> None:
        """One answered call from its meta_info (prompt_tokens, cached_tokens, completion_tokens: the engine's
        own counts); ignored without the first two or for the whole fleet (no engine known)."""
        if not isinstance(meta, Mapping) or place is None:  # None: the whole fleet (kvgate.admission.working_set)
            return
        pt, cached, ct = meta.get("prompt_tokens"), meta.get("cached_tokens"), meta.get("completion_tokens")
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (pt, cached)):
            return
        ct = ct if isinstance(ct, int) and not isinstance(ct, bool) and ct >= 0 else 0
        self.observe(place, seconds, max(0, pt - cached), ct)

    def per_token_s(self, place: Hashable) -> float | None:
        """Seconds one prefilled token costs on ``place`` (its own fit, else the fleet's), or None (no figure)."""
        try:
            return self._cache[place]
        except KeyError:
            pass
        v = None
        fit = self._places.get(place)
        if fit is not None and fit.n >= self.min_samples:
            v = fit.slope()
        if v is None and self._fleet.n >= self.min_samples:
            v = self._fleet.slope()
        self._cache[place] = v
        return v

    def seconds(self, place: Hashable, tokens: int) -> float | None:
        """Seconds re-prefilling ``tokens`` costs on ``place``, or None while nothing is known."""
        v = self.per_token_s(place)
        return None if v is None else max(0, tokens) * v

    def stats(self, label) -> dict[str, Any]:
        """{place label: prefill tokens per second (None: not known yet)} and the fleet's, for /kvgate/stats."""
        out: dict[str, Any] = {}
        for pl in self._places:
            v = self.per_token_s(pl)
            out[label(pl)] = None if v is None else round(1.0 / v, 1)
        v = self._fleet.slope() if self._fleet.n >= self.min_samples else None
        out["fleet"] = None if v is None else round(1.0 / v, 1)
        return out
