"""Stopping asyncio tasks for sure.

Python 3.11's `asyncio.wait_for` drops a cancellation when the future it waits on completes
in the same loop iteration as the cancel: it returns the result instead of raising (fixed in
3.12, cpython gh-86296). nats-py's `flush` and `request` wait through it, so a loop task
cancelled while a PONG or a reply arrives carries on as if nothing happened: seen here as a
heartbeat loop that a single `cancel()` never ended, and a test that waited on it for good.
"""

from __future__ import annotations

import asyncio

# How long a cancelled task has to end (its own clean-up included) before it is cancelled
# again: long enough not to cut short a `finally` that awaits, short for a stop to wait.
RECANCEL_S = 1.0


async def cancel_and_wait(*tasks: asyncio.Task | None) -> None:
    """Cancel every task and return once all have ended, cancelling again any that keeps
    running (see above); their results and exceptions are retrieved and dropped."""
    pending = {task for task in tasks if task is not None}
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=RECANCEL_S)
    await asyncio.gather(*(task for task in tasks if task is not None), return_exceptions=True)
