"""kvgate.common.aio.cancel_tasks: a stop never hangs on a task that loses or ignores its cancel."""

from __future__ import annotations

import asyncio
import logging

from kvgate.common.aio import cancel_tasks


async def test_a_task_that_swallows_one_cancel_is_cancelled_again():
    """A library that swallows a cancel (as redis-py's read timeouts can) leaves the task running; the second
    cancel ends it, and cancel_tasks says one cancel was sent again."""
    caught = []
    forever = asyncio.Event()

    async def swallows_once():
        try:
            await forever.wait()
        except asyncio.CancelledError:
            caught.append(1)
            asyncio.current_task().uncancel()  # lost, as a library that converts it to a timeout does
        await forever.wait()

    async def honours():
        await forever.wait()

    a, b = asyncio.create_task(swallows_once()), asyncio.create_task(honours())
    await asyncio.sleep(0)
    again = await cancel_tasks(a, None, b, grace_s=0.05)
    assert again == 1 and caught == [1]
    assert a.cancelled() and b.cancelled()


async def test_a_task_that_ignores_every_cancel_is_logged_and_left(caplog):
    release = asyncio.Event()
    cancels = []

    async def stubborn():
        while not release.is_set():
            try:
                await release.wait()
            except asyncio.CancelledError:
                cancels.append(1)
                asyncio.current_task().uncancel()

    t = asyncio.create_task(stubborn(), name="stubborn")
    await asyncio.sleep(0)
    with caplog.at_level(logging.WARNING, logger="kvgate"):
        again = await cancel_tasks(t, grace_s=0.02, tries=3)
    assert again == 2 and len(cancels) == 3 and not t.done()
    assert "stubborn did not stop after 3 cancels" in caplog.text
    release.set()
    await t


async def test_a_task_that_failed_has_its_exception_retrieved(caplog):
    async def fails():
        raise ValueError("boom")

    t = asyncio.create_task(fails())
    await asyncio.sleep(0)
    assert t.done()
    assert await cancel_tasks(t) == 0
    t2 = asyncio.create_task(fails())
    assert await cancel_tasks(t2) == 0 and t2.cancelled()  # cancelled before it ran
