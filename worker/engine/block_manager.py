"""Per-sequence block tables over the pool's pages (block_allocator.py counts the pages).

Only whole blocks are ever shared (partial trailing blocks are not cached: docs/design.md,
'Block hashes'), so a sequence never writes into a block another sequence reads: no
copy-on-write is needed.
"""

from __future__ import annotations

import torch

from worker.engine.block_allocator import BlockAllocator
from worker.engine.errors import SequenceStateError
from worker.engine.kv_cache import SlidingWindowState
from worker.engine.sequence import Sequence


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
