"""Small asyncio helpers shared by kvgate's background loops (I/O edge).

Waiting for an event with a time limit: kvgate's loops use ``async with asyncio.timeout(s): await ev.wait()``,
not ``asyncio.wait_for(ev.wait(), s)``. On Python 3.11, wait_for returns normally when the task is cancelled
just as the event is set (the inner wait already done) and the cancel is lost: a background loop then runs on
and ``cancel_tasks`` waits for it for ever (measured: the admission timer hung the gate's stop() this way).

Libraries lose a cancel the same way: redis-py sends each command under ``asyncio.wait_for`` (measured: a cancel
landing while the Redis subscriber connected and subscribed was lost there; the listener went on to its
``get_message`` loop and a replica's stop() waited for ever, in three runs of four beside a busy core).
``cancel_tasks`` therefore cancels a task again while it runs on, and gives up on it, logged, rather than hang
a shutdown; loops that call such libraries also check ``Task.cancelling()`` themselves.
"""

from __future__ import annotations

import asyncio
import logging

log = logging.getLogger("kvgate")


async def cancel_tasks(*tasks: asyncio.Task | None, grace_s: float = 1.0, tries: int = 5) -> int:
    """Cancel the given tasks (None entries are skipped) and wait until each has finished. A task still
    running ``grace_s`` seconds after a cancel is cancelled again, up to ``tries`` times; one that outlives
    them all is logged and left (a stop never hangs on a lost cancel). Their exceptions are retrieved.
    Returns how many cancels were sent again (0 when every task honoured its first)."""
    live = [t for t in tasks if t is not None and not t.done()]
    again = 0
    for attempt in range(tries):
        if not live:
            return again
        if attempt:
            again += len(live)
        for t in live:
            t.cancel()
        done, pending = await asyncio.wait(live, timeout=grace_s)
        for t in done:
            if not t.cancelled():
                t.exception()  # retrieved, so asyncio does not report it as never retrieved
        live = list(pending)
    for t in live:
        log.warning("task %s did not stop after %d cancels; left running", t.get_name(), tries)
    return again
