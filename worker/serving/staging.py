"""Space in a worker's NIXL-registered staging buffer, handed out in extents.

Prefill stages each finished job's suffix KV there until decode pulled it; decode pulls into
its own. An extent is held only for one handoff (milliseconds to a few seconds), so first
fit over a sorted free list is plenty; a request that does not fit waits for space, and one
larger than the whole buffer fails at once.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from worker.kvstore.backends import PAGE_NBYTES, aligned

ALIGN = PAGE_NBYTES  # extents are whole pages (`aligned`), each starting page-aligned


class StagingTooSmall(ValueError):
    """The request can never fit: the staging buffer is smaller than it."""


@dataclass(frozen=True)
class Extent:
    offset: int
    nbytes: int


class StagingSpace:
    def __init__(self, offset: int, nbytes: int) -> None:
        self.offset = offset
        self.nbytes = nbytes
        self._free: list[Extent] = [Extent(offset, nbytes)]
        self._changed = asyncio.Condition()

    @property
    def num_free_bytes(self) -> int:
        return sum(e.nbytes for e in self._free)

    def try_allocate(self, nbytes: int) -> Extent | None:
        size = aligned(nbytes)
        for i, extent in enumerate(self._free):
            if extent.nbytes >= size:
                rest = Extent(extent.offset + size, extent.nbytes - size)
                self._free[i : i + 1] = [rest] if rest.nbytes else []
                return Extent(extent.offset, size)
        return None

    async def allocate(self, nbytes: int, timeout_s: float | None = None) -> Extent:
        if aligned(nbytes) > self.nbytes:  # would wait forever for room that cannot exist
            raise StagingTooSmall(
                f"{nbytes} bytes to stage ({aligned(nbytes)} in whole pages), the staging "
                f"buffer holds {self.nbytes}"
            )
        async with self._changed:
            extent = self.try_allocate(nbytes)
            while extent is None:
                await asyncio.wait_for(self._changed.wait(), timeout_s)
                extent = self.try_allocate(nbytes)
            return extent

    async def free(self, extent: Extent) -> None:
        async with self._changed:
            self._free.append(extent)
            self._free.sort(key=lambda e: e.offset)
            merged: list[Extent] = []
            for e in self._free:
                if merged and merged[-1].offset + merged[-1].nbytes == e.offset:
                    merged[-1] = Extent(merged[-1].offset, merged[-1].nbytes + e.nbytes)
                else:
                    merged.append(e)
            self._free = merged
            self._changed.notify_all()
