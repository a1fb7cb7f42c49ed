"""A request's block layout: the one owner of every question about which of its blocks are
which (docs/design.md, 'Block hashes').

The prompt is hashed exactly once on the request path, by the caller (`hash_prompt`:
ingress, `shared.client`); the chain then travels in `GenerateRequest.block_hashes`. The
router checks it cheaply (`check`: the count and two blocks, not a rehash of 1,200 blocks),
and every later hop takes it from the request (`of_request`) and asks this type:

- `num_prefill_blocks`: the complete blocks before the prompt's last token. That token is
  always computed (its logits give the first output token), so these are the most a cache
  hit can reuse, exactly the blocks prefill writes to the store, and decode writes from here
  on (the block holding the last token, once complete, with the answer's).
- `num_reusable_blocks(hit)`: how many of a kv-index hit a job restores.
- `boundary_hash(num_blocks)`: the block whose sliding-window snapshot restores a prefix.
- `extend(token_ids, num_blocks)`: the chain continued over the answer, so the agent's next
  turn hits its own output.

Trust: the hashes come from kvfabric's own callers over the internal bus (ingress is the
public boundary), so the router's check is there to catch a caller's bug -- another model,
block size or tenant salt, a cut-off list -- not a forger.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from shared.block_hashing import BlockHasher
from shared.schema.inference import GenerateRequest
from shared.schema.tokens import (
    num_packed_tokens,
    pack_block_hashes,
    pack_token_ids,
    unpack_block_hashes,
)


def num_blocks_before_last(num_tokens: int, block_size: int) -> int:
    """Complete blocks before a sequence's last token: the rule "the last token is decode's".
    That token is always computed (its logits give the next token), so for a prompt these
    are the most a cache hit reuses and what prefill writes; for a finished sequence, the
    blocks whose KV exists (the last sampled token's is never computed)."""
    return max(num_tokens - 1, 0) // block_size


class BlockLayoutError(ValueError):
    """A request's block hashes do not belong to its tokens (count or content)."""


@dataclass
class RequestBlocks:
    hasher: BlockHasher  # the request's namespace: model, block size, tenant salt
    num_prompt_tokens: int
    hashes: list[int]  # the prompt's complete blocks, then the answer's as `extend` adds them

    @staticmethod
    def namespace(model: str, block_size_tokens: int, cache_salt: str = "") -> BlockHasher:
        """The hasher of a request's namespace: the only place one is built from its fields."""
        return BlockHasher(model_id=model, block_size_tokens=block_size_tokens, salt=cache_salt)

    @classmethod
    def hash_prompt(
        cls,
        token_ids: bytes | np.ndarray | Sequence[int],
        *,
        model: str,
        block_size_tokens: int,
        cache_salt: str = "",
    ) -> RequestBlocks:
        """The caller's side: hash the prompt (packed u32 bytes, an array or ints)."""
        packed = token_ids if isinstance(token_ids, bytes) else pack_token_ids(token_ids)
        hasher = cls.namespace(model, block_size_tokens, cache_salt)
        return cls(hasher, num_packed_tokens(packed), hasher.hashes(packed))

    @classmethod
    def of_request(cls, request: GenerateRequest) -> RequestBlocks:
        """The chain a request carries, as the router checked it (no hashing)."""
        hasher = cls.namespace(request.model, request.block_size_tokens, request.cache_salt)
        num_tokens = num_packed_tokens(request.prompt_token_ids)
        hashes = unpack_block_hashes(request.block_hashes).tolist()
        if len(hashes) != hasher.num_blocks(num_tokens):
            raise BlockLayoutError(
                f"{len(hashes)} block hashes for {num_tokens} tokens in blocks of "
                f"{hasher.block_size_tokens}: expected {hasher.num_blocks(num_tokens)}"
            )
        return cls(hasher, num_tokens, hashes)

    def check(self, prompt_token_ids: bytes) -> None:
        """The router's check that the chain belongs to these tokens, in this namespace:
        the count (done by `of_request`), the last block, and one more block picked by the
        last hash. Two hashes per request instead of one per block (1,200 for 77K tokens).
        `BlockLayoutError` when a checked block differs."""
        num_blocks = len(self.hashes)
        if num_blocks == 0:
            return
        for index in sorted({num_blocks - 1, self.hashes[-1] % num_blocks}):
            if self._hash_of(prompt_token_ids, index) != self.hashes[index]:
                raise BlockLayoutError(
                    f"block {index} of {num_blocks}: its hash does not match its tokens for "
                    "this model, block size and cache salt"
                )

    def _hash_of(self, packed: bytes, index: int) -> int:
        stride = 4 * self.block_size
        parent = self.hashes[index - 1] if index else 0
        return self.hasher.hashes(packed[index * stride : (index + 1) * stride], parent)[0]

    # -- questions -----------------------------------------------------------------------
    @property
    def block_size(self) -> int:
        return self.hasher.block_size_tokens

    @property
    def num_prefill_blocks(self) -> int:
        """Complete blocks before the prompt's last token (always computed: its logits give
        the first output token): the most a hit reuses, what prefill writes; decode writes
        from here on."""
        return num_blocks_before_last(self.num_prompt_tokens, self.block_size)

    def num_reusable_blocks(self, num_hit_blocks: int) -> int:
        """How many blocks of a cached prefix of `num_hit_blocks` a job restores."""
        return max(min(num_hit_blocks, self.num_prefill_blocks), 0)

    def boundary_hash(self, num_blocks: int) -> int | None:
        """The hash of the block ending a `num_blocks`-block prefix (None for none): the key
        of the sliding-window snapshot at that boundary."""
        return self.hashes[num_blocks - 1] if num_blocks > 0 else None

    def extend(self, token_ids: Sequence[int], num_blocks: int) -> list[int]:
        """Hashes of blocks 0..num_blocks-1 of `token_ids` (the prompt and what followed it),
        hashing only the blocks not seen yet: the answer's continuation of the chain."""
        have = len(self.hashes)
        if num_blocks > have:
            size = self.block_size
            parent = self.hashes[-1] if have else 0
            new = token_ids[have * size : num_blocks * size]
            self.hashes += self.hasher.hashes(new, parent_hash=parent)
        return self.hashes[:num_blocks]

    def packed(self) -> bytes:
        """The prompt's hashes as `GenerateRequest.block_hashes` carries them."""
        return pack_block_hashes(self.hashes[: self.hasher.num_blocks(self.num_prompt_tokens)])
