"""pagedq.cancel.stop_tasks: a task that loses a cancel (as redis-py's wait_for does on Python
3.11) is cancelled again until it ends; one that never ends is handed back, not waited on."""

from __future__ import annotations

import asyncio

from pagedq.cancel import stop_tasks


async def _loses_first_cancels(lost: list[int], seen: list[int]) -> None:
    """Swallows its first ``lost[0]`` cancels, the way a cancel landing in wait_for's completing
    turn is dropped, then lets the next one through."""
    while True:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            seen.append(1)
            if len(seen) > lost[0]:
                raise
            asyncio.current_task().uncancel()


def test_a_lost_cancel_is_repeated_until_the_task_ends():
    async def main():
        seen: list[int] = []
        task = asyncio.create_task(_loses_first_cancels([2], seen))
        await asyncio.sleep(0)
        pending = await stop_tasks([task], timeout=30, recancel_s=0.01)
        return pending, task, seen

    pending, task, seen = asyncio.run(main())
    assert not pending and task.cancelled() and len(seen) == 3


def test_a_task_that_never_ends_is_returned_after_the_timeout():
    async def main():
        seen: list[int] = []
        lost = [10**9]
        task = asyncio.create_task(_loses_first_cancels(lost, seen))
        await asyncio.sleep(0)
        pending = await stop_tasks([task], timeout=0.2, recancel_s=0.01)
        still, lost[0] = set(pending), 0  # now let it end, so the loop can close
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return still, task, seen

    still, task, seen = asyncio.run(main())
    assert still == {task} and len(seen) >= 2
