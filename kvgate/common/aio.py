"""Small asyncio helpers shared by kvgate's background loops (I/O edge)."""

from __future__ import annotations

import asyncio


async def cancel_tasks(*tasks: asyncio.Task | None) -> None:
    """Cancel the given tasks (None entries are skipped) and wait until each has finished."""
    live = [t for t in tasks if t is not None]
    for t in live:
        t.cancel()
    await asyncio.gather(*live, return_exceptions=True)
