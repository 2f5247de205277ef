"""Stopping asyncio tasks for sure on Python 3.11.

One ``task.cancel()`` is not always enough there: redis-py wraps each command's write in
``asyncio.wait_for`` (its socket timeout), and 3.11's ``wait_for`` drops a cancel that lands in
the loop turn the write completes (CPython bpo-42130, fixed in 3.12). A background task polling
Redis (the gateway's batch driver, the worker's checkpointer and start announcement, the
client's stream reader) then runs on until whoever waits for it gives up. So the tasks are
cancelled again every ``RECANCEL_S`` until they end.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

RECANCEL_S = 0.05


async def stop_tasks(tasks: Iterable[asyncio.Task], timeout: float,
                     recancel_s: float = RECANCEL_S) -> set[asyncio.Task]:
    """Cancel ``tasks``, and again every ``recancel_s`` while one still runs, for at most
    ``timeout`` seconds; returns the tasks still running then (the caller logs them)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + max(0.0, timeout)
    pending = {t for t in tasks if not t.done()}
    while pending:
        for task in pending:
            task.cancel()
        left = deadline - loop.time()
        if left <= 0:
            break
        _, pending = await asyncio.wait(pending, timeout=min(recancel_s, left))
    return pending
