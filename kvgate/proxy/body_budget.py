"""The server's in-flight request body budget (pure; no asyncio; an injected clock).

Request body bytes held in memory at once, all connections together, are bounded by ``total``: a body takes
its declared length (a chunked one takes steps as it arrives) before it is read; past the budget it waits,
first come first served, and is refused once it waited ``wait_s``. A body larger than the whole budget goes
when nothing else holds any, so no request is refused for its size alone (``max_body_bytes`` does that).
kvgate.proxy.server pauses the waiting connection's reading and resumes it when granted; tests/test_body_budget.py
tests the rules without sockets.
"""

from __future__ import annotations

import collections
from typing import Any, Callable


_NONE: list = []  # what release() returns when nobody waits (never changed)


class Ticket:
    """One request's share of the budget: ``held`` bytes it holds, ``want`` bytes it waits for (0: not
    waiting), ``since`` when it started waiting (the clock's seconds), ``owner``: the request (the shell's)."""

    __slots__ = ("held", "want", "since", "owner")

    def __init__(self, owner: Any = None):
        self.held = 0
        self.want = 0
        self.since = 0.0
        self.owner = owner


_new_ticket = object.__new__


class BodyBudget:
    """``total`` bytes shared by the request bodies in flight; ``wait_s`` the longest wait for room, seconds;
    ``clock()`` seconds (monotonic)."""

    __slots__ = ("total", "wait_s", "clock", "held", "_queue")

    def __init__(self, total: int, wait_s: float, clock: Callable[[], float]):
        self.total = total
        self.wait_s = wait_s
        self.clock = clock
        self.held = 0  # bytes held by tickets now
        self._queue: collections.deque[Ticket] = collections.deque()  # tickets waiting, oldest first

    @property
    def waiting(self) -> int:
        """How many tickets wait for room."""
        return len(self._queue)

    def admit(self, owner: Any, n: int) -> Ticket:
        """A new ticket for ``owner`` taking ``n`` bytes: granted at once (``want`` 0) when take() would grant
        it, else waiting (``want`` n). One call where Ticket() and take() were two: the server asks this for
        every request with a body."""
        t = _new_ticket(Ticket)  # (no __init__ call: the four fields are set here)
        t.owner = owner
        held = self.held
        if not self._queue and (held + n <= self.total or held == 0):
            self.held = held + n
            t.held = n
            t.want = 0
            t.since = 0.0
            return t
        t.held = 0
        t.want = n
        t.since = self.clock()
        self._queue.append(t)
        return t

    def take(self, ticket: Ticket, n: int) -> bool:
        """Take ``n`` more bytes for ``ticket``: True when granted now; False when it waits (queued behind the
        others: no ticket overtakes one that waits) until a release() grants it or expire() refuses it."""
        held = self.held
        if not self._queue and (held + n <= self.total or held == 0):
            self.held = held + n
            ticket.held += n
            return True
        ticket.want = n
        ticket.since = self.clock()
        self._queue.append(ticket)
        return False

    def release(self, ticket: Ticket) -> list[Ticket]:
        """``ticket`` is done (answered, or its connection gone): what it holds goes back, it stops waiting.
        Returns the tickets granted thanks to it, in order (their ``want`` is now ``held``)."""
        if ticket.want:
            ticket.want = 0
            try:
                self._queue.remove(ticket)
            except ValueError:
                pass
        if ticket.held:
            self.held -= ticket.held
            ticket.held = 0
        return self._grant() if self._queue else _NONE

    def _grant(self) -> list[Ticket]:
        q = self._queue
        granted = []
        while q:
            t = q[0]
            if self.held + t.want > self.total and self.held != 0:
                break
            q.popleft()
            self.held += t.want
            t.held += t.want
            t.want = 0
            granted.append(t)
        return granted

    def expire(self) -> tuple[list[Ticket], list[Ticket]]:
        """Refuse the tickets that waited ``wait_s`` or longer: taken out of the queue with nothing, oldest
        first. Returns (those refused, those granted now that they no longer stand in front)."""
        q = self._queue
        late = self.clock() - self.wait_s
        out = []
        while q and q[0].since <= late:
            t = q.popleft()
            t.want = 0
            out.append(t)
        return out, (self._grant() if out and q else [])
