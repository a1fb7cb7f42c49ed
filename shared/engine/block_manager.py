"""Block bookkeeping for the paged pool: a ref-counted allocator and per-sequence tables.

Ref counts let several sequences share the blocks of a common prefix (prefix cache hit);
a block returns to the free list when its last owner frees it. Only whole blocks are ever
shared (partial trailing blocks are not cached, DESIGN.md section 4), so a sequence never
writes into a block another sequence reads: no copy-on-write is needed.
"""

from __future__ import annotations

from collections import deque

import torch

from shared.engine.errors import OutOfBlocksError, SequenceStateError
from shared.engine.kv_cache import SlidingWindowState
from shared.engine.sequence import Sequence


class BlockAllocator:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        if not self.can_allocate(num_blocks):
            raise OutOfBlocksError(f"need {num_blocks} blocks, {len(self._free)} free")
        block_ids = [self._free.popleft() for _ in range(num_blocks)]
        for block_id in block_ids:
            self._ref_counts[block_id] = 1
        return block_ids

    def share(self, block_ids: list[int]) -> None:
        """Add an owner to blocks that are already allocated."""
        for block_id in block_ids:
            if self._ref_counts[block_id] == 0:
                raise SequenceStateError(f"block {block_id} is free and cannot be shared")
            self._ref_counts[block_id] += 1

    def free(self, block_ids: list[int]) -> None:
        for block_id in block_ids:
            if self._ref_counts[block_id] == 0:
                raise SequenceStateError(f"block {block_id} freed twice")
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._free.append(block_id)


class BlockManager:
    def __init__(self, allocator: BlockAllocator, block_size_tokens: int) -> None:
        self.allocator = allocator
        self.block_size_tokens = block_size_tokens

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size_tokens)

    def can_reserve(self, seq: Sequence, num_tokens: int) -> bool:
        missing = self.num_blocks_for(num_tokens) - len(seq.block_table)
        return self.allocator.can_allocate(max(missing, 0))

    def reserve(self, seq: Sequence, num_tokens: int) -> None:
        """Grow the block table so that positions 0..num_tokens-1 have a slot."""
        missing = self.num_blocks_for(num_tokens) - len(seq.block_table)
        if missing > 0:
            seq.block_table.extend(self.allocator.allocate(missing))

    def attach_prefix(
        self,
        seq: Sequence,
        block_ids: list[int],
        window: SlidingWindowState,
        num_tokens: int | None = None,
    ) -> None:
        """Start `seq` after a computed prefix: shared full-layer blocks + its window state.

        The prefix is `num_tokens` long (default: the blocks' whole length); its last block
        may be partly filled, and then this sequence must be its only writer.
        """
        block_size = self.block_size_tokens
        num_cached = len(block_ids) * block_size if num_tokens is None else num_tokens
        if seq.block_table or seq.num_computed_tokens:
            raise SequenceStateError(f"sequence {seq.seq_id} already has cached state")
        if (
            num_cached >= seq.num_tokens
            or window.end_position != num_cached
            or self.num_blocks_for(num_cached) != len(block_ids)
        ):
            raise SequenceStateError(
                f"sequence {seq.seq_id}: prefix of {num_cached} tokens in {len(block_ids)} "
                f"blocks with a window ending at {window.end_position} does not fit "
                f"{seq.num_tokens} tokens (need a prefix shorter than the sequence, blocks "
                f"that just cover it and a window ending where it ends)"
            )
        self.allocator.share(block_ids)
        seq.block_table = list(block_ids)
        seq.num_computed_tokens = num_cached
        seq.window = window

    def release(self, seq: Sequence) -> None:
        self.allocator.free(seq.block_table)
        seq.block_table = []


def block_table_tensor(seq: Sequence) -> torch.Tensor:
    return torch.tensor(seq.block_table, dtype=torch.long)
