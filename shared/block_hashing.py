"""Block hashes: the one key of the KV cache, used by ingress, router, prefill, decode and
kv-index alike.

h_i = XXH3-64(seed, h_{i-1} || token ids of block i as little-endian u32), with h_{-1} = 0
and the seed derived from the namespace (model id, KV layout version, optional tenant salt).
Chaining makes a block's hash name its whole prefix, so equal hashes mean equal prefixes and
a prefix match is a walk down the list. Only complete blocks are hashed (partial trailing
blocks are not cached: docs/design.md, 'Block hashes').
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import xxhash

from shared.schema.tokens import pack_token_ids

KV_LAYOUT_VERSION = 1
_NAMESPACE_SEED = 0x6B76_6661_6272_6963  # "kvfabric": fixes the namespace hash itself


@dataclass(frozen=True)
class BlockHasher:
    model_id: str
    block_size_tokens: int = 64
    layout_version: int = KV_LAYOUT_VERSION
    salt: str = ""  # tenant isolation: another salt shares no block with this one
    seed: int = field(init=False)

    def __post_init__(self) -> None:
        if self.block_size_tokens <= 0:
            raise ValueError(f"block_size_tokens must be positive, got {self.block_size_tokens}")
        namespace = f"{self.model_id}\0{self.layout_version}\0{self.salt}".encode()
        object.__setattr__(self, "seed", xxhash.xxh3_64_intdigest(namespace, seed=_NAMESPACE_SEED))

    def num_blocks(self, num_tokens: int) -> int:
        return num_tokens // self.block_size_tokens

    def hashes(
        self, token_ids: bytes | np.ndarray | Iterable[int], parent_hash: int = 0
    ) -> list[int]:
        """Hashes of every complete block of `token_ids` (packed u32 bytes, an array, or ints),
        continuing the chain after `parent_hash` (0: the sequence starts here)."""
        packed = token_ids if isinstance(token_ids, bytes) else pack_token_ids(token_ids)
        stride = 4 * self.block_size_tokens
        hashes = []
        previous = parent_hash
        for start in range(0, len(packed) - stride + 1, stride):
            previous = xxhash.xxh3_64_intdigest(
                previous.to_bytes(8, "little") + packed[start : start + stride], seed=self.seed
            )
            hashes.append(previous)
        return hashes
