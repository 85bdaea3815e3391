"""Coalescing a replica's Redis calls: the pure core of the shared state's write batch (no I/O; the clock is
passed in, monotonic seconds).

Every request made two to four Redis calls (its turn's start and end, with admission the shared queue's grant
and its release), and redis-py's asyncio client costs 110 to 170 us of CPU per call whatever it carries
(scripts/redis_call_cost.py). The shell (kvgate.shared.redis_state) therefore queues the calls of every
request here and sends what is queued as ONE script call; calls queued while one is on the wire go out
together when it answers. One call in flight at a time keeps the order calls were made in, so a turn's end
never reaches Redis before its start, and a release never before its grant.

What this module decides:
  - when: a call someone waits for (a grant, an idle claim, a close's epoch) and a turn's start go at once,
    with everything queued before them; the other writes, which nobody waits for (turn ends, releases,
    links, pause marks), wait up to ``linger_s`` for company (so at low concurrency, too, a request's writes
    share calls), or until ``max_ops`` are queued. A start does not linger: it re-opens a session that is
    closing, and a start that reached Redis late, after another replica began closing the session once the
    turn was over, would re-open it wrongly.
  - merging: a turn's start or end for a session whose previous turn write is still queued (not sent) joins
    it: the deltas add up, "a turn started" is kept (it re-opens a closing session), and the last activity
    is the latest of the two. A write of another kind on the session (its close, an idle claim) stops the
    merging, so nothing crosses it.
  - the batch: the oldest queued ops, at most ``max_ops`` (the script holds Redis while it runs).
  - a batch Redis did not run (unreachable, failed, timed out): what falls back, by metrics op label, and
    which lease releases must be kept to send again (Redis may have run part of it: a release is kept, a
    grant's answer is taken as lost; both are as for one call that failed).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Sequence

#: Ops a batch carries at most: the script applies them while Redis serves nobody else (a few us each).
MAX_OPS = 256
#: Seconds a write nobody waits for may wait for others to share its call. Other replicas see a turn's end,
#: a release's room or an inference link this much later at most (idle thresholds are seconds).
LINGER_S = 0.005


@dataclass(eq=False, slots=True)
class Op:
    """One queued Redis write (or read-modify-write). ``kind``: the batch script's op name (see
    kvgate.shared.scripts' BATCH); ``label``: the metrics op it falls back as (turn, idle, admission, inference);
    ``keys``: the Redis keys it touches, in the order the script reads them; ``args``: its other arguments
    (JSON-able); ``session``: the session a turn write merges on (None: never merged); ``delta``,
    ``started``, ``at``: a turn write's net in-flight change, whether a start is among its turns, and its
    latest activity (epoch seconds; sent as repr(), which Redis reads back exactly); ``waiter``: the shell's
    handle for the answer (a future), or None; ``release``: (keys, member) of a lease release, kept when the
    batch fails; ``lease``: (keys, member) a grant would hold (released if its asker is gone)."""

    kind: str
    label: str
    keys: Sequence[str]
    args: list = field(default_factory=list)
    session: str | None = None
    delta: int = 0
    started: bool = False
    at: float = 0.0
    waiter: Any = None
    release: tuple[list[str], str] | None = None
    lease: tuple[list[str], str] | None = None
    taken: bool = False


class WriteBatch:
    """The queue of ops not sent yet and the one batch in flight (see the module docstring)."""

    def __init__(self, max_ops: int = MAX_OPS, linger_s: float = LINGER_S):
        if max_ops < 1 or linger_s < 0:
            raise ValueError("max_ops must be >= 1 and linger_s >= 0")
        self.max_ops = max_ops
        self.linger_s = linger_s
        self.queued: list[Op] = []
        self._since: float | None = None  # when the oldest queued op was queued
        self._urgent = 0                  # queued ops someone waits for
        self.in_flight = False
        self._last: dict[str, Op] = {}   # session -> its last queued op (merging stops at any other kind)
        self.merged = 0                  # turn writes that joined a queued one (not sent on their own)

    def add(self, op: Op, now: float) -> None:
        """Queue ``op`` at ``now`` (merged into its session's queued turn write when it can be)."""
        if not self.queued:
            self._since = now
        sid = op.session
        if sid is not None:
            last = self._last.get(sid)
            if op.kind == "turn" and last is not None and last.kind == "turn" and not last.taken:
                last.delta += op.delta
                if op.started and not last.started:
                    last.started = True
                    self._urgent += 1
                if op.at > last.at:
                    last.at = op.at
                self.merged += 1
                return
            self._last[sid] = op
        self.queued.append(op)
        self._urgent += _urgent(op)

    def due_in(self, now: float) -> float | None:
        """Seconds until the queued ops should go (0: now); None when nothing is queued or a batch is in
        flight (its answer calls this again)."""
        if self.in_flight or not self.queued:
            return None
        if self._urgent or len(self.queued) >= self.max_ops:
            return 0.0
        return max(0.0, self._since + self.linger_s - now)

    def take(self, now: float) -> list[Op]:
        """The next batch (oldest first, at most max_ops), now in flight, whether due or not; [] when one is
        already in flight or nothing is queued."""
        if self.in_flight or not self.queued:
            return []
        batch, self.queued = self.queued[:self.max_ops], self.queued[self.max_ops:]
        if not self.queued:
            self._since = None
        for op in batch:
            op.taken = True
            self._urgent -= _urgent(op)
            if op.session is not None and self._last.get(op.session) is op:
                del self._last[op.session]
        self.in_flight = True
        return batch

    def done(self) -> None:
        """The batch in flight was answered (or failed)."""
        self.in_flight = False

    def drop_queued(self) -> list[Op]:
        """Everything queued, removed (Redis became unreachable: nothing more is sent until it answers)."""
        out, self.queued = self.queued, []
        self._last.clear()
        self._since, self._urgent = None, 0
        return out

    def __len__(self) -> int:
        return len(self.queued)


def _urgent(op: Op) -> bool:
    """Sent without lingering: someone waits for its answer, or a turn starts in it."""
    return op.waiter is not None or op.started


def fallbacks(ops: Sequence[Op]) -> tuple[Counter, list[tuple[list[str], str]]]:
    """For ops Redis did not confirm: how many fell back, by metrics op label (a merged turn write counts
    once), and the lease releases to keep and send again once Redis answers."""
    by_label = Counter(op.label for op in ops)
    releases = [op.release for op in ops if op.release is not None]
    return by_label, releases


def encode(ops: Sequence[Op], fixed_keys: Sequence[str]) -> tuple[list[str], list[list]]:
    """The batch script's KEYS (``fixed_keys`` first, then every other key once, in first-use order) and
    its op list: each op as [kind, [its keys' 1-based KEYS indexes], its arguments...]; a turn write's
    arguments are [at, delta, started 0 | 1]."""
    index = {k: i + 1 for i, k in enumerate(fixed_keys)}
    keys = list(fixed_keys)
    out = []
    for op in ops:
        idx = []
        for k in op.keys:
            i = index.get(k)
            if i is None:
                keys.append(k)
                i = index[k] = len(keys)
            idx.append(i)
        if op.kind == "turn":
            out.append([op.kind, idx, repr(op.at), op.delta, 1 if op.started else 0])
        else:
            out.append([op.kind, idx, *op.args])
    return keys, out
