"""Engines that share a host's cores: a simulated batch takes longer while other engines compute.

Two CPU SGLang engines on one 2-core machine slow each other down (measured by
``scripts/fit_engine_profile.py --contention``: docs/simulator-fidelity.md); a simulated engine alone cannot
know that the others compute. Engines started with the same ``--host-board`` directory share it: each DP rank
holds one slot of the board file in it, where it writes until when its current batch computes (CLOCK_MONOTONIC,
the same clock in every process on the host), and reads how many other slots are busy now.

:func:`contended_seconds` is the rule (pure); :class:`HostBoard` is the shared file (the edge, I/O).
"""

from __future__ import annotations

import fcntl
import mmap
import os
import struct
from typing import Optional

SLOTS = 64
_SLOT = struct.Struct("d")


def contended_seconds(seconds: float, others_busy: int, slowdown: float) -> float:
    """A batch's time when ``others_busy`` other engines compute at its start.

    ``seconds``: the batch's time alone (seconds); ``slowdown``: the extra fraction of that time each other busy
    engine adds (0.8: a batch takes 1.8x as long while one other engine computes), measured on the host. Linear
    in the number of others: the simplest rule through the two points measured (alone, one other busy).
    Raises ValueError on a negative slowdown or count."""
    if slowdown < 0 or others_busy < 0:
        raise ValueError("slowdown and others_busy must be >= 0")
    return seconds * (1.0 + slowdown * others_busy)


class HostBoard:
    """One DP rank's slot in a host board shared by the engines of one host.

    ``path``: a directory (created when missing) holding the board file (``SLOTS`` slots of 8 bytes) and a lock
    file per slot. The slot is the first one whose lock file nobody holds: an exclusive ``flock``, which the
    kernel drops when the process ends (a crashed engine's slot is free again) and which two boards in one
    process also exclude each other from. Raises OSError when the directory cannot be used and RuntimeError
    when every slot is taken."""

    def __init__(self, path: str):
        self.path = path
        os.makedirs(path, exist_ok=True)
        self._lock_fd, self.slot = self._claim()
        try:
            self._fd = os.open(os.path.join(path, "board"), os.O_RDWR | os.O_CREAT, 0o644)
            if os.fstat(self._fd).st_size < SLOTS * _SLOT.size:
                os.ftruncate(self._fd, SLOTS * _SLOT.size)
            self._map = mmap.mmap(self._fd, SLOTS * _SLOT.size)
        except BaseException:
            os.close(self._lock_fd)
            raise
        self._write(0.0)

    def _claim(self) -> tuple[int, int]:
        for i in range(SLOTS):
            fd = os.open(os.path.join(self.path, f"slot-{i}.lock"), os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return fd, i
            except OSError:
                os.close(fd)
        raise RuntimeError(f"host board {self.path}: all {SLOTS} slots are taken")

    def _write(self, until: float) -> None:
        _SLOT.pack_into(self._map, self.slot * _SLOT.size, until)

    def busy_until(self, until: float) -> None:
        """Record that this rank computes until ``until`` (time.monotonic seconds)."""
        self._write(until)

    def others_busy(self, now: float) -> int:
        """How many other slots compute at ``now`` (time.monotonic seconds)."""
        n = 0
        for i in range(SLOTS):
            if i != self.slot and _SLOT.unpack_from(self._map, i * _SLOT.size)[0] > now:
                n += 1
        return n

    def close(self) -> None:
        """Free the slot (idempotent)."""
        if self._lock_fd < 0:
            return
        self._write(0.0)
        self._map.close()
        os.close(self._fd)
        os.close(self._lock_fd)   # drops the lock
        self._lock_fd = -1


def open_board(path: Optional[str]) -> Optional[HostBoard]:
    """A :class:`HostBoard` on ``path``, or None when ``path`` is None or empty."""
    return HostBoard(path) if path else None
