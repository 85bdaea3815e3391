"""A client connection's states, why its reading is paused, and its timer tables (pure; no asyncio).

kvgate.proxy.server's connection asks ``ReadControl`` whether to pause or resume its transport's reading,
instead of weighing loose booleans itself; the server keeps its idle, slow-head, slow-body and lingering
connections in ``Timers`` (oldest first, so a sweep stops at the first still in time). tests/test_conn_state.py
tests both without sockets.
"""

from __future__ import annotations

import enum
from typing import Hashable


class Phase(enum.IntEnum):
    """Which requests a connection still serves; it only moves forward."""

    OPEN = 0       # serves every request it reads
    CLOSING = 1    # answers the request in hand (its body is still read), then closes: no further request
    LINGERING = 2  # answered and half-closed: what the client still sends is read and dropped, then closed
    LOST = 3       # the transport is gone


class Pause(enum.Flag):
    """Why the connection does not read: any reason set keeps its reading paused."""

    NONE = 0
    PIPELINED = enum.auto()  # a request waits for its turn behind the one being answered
    BODY = enum.auto()       # the handler has not taken the body bytes already buffered (server.BODY_HIGH_WATER)
    WRITE = enum.auto()      # the answers written wait in the transport: the client does not read them
    BUDGET = enum.auto()     # the body being read waits for room in the in-flight body budget
    STOPPED = enum.auto()    # for good: nothing more is parsed (a refusal, a malformed request, the last answer);
    #                          the requests already read are still answered unless the phase says otherwise


class ReadControl:
    """A connection's phase and the reasons its reading is paused. ``pause`` and ``clear`` return True when
    the transport must pause or resume reading now (once per change: the transport is never told twice).
    The reasons are kept as the flag set's integer value (``bits``): the connection tests them per write."""

    __slots__ = ("phase", "bits", "paused")

    def __init__(self) -> None:
        self.phase = Phase.OPEN
        self.bits = 0  # the Pause reasons set, as an int
        self.paused = False  # the transport's reading is paused

    @property
    def reasons(self) -> Pause:
        return Pause(self.bits)

    @property
    def closing(self) -> bool:
        """No further request is served on this connection."""
        return self.phase >= Phase.CLOSING

    @property
    def stopped(self) -> bool:
        """Nothing more is parsed: bytes that arrive are dropped."""
        return bool(self.bits & _STOPPED)

    def stop(self) -> None:
        """Parse nothing more (the transport keeps reading unless paused: what arrives is dropped)."""
        self.bits |= _STOPPED

    @property
    def lost(self) -> bool:
        return self.phase is Phase.LOST

    def advance(self, phase: Phase) -> None:
        """Move to ``phase`` unless the connection is already further."""
        if phase > self.phase:
            self.phase = phase

    def has(self, reason: Pause) -> bool:
        return bool(self.bits & reason.value)

    def pause(self, reason: Pause = Pause.NONE) -> bool:
        """Add ``reason`` (NONE: pause for no lasting reason, as a stopped connection does). True: pause the
        transport's reading now."""
        self.bits |= reason.value
        if self.paused or self.phase is Phase.LOST:
            return False
        self.paused = True
        return True

    def clear(self, reason: Pause) -> bool:
        """Remove ``reason``. True: resume the transport's reading now (paused, open and no reason left)."""
        self.bits &= ~reason.value
        if self.paused and self.phase is Phase.OPEN and not self.bits:
            self.paused = False
            return True
        return False

    def linger(self) -> bool:
        """Answered and half-closed: read again only to drop what the client still sends (stopped). True:
        resume the transport's reading now."""
        self.advance(Phase.LINGERING)
        self.bits |= _STOPPED
        was = self.paused
        self.paused = False
        return was


_STOPPED = Pause.STOPPED.value


class Timers(dict):
    """Keys (connections) with the time each was entered, oldest first (a dict keeps insertion order);
    ``expired`` takes out those at or before a deadline. ``t[key] = now`` enters a key (one already in keeps
    its place), ``restart`` moves it to the end; ``drop`` takes it out."""

    __slots__ = ()

    def restart(self, key: Hashable, now: float) -> None:
        """Restart ``key``'s clock at ``now``, moving it to the end."""
        self.pop(key, None)
        self[key] = now

    def enter_once(self, key: Hashable, now: float) -> None:
        """Start ``key``'s clock at ``now`` unless it runs already."""
        if key not in self:
            self[key] = now

    def drop(self, key: Hashable) -> None:
        self.pop(key, None)

    def expired(self, deadline: float) -> list:
        """Take out and return, oldest first, the keys entered at or before ``deadline``."""
        out = []
        while self:
            key = next(iter(self))
            if self[key] > deadline:
                break
            del self[key]
            out.append(key)
        return out
