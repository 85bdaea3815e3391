"""The admission seam between "request classified" and "request forwarded".

The proxy calls ``await gate.acquire(request_info)`` before forwarding and ``gate.release(ticket, observed)``
when the upstream attempt ends (response relayed, error, or client gone); ``observed`` is the response's
meta_info (prompt_tokens, completion_tokens, cached_tokens) when kvgate read it, else None. A gate must fail open:
any fault of its own returns a ticket that lets the request go at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol

from kvgate.common.classify import Classified


@dataclass(slots=True)
class RequestInfo:
    """What a gate may look at: the classified request, its headers, its session id (or None), where the
    placement stage sent it (place: engine URL and DP rank, or None when unknown: the router picks) and whether
    kvgate places the call itself (movable: the gate may then send it to another engine with room)."""

    classified: Classified
    headers: Mapping[str, str]
    session_id: str | None
    place: tuple[str, int | None] | None = None
    movable: bool = False


@dataclass(slots=True)
class Ticket:
    """The gate's answer. decision: admit | bypass-protected | bypass-degraded | bypass-aged | off.

    queue_s: seconds spent waiting. headers: added to the response (X-Kvgate-Admission ...). place: the engine
    (URL, DP rank) the gate counted the call on when it moved a movable call off the place it was given (the
    call must then go there), else None.
    """

    decision: str = "off"
    queue_s: float = 0.0
    handle: Any = None
    headers: list[tuple[str, str]] = field(default_factory=list)
    place: tuple[str, int | None] | None = None


class Gate(Protocol):
    """What the request path asks of admission. ``reads_headers``: whether acquire() reads the request's
    headers (the request path builds them only for a gate that does). ``shared``: the state replicas share
    (kvgate.shared.redis_state.SharedState) the gate holds its leases against too, set by the gateway when
    there is one, else None. start() and stop() run with the gateway; stats() is GET /kvgate/stats's answer;
    forget() is told a session the client or kvgate ended."""

    reads_headers: bool
    shared: Any

    async def acquire(self, info: RequestInfo) -> Ticket: ...

    def release(self, ticket: Ticket, observed: dict | None = None) -> None: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def stats(self) -> dict[str, Any]: ...

    def forget(self, session_id: str) -> None: ...


class OpenGate:
    """Admission off: every request goes at once and carries no admission headers; the rest of the protocol
    does nothing."""

    OFF = Ticket()
    reads_headers = False
    shared: Any = None

    async def acquire(self, info: RequestInfo) -> Ticket:
        return self.OFF

    def release(self, ticket: Ticket, observed: dict | None = None) -> None:
        return None

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    def stats(self) -> dict[str, Any]:
        return {"admission": "off"}

    def forget(self, session_id: str) -> None:
        return None
