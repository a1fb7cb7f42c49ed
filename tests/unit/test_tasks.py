"""cancel_and_wait ends a loop even when a cancel lands as the future it awaits completes."""

from __future__ import annotations

import asyncio

from shared.tasks import cancel_and_wait


async def test_a_loop_whose_cancel_meets_a_completed_wait_is_stopped() -> None:
    waits: list[asyncio.Future[int]] = []
    rounds = 0

    async def loop() -> None:
        # A heartbeat's shape: wait for a reply (through wait_for, as nats-py's flush does),
        # then go round again.
        nonlocal rounds
        while True:
            waits.append(asyncio.get_running_loop().create_future())
            await asyncio.wait_for(waits[-1], timeout=5)
            rounds += 1

    task = asyncio.create_task(loop())
    await asyncio.sleep(0)
    # The reply and the cancel in one loop iteration: on Python 3.11, wait_for returns the
    # reply and the cancellation is lost.
    waits[-1].set_result(1)
    task.cancel()
    stopper = asyncio.create_task(cancel_and_wait(task))
    await asyncio.sleep(0.1)
    for waiting in waits:  # every later round's reply, should the loop still be going
        if not waiting.done():
            waiting.set_result(1)
    await asyncio.wait_for(stopper, timeout=5)

    assert task.done() and task.cancelled()
    assert rounds <= 2


async def test_tasks_that_end_or_have_ended_are_waited_for_and_none_is_skipped() -> None:
    async def fails() -> None:
        raise ValueError("kept out of the caller")

    done = asyncio.create_task(fails())
    await asyncio.sleep(0)
    sleeper = asyncio.create_task(asyncio.sleep(60))

    await asyncio.wait_for(cancel_and_wait(done, None, sleeper), timeout=5)

    assert isinstance(done.exception(), ValueError)
    assert sleeper.cancelled()
