"""First-fit allocation of byte ranges in one fixed buffer (the memcache's NIXL region).

Pure bookkeeping: the arena hands out offsets, it never touches the bytes. Free extents are
kept sorted by offset, so a freed range merges with its free neighbours at once and the
arena never holds two adjacent free extents. First fit over a few thousand extents (8 GiB of
2 MB snapshots) is a short scan; snapshots of one deployment have few distinct sizes, so
freed holes are reused whole and fragmentation stays low. When no single extent is large
enough, `allocate` refuses (None) even if the free bytes add up: the cache then evicts.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Region:
    offset: int
    nbytes: int

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


class Arena:
    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError("capacity_bytes must be positive")
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self._free_offsets: list[int] = [0]  # sorted; parallel to _free_sizes
        self._free_sizes: list[int] = [capacity_bytes]
        self._allocated: dict[int, int] = {}  # offset -> nbytes

    @property
    def free_bytes(self) -> int:
        return self.capacity_bytes - self.used_bytes

    @property
    def num_free_extents(self) -> int:
        return len(self._free_offsets)

    @property
    def largest_free_bytes(self) -> int:
        return max(self._free_sizes, default=0)

    def can_allocate(self, nbytes: int) -> bool:
        return nbytes == 0 or any(size >= nbytes for size in self._free_sizes)

    def allocate(self, nbytes: int) -> Region | None:
        """The lowest free range of `nbytes`, or None when no free extent is that large.
        An empty region takes no space (offset 0) and frees as a no-op."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        if nbytes == 0:
            return Region(0, 0)
        for i, size in enumerate(self._free_sizes):
            if size >= nbytes:
                offset = self._free_offsets[i]
                if size == nbytes:
                    del self._free_offsets[i], self._free_sizes[i]
                else:
                    self._free_offsets[i] += nbytes
                    self._free_sizes[i] -= nbytes
                self._allocated[offset] = nbytes
                self.used_bytes += nbytes
                return Region(offset, nbytes)
        return None

    def free(self, region: Region) -> None:
        """Return `region`; merges with the free extents on either side."""
        if region.nbytes == 0:
            return
        if self._allocated.get(region.offset) != region.nbytes:
            raise ValueError(f"{region} is not allocated (double free or a foreign region)")
        del self._allocated[region.offset]
        self.used_bytes -= region.nbytes
        i = bisect.bisect_left(self._free_offsets, region.offset)
        offset, size = region.offset, region.nbytes
        if i < len(self._free_offsets) and self._free_offsets[i] == region.end:  # next is free
            size += self._free_sizes[i]
            del self._free_offsets[i], self._free_sizes[i]
        if i > 0 and self._free_offsets[i - 1] + self._free_sizes[i - 1] == offset:  # previous
            self._free_sizes[i - 1] += size
            return
        self._free_offsets.insert(i, offset)
        self._free_sizes.insert(i, size)
