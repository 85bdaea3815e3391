"""The fleet's layout: which engines hold a session's KV and which only prefill (pure).

A regular fleet's engines each prefill and decode, so each holds the KV of the sessions it served. In a
prefill/decode (PD) fleet (smg ``--pd-disaggregation``; docs/compatibility.md) the router sends every call to
one prefill worker and one decode worker; the decode worker keeps the session's prefix in its radix cache between
turns (SGLang ``--disaggregation-decode-enable-radix-cache``), and the client's answer, with its cached tokens,
is the decode worker's. A prefill worker's radix cache also holds the prompts it prefilled, but only to save
prefill compute: the request's KV leaves it for the decode worker.

So, for the code that counts or places KV:
  - :func:`kv_holders`: the engines whose KV pools hold sessions between turns (decode workers in a PD fleet,
    regular engines otherwise): the pools admission's ceiling and placement are about;
  - :func:`prefill_only`: the prefill workers (never a session's home, never a target for a direct call: a
    PD worker refuses a call without the router's bootstrap fields);
  - :func:`close_targets`: every engine that may hold a session's KV, of any role (a close goes to all).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from kvgate.fleet.discovery import Engine

REGULAR, PREFILL, DECODE = "regular", "prefill", "decode"

#: Layouts: no engine known; every engine regular; prefill and decode workers only; both kinds (smg serves
#: regular workers in PD mode only as a fallback; kvgate treats regular and decode engines alike as KV holders).
EMPTY, REGULAR_LAYOUT, PD, MIXED = "empty", "regular", "pd", "mixed"


def role(e: Engine) -> str:
    """The engine's role: prefill, decode, or regular (any other or unknown worker_type)."""
    return e.worker_type if e.worker_type in (PREFILL, DECODE) else REGULAR


def kv_holders(engines: Iterable[Engine]) -> list[Engine]:
    """The engines that hold sessions' KV between turns, in the given order: every engine but prefill
    workers (decode workers in a PD fleet, regular engines otherwise)."""
    return [e for e in engines if role(e) != PREFILL]


def prefill_only(engines: Iterable[Engine]) -> list[Engine]:
    """The prefill workers, in the given order."""
    return [e for e in engines if role(e) == PREFILL]


def close_targets(engines: Iterable[Engine]) -> list[str]:
    """Base URLs a session's close goes to: every engine of every role (a prefill worker's radix cache holds
    the session's prompts too, tagged with its session_id)."""
    return [e.url for e in engines]


@dataclass(frozen=True)
class Layout:
    """What the fleet looks like: ``kind`` (empty, regular, pd, mixed) and the engine URLs per role."""

    kind: str
    regular: tuple[str, ...] = ()
    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()
    dp_ranks: int = 0  # DP ranks over every engine (smg --dp-aware lists each; 1 per engine otherwise)

    @property
    def pd(self) -> bool:
        """Prefill and decode workers present (a PD fleet, possibly with regular engines too)."""
        return self.kind in (PD, MIXED)

    def describe(self) -> str:
        """One line for the log and /kvgate/health: "2 prefill + 6 decode workers (PD; sessions live on the
        decode workers)", "3 regular engines", "no engine"."""
        if self.kind == EMPTY:
            return "no engine"
        ranks = f", {self.dp_ranks} DP ranks" if self.dp_ranks > len(self.regular) + len(self.prefill) \
            + len(self.decode) else ""
        if self.kind == REGULAR_LAYOUT:
            n = len(self.regular)
            return f"{n} regular engine{'s' if n != 1 else ''}{ranks}"
        parts = [f"{len(self.prefill)} prefill", f"{len(self.decode)} decode"]
        if self.regular:
            parts.append(f"{len(self.regular)} regular")
        where = "decode workers" + (" and regular engines" if self.regular else "")
        missing = ("; no decode worker: nothing decodes" if not self.decode
                   else "; no prefill worker: nothing prefills" if not self.prefill else "")
        return f"{' + '.join(parts)} workers (PD{ranks}; sessions live on the {where}{missing})"

    def as_json(self) -> dict:
        return {"kind": self.kind, "regular": len(self.regular), "prefill": len(self.prefill),
                "decode": len(self.decode), "dp_ranks": self.dp_ranks, "description": self.describe()}


def layout(engines: Iterable[Engine]) -> Layout:
    """The :class:`Layout` of ``engines`` (order kept within each role)."""
    engines = list(engines)
    by = {REGULAR: [], PREFILL: [], DECODE: []}
    for e in engines:
        by[role(e)].append(e.url)
    if not engines:
        kind = EMPTY
    elif not by[PREFILL] and not by[DECODE]:
        kind = REGULAR_LAYOUT
    elif by[REGULAR]:
        kind = MIXED
    else:
        kind = PD
    return Layout(kind, tuple(by[REGULAR]), tuple(by[PREFILL]), tuple(by[DECODE]),
                  sum(max(e.dp_ranks, 1) for e in engines))
