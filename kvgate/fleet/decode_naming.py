"""Naming the decode worker of a PD call to smg (pure: no I/O, times passed in).

In a prefill/decode fleet kvgate cannot send a call straight to a worker (a PD worker refuses a call without
the router's bootstrap fields), but smg 1.13's PD router decodes a call on the worker named by the request
header ``X-SMG-Target-Worker: <index>`` when its decode policy is ``consistent_hashing`` (the index counts the
decode workers smg deems available; docs/compatibility.md, measured). So kvgate picks the decode worker itself
(placement: room first, the session's prefix) and names it; smg still picks the prefill worker and runs the
bootstrap handshake. smg's worker overload protection takes a loaded worker out of that count for a while and
shifts every index after it: kvgate needs smg run without it (--disable-worker-overload-protection).

The index is smg's, and its order is not documented. Measured on smg 1.13: on /generate it is the order
/workers lists the decode workers; on the OpenAI routes (chat, completions) it is the order of their /workers
``id`` (sorted). Those are kvgate's first guesses, and the order is learned per route from the answers: smg
names the worker that decoded the call (``x-smg-routed-worker-id``).
  - A named call decoded there is a hit.
  - One decoded on another worker teaches the order: that index is that worker's on this route (the two
    workers' positions swap). A fixed order is learned in at most (decode workers - 1) such answers per route.
  - An answer that contradicts what an earlier answer taught (index i decoded on X, later on Y) means smg's
    decode policy does not read the header (it hashes the routing key, or balances load). ``max_misses`` such
    contradictions among the last ``window`` answers switch naming off for ``retry_s`` seconds; calls then go
    to smg unnamed, as without kvgate's placement.
  - One refused with smg's 503 ``no_available_workers`` names an index smg does not count: with
    ``consistent_hashing`` on the prefill side too, the index also picks the prefill worker, so an index past
    the prefill workers is refused; a worker whose circuit is open shifts the rest. smg's count and kvgate's
    differ, so naming is off for ``retry_s`` seconds (the call goes again unnamed).
While naming is off, kvgate places no call on a decode worker: smg picks it, as without kvgate's placement.
"""

from __future__ import annotations

from collections import deque
from typing import Iterable

from kvgate.fleet import roles
from kvgate.fleet.discovery import Engine

#: The request header smg 1.13's consistent_hashing (and manual) policy reads to pick a worker by index.
TARGET_WORKER_HEADER = "X-SMG-Target-Worker"

TRYING, NAMING, OFF = "trying", "naming", "off"


