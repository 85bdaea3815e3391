"""What /kvgate/health says: checks, each with its reason, and the status they add up to (pure).

A check is one thing kvgate depends on (the router, the engines, ...) with ``ok`` True, False or None (not
known yet) and a reason a user can act on. The status:

  - ``down`` (HTTP 503): a check kvgate cannot serve without failed: the router is unreachable and kvgate
    places no calls itself (every call gets kvgate's 502), the upstream is not a router at all (it answers
    neither /workers nor /list_workers nor an engine's /server_info: the router's Prometheus port, say, where
    every call gets a 404), or no engine is usable (the router lists none, or every one is unhealthy by the
    router's checks or kvgate's own calls),
  - ``starting`` (HTTP 503): a check has no answer yet,
  - ``degraded`` (HTTP 200): kvgate serves, but a check that is not fatal failed (the router is unreachable
    while kvgate places a session's calls on the engines itself and an engine is usable: those calls are
    served, every other call gets kvgate's 502; an engine of several is down; the router's answer to /workers
    has a shape kvgate does not know; the upstream is an engine rather than a router and no ``engines:`` are
    configured),
  - ``ok`` (HTTP 200): every check passed.

Other parts of kvgate add their checks to the list; the status rule does not change. The router's state is
kept by :class:`Reachability` (one line logged per change, never per request).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

OK, DEGRADED, STARTING, DOWN = "ok", "degraded", "starting", "down"


@dataclass
class Check:
    """One health check: ``name``, ``ok`` (None: not known yet), ``reason`` (why not ok; a short summary when
    ok), ``fatal`` (a failure means kvgate cannot serve: status down) and extra JSON fields in ``detail``."""

    name: str
    ok: bool | None
    reason: str | None = None
    fatal: bool = True
    detail: dict[str, Any] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        return {"check": self.name, "ok": self.ok, "reason": self.reason, **self.detail}


def summarize(checks: Iterable[Check]) -> tuple[str, int, list[str]]:
    """(status, HTTP status, reasons) for ``checks``: see the module docstring; reasons are "name: reason"
    for every check not ok, in order."""
    checks = list(checks)
    reasons = [f"{c.name}: {c.reason or 'not known yet'}" for c in checks if c.ok is not True]
    if any(c.ok is False and c.fatal for c in checks):
        return DOWN, 503, reasons
    if any(c.ok is None for c in checks):
        return STARTING, 503, reasons
    if any(c.ok is False for c in checks):
        return DEGRADED, 200, reasons
    return OK, 200, reasons


class Reachability:
    """Whether something kvgate calls (the router) answers, from every attempt's result; ``since`` the last
    change (the caller's clock, seconds). :meth:`note` returns "down" or "up" on a change (the caller logs
    that one line) and None otherwise, so a failing router costs one log line, not one per request."""

    def __init__(self) -> None:
        self.ok: bool | None = None
        self.reason: str | None = None
        self.since: float | None = None
        self.failures = 0  # attempts failed since the last success

    def note(self, ok: bool, reason: str | None, now: float) -> str | None:
        """One attempt's result: ``ok`` (it answered) or not, with ``reason`` (what failed). Returns the
        change ("down", "up") or None; the first result is a change only when it is a failure."""
        before = self.ok
        if ok:
            self.failures = 0
            self.ok, self.reason = True, None
        else:
            self.failures += 1
            self.ok, self.reason = False, reason
        if before is not self.ok:
            self.since = now
            if ok:
                return "up" if before is False else None
            return "down"
        return None


def router_check(r: Reachability, upstream: str, now: float, placed_routes: Iterable[str] = (),
                 usable_engines: int = 0, placed_answered: int = 0) -> Check:
    """The router check. ``placed_routes``: the routes on which kvgate places a session's calls on the engines
    itself (they never reach the router); ``usable_engines``: engines a placed call can go to (regular engines,
    not PD workers) usable now; ``placed_answered``: placed calls an engine answered since the router became
    unreachable. Unreachable, it is fatal unless kvgate
    places calls and an engine is usable: those calls are served (not fatal: degraded), every other gets
    kvgate's 502. ``detail`` has the figures: since_s (since the last change), failures (attempts failed
    since), placed_routes, usable_engines, placed_calls_answered."""
    if r.ok is None:
        return Check("router", None, f"{upstream} not asked yet")
    routes = list(placed_routes)
    detail: dict[str, Any] = {"upstream": upstream, "since_s": None if r.since is None else round(now - r.since, 3),
                              "failures": r.failures, "placed_routes": routes}
    if r.ok:
        return Check("router", True, f"{upstream} answers", detail=detail)
    detail.update(usable_engines=usable_engines, placed_calls_answered=placed_answered)
    if routes and usable_engines > 0:
        return Check("router", False, f"{upstream} unreachable ({r.reason}); a session's calls on "
                     f"{', '.join(routes)} go straight to the engines kvgate places them on ({usable_engines} "
                     f"usable, {placed_answered} calls answered since), every other call gets kvgate's 502",
                     fatal=False, detail=detail)
    return Check("router", False, f"{upstream} unreachable ({r.reason}); forwarded calls get kvgate's 502",
                 detail=detail)


def engines_check(engines: Iterable[tuple[str, bool, str | None]], discovered: bool,
                  discovery_error: str | None, upstream_kind: str | None = None,
                  roles: dict[str, str] | None = None, router_reached: bool = True) -> Check:
    """The engines check from (url, usable, why not) per engine. Fatal when none is usable, or when no engine
    is known and the upstream is not a router (``upstream_kind`` "other": it answered neither /workers nor
    /list_workers nor an engine's /server_info); not fatal when some are down, the engine list could not be
    read (the last good list is kept) or the upstream is an engine (``upstream_kind`` "engine": calls reach
    it, but kvgate knows no engine to close sessions on). ``roles`` (url -> regular|prefill|decode): in a
    prefill/decode fleet every call needs one prefill and one decode worker (smg's PD router), so it is fatal
    too when no prefill or no decode worker is usable. ``router_reached`` False: the router was not reached, so
    no engine list is no news of the engines (the router check says why)."""
    engines = list(engines)
    roles = roles or {}
    down = [(u, why) for u, usable, why in engines if not usable]
    detail: dict[str, Any] = {"engines": len(engines), "usable": len(engines) - len(down),
                              "unusable": {u: why for u, why in down}}
    if discovery_error is not None and not engines and upstream_kind == "other":
        return Check("engines", False, f"the upstream is not an SGLang router ({discovery_error}, and no "
                     "engine's /server_info): forwarded calls fail (is it the router's Prometheus port?)",
                     detail=detail)
    if discovery_error is not None and not engines and upstream_kind == "engine":
        return Check("engines", False, f"the upstream is an SGLang engine, not a router ({discovery_error}): "
                     "list the engines under engines: in the config", fatal=False, detail=detail)
    if any(roles.get(u) in ("prefill", "decode") for u, _, _ in engines):
        usable_by = {r: sum(1 for u, ok, _ in engines if ok and roles.get(u) == r) for r in ("prefill", "decode")}
        detail["usable_by_role"] = usable_by
        for r in ("prefill", "decode"):
            if engines and len(down) < len(engines) and usable_by[r] == 0:
                return Check("engines", False, f"no {r} worker is usable: every call needs one (smg's PD router)",
                             detail=detail)
    if discovery_error is not None and not engines:
        # the router answers (its own check says when it does not) but not with a list kvgate reads
        return Check("engines", False, f"engine discovery failed ({discovery_error}) and no engine is known",
                     fatal=False, detail=detail)
    if not engines:
        return Check("engines", False, "no engine configured" if not discovered else "the router lists no engine"
                     if router_reached else "no engine known: the router was not reached (see the router check)",
                     detail=detail)
    if len(down) == len(engines):
        return Check("engines", False, "no engine is usable: " + "; ".join(f"{u} {why}" for u, why in down),
                     detail=detail)
    if down:
        return Check("engines", False, f"{len(down)} of {len(engines)} engines unusable: "
                     + "; ".join(f"{u} {why}" for u, why in down), fatal=False, detail=detail)
    if discovery_error is not None:
        return Check("engines", False, f"engine discovery failed ({discovery_error}); the last good list of "
                     f"{len(engines)} is kept", fatal=False, detail=detail)
    return Check("engines", True, f"{len(engines)} of {len(engines)} usable", detail=detail)
