"""The KV pool's page count: a ref-counted allocator of page ids, the one count of free
pages every worker reports (the runner's, whatever its model).

Ref counts let several sequences share the pages of a common prefix (prefix cache hit); a
page returns to the free list when its last owner frees it. The pool is also the first KV
tier (docs/design.md, 'KV tiers': device, then the store). A page holding a complete block
can be tagged with that block's chained hash (`tag`); a free tagged page keeps its bytes
until it is handed out again, and free pages are handed out oldest first, so a worker's
recent prefixes stay in its pool. `revive` takes the pages of a prompt's leading blocks
back from there instead of reading them from the store. A tagged page handed out again is
first offered to `on_evict` (the host-memory tier behind the pool: host_tier.py).

No torch here: it counts page ids, never touches their bytes.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

from worker.engine.errors import OutOfBlocksError, SequenceStateError


class BlockAllocator:
    """Thread-safe: a worker's event loop takes pages for a prefix load while its model
    thread reserves pages for a step (one lock around every change)."""

    def __init__(self, num_blocks: int, on_evict: Callable[[int, int], None] | None = None) -> None:
        """on_evict(block_id, block_hash): a free tagged page is about to be written over,
        its bytes still intact (called under the lock: it must not call back in here)."""
        self.num_blocks = num_blocks
        self.on_evict = on_evict
        # on_hold(block_hash, held): the pool now holds (or no longer holds) that block, for
        # the holdings kv-index hears of (worker/serving/holdings.py); under the lock too.
        self.on_hold: Callable[[int, bool], None] | None = None
        self._lock = threading.Lock()
        # Free blocks, oldest first. A revived block leaves its entry behind (`_is_free` says
        # which entries still count), so taking one out of the middle costs nothing.
        self._free: deque[int] = deque(range(num_blocks))
        self._is_free = [True] * num_blocks
        self._num_free = num_blocks
        self._ref_counts = [0] * num_blocks
        self._hash_of: dict[int, int] = {}  # block id -> the chained hash of the KV it holds
        self._block_of: dict[int, int] = {}  # and back

    @property
    def num_free_blocks(self) -> int:
        return self._num_free

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self._num_free

    def allocate(self, num_blocks: int) -> list[int]:
        with self._lock:
            if num_blocks > self._num_free:
                raise OutOfBlocksError(f"need {num_blocks} blocks, {self._num_free} free")
            block_ids = []
            while len(block_ids) < num_blocks:
                block_id = self._free.popleft()
                if not self._is_free[block_id]:
                    continue  # revived since it was freed
                if self.on_evict is not None and block_id in self._hash_of:
                    self.on_evict(block_id, self._hash_of[block_id])
                self._untag(block_id)  # about to be written over
                self._take(block_id)
                block_ids.append(block_id)
            return block_ids

    def _take(self, block_id: int) -> None:
        self._is_free[block_id] = False
        self._num_free -= 1
        self._ref_counts[block_id] = 1

    def tag(self, block_id: int, block_hash: int) -> None:
        """`block_id` holds the complete block `block_hash` (its chained hash: the whole prefix
        up to it) and keeps it: a block is only written while it is partly filled."""
        with self._lock:
            if self._ref_counts[block_id] == 0:
                raise SequenceStateError(f"block {block_id} is free: nothing to tag")
            self._untag(block_id)
            old = self._block_of.pop(block_hash, None)
            if old is not None:
                del self._hash_of[old]
            self._hash_of[block_id] = block_hash
            self._block_of[block_hash] = block_id
            if self.on_hold is not None:
                self.on_hold(block_hash, True)

    def _untag(self, block_id: int) -> None:
        block_hash = self._hash_of.pop(block_id, None)
        if block_hash is not None:
            del self._block_of[block_hash]
            if self.on_hold is not None:
                self.on_hold(block_hash, False)

    def revive(self, block_hashes: list[int]) -> list[int]:
        """The blocks holding the leading run of `block_hashes` that this pool still has,
        each with one more owner (the caller's): in use elsewhere, or free and not yet handed
        out again. Stops at the first hash it does not hold."""
        found = self.pin(block_hashes, leading=True)
        return [b for b in found if b is not None]

    def pin(self, block_hashes: list[int], *, leading: bool = False) -> list[int | None]:
        """Each of `block_hashes`' block in this pool (with one more owner, the caller's), or
        None where it holds none; `leading`: up to the first it does not hold."""
        with self._lock:
            block_ids: list[int | None] = []
            for block_hash in block_hashes:
                block_id = self._block_of.get(block_hash)
                if block_id is None:
                    if leading:
                        break
                    block_ids.append(None)
                    continue
                if self._is_free[block_id]:
                    self._take(block_id)
                else:
                    self._ref_counts[block_id] += 1
                block_ids.append(block_id)
            if len(self._free) > 2 * self.num_blocks:  # drop the entries revived blocks left
                self._free = deque(b for b in self._free if self._is_free[b])
            return block_ids

    def share(self, block_ids: list[int]) -> None:
        """Add an owner to blocks that are already allocated."""
        with self._lock:
            for block_id in block_ids:
                if self._ref_counts[block_id] == 0:
                    raise SequenceStateError(f"block {block_id} is free and cannot be shared")
                self._ref_counts[block_id] += 1

    def free(self, block_ids: list[int]) -> None:
        with self._lock:
            for block_id in block_ids:
                if self._ref_counts[block_id] == 0:
                    raise SequenceStateError(f"block {block_id} freed twice")
                self._ref_counts[block_id] -= 1
                if self._ref_counts[block_id] == 0:
                    self._is_free[block_id] = True
                    self._num_free += 1
                    self._free.append(block_id)
