"""The speed factor (pure): one number that compresses a whole run while keeping every ratio of durations.

At speed s the simulator runs its compute model s times faster (``--speed s``), tool gaps and trace
timestamps are divided by s, and every kvgate duration setting (poll interval, and with it the staleness
bound; max wait; idle close; close drain; discovery interval; rate window; lease TTL), the router's queue
timeout and the sampler interval are divided by s too. Dividing arrivals alone would erase the idle windows
between turns that the lifecycle and admission features depend on.

One thing does not scale: kvgate derives staleness as max(3 x poll interval, 5 s) with a fixed 5 s floor
(kvgate.admission.capacity.stale_after_s). ``Scaled.stale_after_s`` reports the effective value and
``Scaled.stale_after_sim_s`` what it amounts to in simulated time; it only matters when polls fail.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvgate.admission.capacity import stale_after_s


@dataclass(frozen=True)
class Scaled:
    """Wall-clock settings for one run at ``speed`` (all seconds of wall time)."""

    speed: float
    sim_speed: float
    kvgate_times: dict
    router_queue_timeout_s: float
    sample_interval_s: float
    stale_after_s: float
    stale_after_sim_s: float

    def wall(self, sim_seconds: float) -> float:
        """Simulated (speed-1) seconds -> wall seconds."""
        return sim_seconds / self.speed

    def sim(self, wall_seconds: float) -> float:
        """Wall seconds -> simulated (speed-1) seconds."""
        return wall_seconds * self.speed


def scale(speed: float, kvgate_times: dict[str, float], router_queue_timeout_s: float,
          sample_interval_s: float) -> Scaled:
    """Divide every duration (seconds at speed 1) by ``speed``. A 0 kvgate time (= "never") stays 0.
    Raises ValueError for speed <= 0."""
    if not speed > 0:
        raise ValueError(f"speed must be > 0, got {speed}")
    times = {k: (0.0 if v == 0 else v / speed) for k, v in kvgate_times.items()}
    poll = times.get("admission_poll_interval_s", 2.0 / speed)
    stale = stale_after_s(poll)
    return Scaled(speed=speed, sim_speed=speed, kvgate_times=times,
                  router_queue_timeout_s=router_queue_timeout_s / speed,
                  sample_interval_s=sample_interval_s / speed,
                  stale_after_s=stale, stale_after_sim_s=stale * speed)


def kvgate_flags(times: dict[str, float]) -> list[str]:
    """``kvgate serve`` flags for the scaled times (``--admission-poll-interval-s 0.25`` ...)."""
    out: list[str] = []
    for k, v in sorted(times.items()):
        out += ["--" + k.replace("_", "-"), repr(float(v))]
    return out