class DecodeNaming:
    """Which ``X-SMG-Target-Worker`` index names a decode worker on a route, and whether kvgate names it now.

    ``set_workers(engines)`` takes the router's engine list (kvgate.fleet.discovery.parse_workers order);
    ``index(url, route, now)`` is the index to send for decode worker ``url`` on ``route`` (None: send the
    call unnamed); ``answered(...)`` and ``refused(...)`` record what smg did with a named call and return
    the new state when it changed (for one log line), else None. States: ``trying`` (no named call
    decoded where named yet), ``naming`` (smg honoured a name), ``off`` (smg's answers contradict one
    another, or it refused a name; named again after ``retry_s`` seconds).
    ``supported`` is False outside a PD fleet, or when a decode worker has several DP ranks (smg ``--dp-aware``
    lists each rank as a worker; kvgate does not name ranks). Times are seconds on one clock.
    """

    def __init__(self, max_misses: int = 3, window: int = 16, retry_s: float = 60.0):
        if max_misses < 1 or window < max_misses or retry_s < 0:
            raise ValueError("max_misses must be >= 1, window >= max_misses and retry_s >= 0")
        self.max_misses = max_misses
        self.window = window
        self.retry_s = retry_s
        self.state = TRYING
        self.supported = False
        self._workers: list[str] = []  # healthy decode workers, /workers order
        self._by_id: list[str] = []  # the same, by smg's worker id
        self._order: dict[str, list[str]] = {}  # route -> index -> worker, as learned
        self._seen: dict[str, dict[int, str]] = {}  # route -> index -> the worker an answer named
        self._recent: deque[bool] = deque(maxlen=window)  # answers: True = contradicted an earlier one
        self._off_until = 0.0
        self.hits = 0
        self.relearned = 0
        self.contradicted = 0
        self.refusals = 0

    def set_workers(self, engines: Iterable[Engine]) -> None:
        """The router's engines now: the healthy decode workers in listed order are /generate's first guess
        (indexes 0, 1, ...), by worker id the other routes'. A changed list starts the learning again."""
        engines = list(engines)
        decode = [e for e in engines if roles.role(e) == roles.DECODE]
        self.supported = bool(decode) and any(roles.role(e) == roles.PREFILL for e in engines) \
            and all(e.dp_ranks <= 1 for e in decode)
        healthy = [e for e in decode if e.healthy] if self.supported else []
        workers = [e.url for e in healthy]
        by_id = [e.url for e in sorted(healthy, key=lambda e: e.worker_id)] \
            if all(e.worker_id is not None for e in healthy) else workers
        if workers != self._workers or by_id != self._by_id:
            self._workers, self._by_id = workers, by_id
            self._order.clear()
            self._seen.clear()
            self._recent.clear()

    def names(self, url: str) -> bool:
        """Whether ``url`` is a healthy decode worker of a fleet kvgate can name workers in (whatever the
        state: its calls go through the router, named or not)."""
        return url in self._workers

    def _route_order(self, route: str) -> list[str]:
        order = self._order.get(route)
        if order is None:
            order = self._order[route] = list(self._workers if route == "/generate" else self._by_id)
        return order

    def index(self, url: str, route: str, now: float) -> int | None:
        """The index to send for decode worker ``url`` on ``route`` at ``now``, or None: not a worker kvgate
        names, or naming off (until ``retry_s`` seconds after it went off: then tried again)."""
        if url not in self._workers:
            return None
        if self.state == OFF:
            if now < self._off_until:
                return None
            self.state = TRYING
            self._seen.clear()
            self._recent.clear()
        return self._route_order(route).index(url)

    def answered(self, url: str, route: str, index: int, routed: str | None, now: float) -> str | None:
        """A call on ``route`` named ``index`` for ``url`` was decoded, smg says, on ``routed`` (a base URL;
        None when smg did not say: counted neither way). Returns the new state if it changed. An answer to a call
        named before naming went off changes nothing (it says how smg was, not how it is)."""
        if routed is None or routed not in self._workers or self.state == OFF:
            return None
        seen = self._seen.setdefault(route, {})
        before = seen.get(index)
        seen[index] = routed
        contradicts = before is not None and before != routed
        self._recent.append(contradicts)
        if contradicts:
            self.contradicted += 1
            if sum(self._recent) >= self.max_misses and self.state != OFF:
                self._off_until = now + self.retry_s
                return self._set(OFF)
            return None
        order = self._route_order(route)
        if routed == url:
            self.hits += 1
            return self._set(NAMING)
        # smg's index ``index`` is ``routed`` on this route: swap it into place
        i, j = order.index(url), order.index(routed)
        if i == index:
            order[i], order[j] = order[j], order[i]
        self.relearned += 1
        return None

    def refused(self, url: str, route: str, now: float) -> str | None:
        """smg refused a call on ``route`` named for ``url`` (503 no_available_workers): naming is off for
        ``retry_s`` seconds. Returns the new state if it changed."""
        self.refusals += 1
        self._off_until = now + self.retry_s
        return self._set(OFF)

    def _set(self, state: str) -> str | None:
        if state == self.state:
            return None
        self.state = state
        return state

    def as_json(self, now: float) -> dict:
        """For /kvgate/engines: state, counts, each route's learned order, seconds until naming is tried again
        (0 unless off)."""
        return {"state": self.state if self.supported else "unsupported", "hits": self.hits,
                "relearned": self.relearned, "contradicted": self.contradicted, "refusals": self.refusals,
                "order": {r: list(o) for r, o in self._order.items()},
                "retry_in_s": round(max(0.0, self._off_until - now), 3) if self.state == OFF else 0.0}
