"""The program policy's records: a program's state, why a turn waits, the shell's actions, and the coordinator's
per-program and per-waiter records (pure, no behaviour beyond small helpers)."""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Hashable

from .turn_gaps import OWN_GAPS

__all__ = ["ProgramState", "WaitReason", "Action", "BOUND_REASON", "NO_SEAT"]


class ProgramState(str, enum.Enum):
    """live: a turn is in flight; in_tool: between turns (a tool call runs); paused: held by kvgate; ended:
    in a tool call far past what its own and its group's gaps predict (reported by program_states; inside the
    coordinator such a program is IN_TOOL with an overdue deadline behind it)."""

    LIVE = "live"
    IN_TOOL = "in_tool"
    PAUSED = "paused"
    ENDED = "ended"


class WaitReason(enum.StrEnum):
    """Why a turn waits (Decision.reason): the ledger's refusals (kvgate.admission.ledger.REFUSAL_REASONS) and
    the resident bound's. A str: equal to, formatted and JSON-serialised as its value."""

    CAPACITY_EXHAUSTED = "capacity_exhausted"
    PRESSURE_GUARD = "pressure_guard"
    DEGRADED = "degraded"
    RESIDENT_BOUND = "resident-bound"  # its place has no free seat under the resident bound

    @classmethod
    def of(cls, reason: str) -> "WaitReason":
        """The member for a ledger refusal's reason (KeyError for a reason this enum does not name)."""
        return _REASONS[reason]


_REASONS: dict[str, WaitReason] = {r.value: r for r in WaitReason}

#: The reason a waiter gives while its place has no free seat under the resident bound.
BOUND_REASON = WaitReason.RESIDENT_BOUND


class _NoSeat:
    """_Program.seat of a program that holds no seat (a sentinel)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "NO_SEAT"


NO_SEAT: Any = _NoSeat()


@dataclass(frozen=True)
class Action:
    """Something the shell must do: ``kind`` "close" = close ``session_id``'s engine session (a pause);
    "ended" = the program ended by the evidence while its session stays open (pausing off): session placement
    stops counting its KV (kvgate.fleet.placement, dormant)."""

    kind: str
    session_id: str
    place: Any


@dataclass
class _Program:
    sid: Hashable
    place: Any
    state: ProgramState
    since: float
    resident: int = 0
    blocks: tuple = ()
    turns: int = 0
    marked: bool = False
    ended: bool = False  # the session closed while a turn was in flight: drop it when the turn ends
    inflight: dict = field(default_factory=dict)  # ticket -> see ProgramCoordinator._start_turn
    scale: float = 1.0  # engine prompt_tokens / kvgate's estimate, from the last answered turn
    group: Hashable = None  # the chain hash of its first turn's prompt: GRPO siblings share it
    last_end: float | None = None  # when its last turn ended (None: no turn has ended yet)
    overdue_at: float = float("inf")  # idle past this: ended (from its and its group's gaps)
    gaps: deque = field(default_factory=lambda: deque(maxlen=OWN_GAPS))
    seat: Any = NO_SEAT  # the place whose resident seat it holds (resident bound on)
    claim: tuple | None = None  # paused, expected back: (until, n) of the seat kept for it against new programs
    n: int = 0  # its rank among the coordinator's programs (the order they joined in)


@dataclass(slots=True)
class _Waiter:
    ticket: Hashable
    sid: Hashable
    tokens: int
    prompt_tokens: int
    place: Any
    blocks: tuple
    enqueued_at: float
    resume: bool
    seq: int
    reason: WaitReason | None = None
    bound: bool = False  # counted once in wait_resident_bound
    movable: bool = False  # kvgate places it: it may go to any engine with room
    cost_due: float = float("inf")  # it goes then (bypass-cost): its wait has cost what its admission would
    # its last pass over the other engines, all refused over their own room: (the FreeRank it read, the holdings'
    # version then, {place: charge}, the largest charge, its own place's charge when that place too refused over
    # its own room, else -1); kvgate.admission.program_queue._fit and _refused_again
    refused: tuple | None = None
    whole: int = -1  # what it charges on an engine that holds none of its prompt (tokens); -1 until read


def one_turn(sid: Hashable) -> bool:
    """Whether ``sid`` is a one-turn request's (no session): ("one-turn", ticket)."""
    return isinstance(sid, tuple) and bool(sid) and sid[0] == "one-turn"


def decrement(counts: dict, key: Any) -> None:
    """counts[key] -= 1, the key dropped at 0 (the per-place counts hold only places with something)."""
    n = counts[key] - 1
    if n:
        counts[key] = n
    else:
        del counts[key]


def nonneg_int(v: Any) -> int | None:
    """``v`` if it is an int >= 0 (not a bool), else None."""
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        return None
    return v
