"""Small asyncio helpers shared by kvgate's background loops (I/O edge).

Waiting for an event with a time limit: kvgate's loops use ``async with asyncio.timeout(s): await ev.wait()``,
not ``asyncio.wait_for(ev.wait(), s)``. On Python 3.11, wait_for returns normally when the task is cancelled
just as the event is set (the inner wait already done) and the cancel is lost: a background loop then runs on
and ``cancel_tasks`` waits for it for ever (measured: the admission timer hung the gate's stop() this way).
"""

from __future__ import annotations

import asyncio


async def cancel_tasks(*tasks: asyncio.Task | None) -> None:
    """Cancel the given tasks (None entries are skipped) and wait until each has finished."""
    live = [t for t in tasks if t is not None]
    for t in live:
        t.cancel()
    await asyncio.gather(*live, return_exceptions=True)
