"""Which slots of one writer are free, and the generation each slot's next write gets.

Pure bookkeeping, no I/O. A writer owns `max_num_slots` slots (its capacity share divided by
the slot size), numbered globally `file_id * slots_per_file + slot`. Fresh slots are handed
out in order, so files fill one after the other and a new file is created only when the
previous ones are full; freed slots are reused first.

Generation = `epoch << 20 | n` in 32 bits (the width kv-index stores): `n` counts the
rewrites of that slot since the writer opened the store (1 .. 2^20-1, then around again)
and `epoch` (12 bits) increases at every open (kept in a small file by the store). A
restarted writer thus hands out generations its slots did not carry before, without scanning
its files, for 4,096 restarts and a million rewrites per slot per run; after that values
repeat, which costs at most a cache entry, never correctness: a reader also checks the block
hash and the payload checksum, so a repeated generation can only ever match the same block's
KV. Per-slot state is 4 bytes (a 20 TB share of 2 MB blocks: 10M slots, 40 MB).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

COUNT_BITS = 20
EPOCH_BITS = 12
_COUNT_MAX = (1 << COUNT_BITS) - 1
_EPOCH_MASK = (1 << EPOCH_BITS) - 1


@dataclass(frozen=True, slots=True)
class Allocation:
    file_id: int
    slot: int
    generation: int


class SlotAllocator:
    def __init__(self, max_num_slots: int, slots_per_file: int, epoch: int) -> None:
        if max_num_slots < 0 or slots_per_file <= 0:
            raise ValueError(f"bad geometry: {max_num_slots} slots, {slots_per_file} per file")
        if epoch < 0:
            raise ValueError(f"epoch must not be negative, got {epoch}")
        self.max_num_slots = max_num_slots
        self.slots_per_file = slots_per_file
        self.epoch = epoch & _EPOCH_MASK
        self._rewrites = np.zeros(max_num_slots, dtype=np.uint32)
        self._generation = np.zeros(max_num_slots, dtype=np.uint32)  # 0: free
        self._free = np.empty(max_num_slots, dtype=np.int64)  # a stack of freed slots
        self._num_free = 0
        self._next_fresh = 0

    @property
    def num_used(self) -> int:
        return self._next_fresh - self._num_free

    def num_slots_in_file(self, file_id: int) -> int:
        """A writer's last file is shorter when its share is not a whole number of files."""
        first = file_id * self.slots_per_file
        return max(0, min(self.slots_per_file, self.max_num_slots - first))

    def allocate(self) -> Allocation | None:
        """A slot to write, or None when the writer's whole share is in use."""
        if self._num_free:
            self._num_free -= 1
            index = int(self._free[self._num_free])
        elif self._next_fresh < self.max_num_slots:
            index = self._next_fresh
            self._next_fresh += 1
        else:
            return None
        count = int(self._rewrites[index]) % _COUNT_MAX + 1  # never 0: 0 marks a free slot
        self._rewrites[index] = count
        generation = (self.epoch << COUNT_BITS) | count
        self._generation[index] = generation
        return Allocation(index // self.slots_per_file, index % self.slots_per_file, generation)

    def free(self, file_id: int, slot: int, generation: int) -> bool:
        """Release a slot; False (and nothing changes) if it no longer holds `generation`,
        so a late or repeated free cannot release a slot that was reused since."""
        index = file_id * self.slots_per_file + slot
        if not 0 <= index < self._next_fresh or int(self._generation[index]) != generation:
            return False
        self._generation[index] = 0
        self._free[self._num_free] = index
        self._num_free += 1
        return True

    def adopt(self, found: list[Allocation]) -> None:
        """Mark slots found valid on disk at open as in use (their blocks stay readable and
        are not overwritten until freed); every slot below the highest one found that is not
        adopted becomes free. Call once, before the first `allocate`."""
        if self._next_fresh:
            raise RuntimeError("adopt() must run before the first allocate()")
        indices = {a.file_id * self.slots_per_file + a.slot: a.generation for a in found}
        indices = {i: g for i, g in indices.items() if 0 <= i < self.max_num_slots}
        self._next_fresh = max(indices, default=-1) + 1
        for index in range(self._next_fresh - 1, -1, -1):
            if index in indices:
                self._generation[index] = indices[index]
            else:
                self._free[self._num_free] = index
                self._num_free += 1
