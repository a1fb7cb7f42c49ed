"""The host-memory tier behind a worker's KV pool (docs/design.md, 'KV tiers': device, host,
then the store): the bytes of the tagged pages the pool hands out again, kept by block hash,
least recently used out first past `capacity_bytes`. A later prompt's leading blocks come
back from here into fresh pages (`restore`) before anything is read from the store: a copy
in memory, where the store costs a read.

Staging (`stage`): a session whose turn ended in a tool call has its blocks kept here until
the tool is expected back (services/ingress/staging.py): least-recently-used eviction passes
over them until then. At most half the tier is staged (the oldest stagings give way), so the
rest of the traffic always has room. A staged block still in the pool is kept once saved.

Thread-safe: the pool's allocator saves into it from whichever thread allocates (the model
thread for a step, the event loop for a load); the event loop restores.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from worker.engine.block_allocator import BlockAllocator
from worker.engine.errors import OutOfBlocksError

if TYPE_CHECKING:  # the pool's module loads torch, which the services load later (wiring.py)
    from worker.engine.kv_cache import PagedKVPool


class HostTier:
    def __init__(self, pool: PagedKVPool, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.pool = pool
        self.block_nbytes = pool.layout.block_nbytes
        # A model without full-attention layers has empty blocks: nothing to keep.
        self.capacity_blocks = capacity_bytes // self.block_nbytes if self.block_nbytes else 0
        self._lock = threading.Lock()
        self._blocks: OrderedDict[int, np.ndarray] = OrderedDict()  # hash -> bytes, LRU first
        self.num_saved = 0
        self.num_evicted = 0
        self.num_restored = 0
        self.num_staged = 0  # blocks staged, counted once per staging
        self._staged: OrderedDict[int, float] = OrderedDict()  # hash -> until (monotonic)
        # on_hold(block_hash, held), as the allocator's: under this tier's lock.
        self.on_hold: Callable[[int, bool], None] | None = None

    @property
    def num_blocks(self) -> int:
        return len(self._blocks)

    @property
    def nbytes(self) -> int:
        return len(self._blocks) * self.block_nbytes

    def holds(self, block_hash: int) -> bool:
        return block_hash in self._blocks

    @property
    def num_staged_blocks(self) -> int:
        return len(self._staged)

    def stage(self, block_hashes: Sequence[int], hold_s: float, now: float | None = None) -> None:
        """Keep these blocks (saved here now or later) out of eviction for `hold_s`."""
        if self.capacity_blocks == 0:
            return
        until = (time.monotonic() if now is None else now) + hold_s
        with self._lock:
            for block_hash in block_hashes:
                self._staged[block_hash] = max(until, self._staged.get(block_hash, 0.0))
                self._staged.move_to_end(block_hash)
                if block_hash in self._blocks:
                    self._blocks.move_to_end(block_hash)
            while len(self._staged) > self.capacity_blocks // 2:
                self._staged.popitem(last=False)  # the oldest staging gives way
            self.num_staged += len(block_hashes)

    def _victim(self, now: float) -> int:
        """The least recently used block not staged (an ended staging is forgotten)."""
        for block_hash in self._blocks:
            until = self._staged.get(block_hash)
            if until is None:
                return block_hash
            if until <= now:
                del self._staged[block_hash]
                return block_hash
        return next(iter(self._blocks))  # all staged: cannot be, at most half the tier is

    def save(self, block_id: int, block_hash: int) -> None:
        """Keep page `block_id`'s bytes as block `block_hash` (the allocator's on_evict)."""
        if self.capacity_blocks == 0:
            return
        data = np.array(self.pool.block_view(block_id), copy=True)
        with self._lock:
            self._blocks[block_hash] = data
            self._blocks.move_to_end(block_hash)
            self.num_saved += 1
            if self.on_hold is not None:
                self.on_hold(block_hash, True)
            now = time.monotonic()
            while len(self._blocks) > self.capacity_blocks:
                evicted = self._victim(now) if self._staged else next(iter(self._blocks))
                del self._blocks[evicted]
                self.num_evicted += 1
                if self.on_hold is not None:
                    self.on_hold(evicted, False)

    def restore(self, allocator: BlockAllocator, block_hashes: Sequence[int]) -> list[int]:
        """Fresh pages holding the leading run of `block_hashes` this tier has, tagged (the
        pool holds them again) and owned by the caller; none when the pool has no room."""
        with self._lock:
            run = []
            for block_hash in block_hashes:
                data = self._blocks.get(block_hash)
                if data is None:
                    break
                self._blocks.move_to_end(block_hash)
                run.append((block_hash, data))
        if not run:
            return []
        try:
            # May hand out tagged pages, whose bytes come here (save): outside our lock.
            pages = allocator.allocate(len(run))
        except OutOfBlocksError:
            return []
        for page, (block_hash, data) in zip(pages, run, strict=True):
            self.pool.block_view(page)[:] = data
            allocator.tag(page, block_hash)
        self.num_restored += len(run)
        return pages
