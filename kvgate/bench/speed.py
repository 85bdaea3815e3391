"""The speed factor (pure): one number that compresses a whole run while keeping every ratio of durations.

At speed s the simulator runs its compute model s times faster (``--speed s``), tool gaps and trace
timestamps are divided by s, and every kvgate duration setting (poll interval, and with it the staleness
bound; max wait; idle close; close drain; discovery interval; rate window; lease TTL), the router's queue
timeout and the sampler interval are divided by s too. Dividing arrivals alone would erase the idle windows
between turns that the lifecycle and admission features depend on.

smg's load monitor (``--load-monitor-interval``, 10 s by default in smg 1.13: how often it polls each
engine's /v1/loads, the figures its worker overload protection and its load-aware policies act on) is divided
too, rounded to whole seconds (smg takes an integer, at least 1): at speed 6 it polls every 2 s of wall time,
12 simulated seconds. Left at 10 s it would see the engines once a simulated minute, and its overload
protection would act on figures far staler than on real engines.

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
    router_load_monitor_interval_s: int = 10  # wall seconds (smg takes whole seconds)

    def wall(self, sim_seconds: float) -> float:
        """Simulated (speed-1) seconds -> wall seconds."""
        return sim_seconds / self.speed

    def sim(self, wall_seconds: float) -> float:
        """Wall seconds -> simulated (speed-1) seconds."""
        return wall_seconds * self.speed


# smg 1.13's default --load-monitor-interval, seconds (smg/router_args.py: load_monitor_interval = 10).
SMG_LOAD_MONITOR_INTERVAL_S = 10


def scale(speed: float, kvgate_times: dict[str, float], router_queue_timeout_s: float,
          sample_interval_s: float, router_load_monitor_interval_s: float = SMG_LOAD_MONITOR_INTERVAL_S) -> Scaled:
    """Divide every duration (seconds at speed 1) by ``speed``. A 0 kvgate time (= "never") stays 0; smg's
    load-monitor interval is rounded to whole seconds, at least 1. Raises ValueError for speed <= 0."""
    if not speed > 0:
        raise ValueError(f"speed must be > 0, got {speed}")
    times = {k: (0.0 if v == 0 else v / speed) for k, v in kvgate_times.items()}
    poll = times.get("admission_poll_interval_s", 2.0 / speed)
    stale = stale_after_s(poll)
    return Scaled(speed=speed, sim_speed=speed, kvgate_times=times,
                  router_queue_timeout_s=router_queue_timeout_s / speed,
                  sample_interval_s=sample_interval_s / speed,
                  stale_after_s=stale, stale_after_sim_s=stale * speed,
                  router_load_monitor_interval_s=max(1, round(router_load_monitor_interval_s / speed)))


def split_load_monitor_interval(router_extra: list) -> tuple[list[str], float]:
    """A scenario's ``router_extra`` without its ``--load-monitor-interval N`` (seconds at speed 1), and N
    (smg's default when absent): the bench passes the scaled value itself. Raises ValueError for a flag
    without a positive number after it."""
    out: list[str] = []
    interval: float = SMG_LOAD_MONITOR_INTERVAL_S
    items = [str(x) for x in router_extra]
    i = 0
    while i < len(items):
        if items[i] == "--load-monitor-interval" or items[i].startswith("--load-monitor-interval="):
            if "=" in items[i]:
                raw, i = items[i].split("=", 1)[1], i + 1
            elif i + 1 < len(items):
                raw, i = items[i + 1], i + 2
            else:
                raise ValueError("router_extra: --load-monitor-interval needs a number of seconds after it")
            try:
                interval = float(raw)
            except ValueError:
                raise ValueError(f"router_extra: --load-monitor-interval must be a number of seconds, got {raw!r}")
            if not interval > 0:
                raise ValueError(f"router_extra: --load-monitor-interval must be > 0, got {raw}")
            continue
        out.append(items[i])
        i += 1
    return out, interval


def kvgate_flags(times: dict[str, float]) -> list[str]:
    """``kvgate serve`` flags for the scaled times (``--admission-poll-interval-s 0.25`` ...)."""
    out: list[str] = []
    for k, v in sorted(times.items()):
        out += ["--" + k.replace("_", "-"), repr(float(v))]
    return out
