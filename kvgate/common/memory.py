"""Giving memory back to the operating system after a burst of requests (I/O edge: calls into glibc).

A burst (thousands of requests held in admission, then gone) leaves CPython's and glibc's allocators
holding the freed memory: the cancelled handlers' exceptions and frames form reference cycles that only
the cyclic collector frees, and glibc keeps freed chunks in the middle of its heap until
``malloc_trim`` hands their pages back (man 3 malloc_trim).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import time

log = logging.getLogger("kvgate")

_trim = None
_looked = False


def _malloc_trim():
    """glibc's malloc_trim, or None elsewhere (musl, macOS)."""
    global _trim, _looked
    if not _looked:
        _looked = True
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            fn = libc.malloc_trim
            fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
            _trim = fn
        except (OSError, AttributeError):
            _trim = None
    return _trim


def give_back() -> float:
    """Collect reference cycles, then ask glibc to return its free pages (``malloc_trim(0)``). Returns the
    seconds it took. Never raises: memory that stays is only memory that stays."""
    t0 = time.perf_counter()
    try:
        gc.collect()
        fn = _malloc_trim()
        if fn is not None:
            fn(0)
    except Exception:  # pragma: no cover - a failed trim changes nothing a client sees
        log.exception("giving memory back failed")
    return time.perf_counter() - t0
