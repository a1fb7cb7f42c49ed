"""StagingSpace: first-fit extents of the NIXL staging buffer, waiting when full."""

from __future__ import annotations

import asyncio

import pytest

from worker.serving.staging import ALIGN, StagingSpace, StagingTooSmall


async def test_extents_are_aligned_disjoint_and_merge_back() -> None:
    space = StagingSpace(offset=ALIGN, nbytes=8 * ALIGN)
    a = await space.allocate(100)
    b = await space.allocate(2 * ALIGN + 1)
    assert (a.offset, a.nbytes) == (ALIGN, ALIGN)
    assert (b.offset, b.nbytes) == (2 * ALIGN, 3 * ALIGN)
    await space.free(a)
    await space.free(b)
    assert space.num_free_bytes == 8 * ALIGN
    whole = await space.allocate(8 * ALIGN)  # merged into one extent again
    assert whole.offset == ALIGN


async def test_a_full_space_waits_and_an_oversized_request_fails() -> None:
    space = StagingSpace(offset=0, nbytes=2 * ALIGN)
    held = await space.allocate(2 * ALIGN)
    waiter = asyncio.create_task(space.allocate(ALIGN))
    await asyncio.sleep(0.01)
    assert not waiter.done()
    await space.free(held)
    assert (await asyncio.wait_for(waiter, 1)).offset == 0
    with pytest.raises(StagingTooSmall):
        await space.allocate(3 * ALIGN)
    with pytest.raises(asyncio.TimeoutError):
        await space.allocate(2 * ALIGN, timeout_s=0.05)


async def test_a_request_that_fits_only_before_rounding_fails_at_once() -> None:
    """A buffer that is not whole pages: a request of its exact size needs one page more
    than there is once rounded, and must fail, not wait for room that cannot exist."""
    space = StagingSpace(offset=0, nbytes=3 * ALIGN + 48)
    with pytest.raises(StagingTooSmall, match="in whole pages"):
        await asyncio.wait_for(space.allocate(3 * ALIGN + 48), 1)
    assert (await space.allocate(3 * ALIGN)).nbytes == 3 * ALIGN
