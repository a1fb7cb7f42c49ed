"""KV state: a paged pool for the full-attention layers, a window buffer for sliding layers.

Layout of the pool: `kv[block_id, full_layer, k_or_v, token_in_block, kv_head, head_dim]`.
Block-major (rather than vLLM's one tensor per layer) so that one block, i.e. the K and V of
every full-attention layer for B consecutive tokens, is one contiguous run of
`block_nbytes` bytes: the SSD store saves and loads it with a single copy, no gather.
Sliding layers never enter the pool: their state is the last W tokens per sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from worker.engine.config import ModelConfig
from worker.engine.errors import KVLayoutError

DEFAULT_BLOCK_SIZE_TOKENS = 64


@dataclass(frozen=True)
class KVBlockLayout:
    num_full_layers: int
    block_size_tokens: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @classmethod
    def for_model(
        cls,
        config: ModelConfig,
        block_size_tokens: int = DEFAULT_BLOCK_SIZE_TOKENS,
        dtype: torch.dtype = torch.float32,
    ) -> KVBlockLayout:
        if block_size_tokens <= 0:
            raise KVLayoutError(f"block_size_tokens must be positive, got {block_size_tokens}")
        return cls(
            config.num_full_layers, block_size_tokens, config.num_kv_heads, config.head_dim, dtype
        )

    @property
    def block_shape(self) -> tuple[int, ...]:
        return (self.num_full_layers, 2, self.block_size_tokens, self.num_kv_heads, self.head_dim)

    @property
    def block_nbytes(self) -> int:
        numel = 1
        for dim in self.block_shape:
            numel *= dim
        return numel * torch.empty((), dtype=self.dtype).element_size()


class PagedKVPool:
    """Fixed array of KV blocks; which block holds what is the BlockManager's business."""

    def __init__(self, layout: KVBlockLayout, num_blocks: int, device: str = "cpu") -> None:
        self.layout = layout
        self.num_blocks = num_blocks
        shape = (num_blocks, *layout.block_shape)
        nbytes = num_blocks * layout.block_nbytes
        if device == "cpu" and nbytes > 0:
            # calloc: fresh zero pages from the OS, resident only once written (torch.zeros
            # writes every byte: a 1 GiB pool was 1 GiB resident before its first request).
            zeros = torch.from_numpy(np.zeros(nbytes, dtype=np.uint8))
            self.kv = zeros.view(layout.dtype).view(shape)
        else:  # a device pool, or none (a model without full-attention layers)
            self.kv = torch.zeros(shape, dtype=layout.dtype, device=device)

    def write(
        self,
        full_layer: int,
        slots: tuple[torch.Tensor, torch.Tensor],
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> None:
        """slots = (block_ids, offsets), each [num_tokens]; k, v: [num_tokens, heads, dim]."""
        block_ids, offsets = slots
        self.kv[block_ids, full_layer, 0, offsets] = k.to(self.layout.dtype)
        self.kv[block_ids, full_layer, 1, offsets] = v.to(self.layout.dtype)

    def gather(
        self, full_layer: int, slots: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns K, V with the shape of the slot tensors + [heads, dim]."""
        block_ids, offsets = slots
        return (
            self.kv[block_ids, full_layer, 0, offsets],
            self.kv[block_ids, full_layer, 1, offsets],
        )

    def gather_blocks(
        self, full_layer: int, block_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of whole blocks, each [len(block_ids) * block_size_tokens, heads, dim].

        The pool seen as rows of one (block, layer, K or V) each: one `index_select` of
        contiguous 32 KiB rows per tensor. Decode, batch 32 x 4 blocks: 0.4 ms per layer, the
        per-token `gather` 1.9 ms; prefill over 8K keys: 1.0 ms vs 1.8 ms.
        """
        layout = self.layout
        rows = self.kv.view(-1, layout.block_size_tokens * layout.num_kv_heads * layout.head_dim)
        first = block_ids * (2 * layout.num_full_layers) + 2 * full_layer
        keys = rows.index_select(0, first).view(-1, layout.num_kv_heads, layout.head_dim)
        values = rows.index_select(0, first + 1).view(-1, layout.num_kv_heads, layout.head_dim)
        return keys, values

    def read_block(self, block_id: int) -> torch.Tensor:
        """A contiguous copy of one block, shape `layout.block_shape`."""
        return self.kv[block_id].clone()

    def write_block(self, block_id: int, data: torch.Tensor) -> None:
        if tuple(data.shape) != self.layout.block_shape or data.dtype != self.layout.dtype:
            raise KVLayoutError(
                f"block data has shape {tuple(data.shape)} {data.dtype}, "
                f"pool expects {self.layout.block_shape} {self.layout.dtype}"
            )
        self.kv[block_id].copy_(data)

    def block_view(self, block_id: int) -> np.ndarray:
        """One block's bytes as a writable uint8 array sharing the pool's memory (CPU pools):
        what the store reads into and the KV handoff copies from, without a bytes copy."""
        return self.kv[block_id].view(torch.uint8).numpy().reshape(-1)

    def block_to_bytes(self, block_id: int) -> bytes:
        return self.kv[block_id].contiguous().view(torch.uint8).numpy().tobytes()

    def block_from_bytes(self, block_id: int, data: bytes) -> None:
        if len(data) != self.layout.block_nbytes:
            raise KVLayoutError(
                f"block payload is {len(data)} bytes, layout needs {self.layout.block_nbytes}"
            )
        if not data:  # no full-attention layers: nothing to copy (frombuffer refuses b"")
            return
        raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self.kv[block_id].copy_(raw.view(self.layout.dtype).view(self.layout.block_shape))


def slots_for(
    block_table: torch.Tensor, positions: torch.Tensor, block_size_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token positions of one sequence -> (block_ids, offsets) in the pool."""
    return block_table[positions // block_size_tokens], positions % block_size_tokens


@dataclass(frozen=True)
class SlidingWindowState:
    """The K/V of the last <= W tokens of one sequence, for every sliding layer.

    `kv`: [num_sliding_layers, 2, num_tokens, num_kv_heads, head_dim] holding positions
    `end_position - num_tokens` .. `end_position - 1`. Immutable: `appended` returns a new
    state, so a snapshot at a block boundary (what swa-memcache keeps) stays valid.
    """

    kv: torch.Tensor
    end_position: int
    window_tokens: int

    @classmethod
    def empty(
        cls, config: ModelConfig, end_position: int = 0, dtype: torch.dtype = torch.float32
    ) -> SlidingWindowState:
        """No history: exact at position 0, the bounded-replay approximation elsewhere."""
        shape = (config.num_sliding_layers, 2, 0, config.num_kv_heads, config.head_dim)
        return cls(torch.zeros(shape, dtype=dtype), end_position, config.sliding_window or 0)

    @property
    def num_tokens(self) -> int:
        return self.kv.shape[2]

    @property
    def start_position(self) -> int:
        return self.end_position - self.num_tokens

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def appended(self, new_kv: torch.Tensor) -> SlidingWindowState:
        """Add the K/V of the next tokens and drop all but the last W."""
        merged = torch.cat((self.kv, new_kv.to(self.kv.dtype)), dim=2)
        kept = merged[:, :, -self.window_tokens :] if self.window_tokens else merged[:, :, :0]
        return SlidingWindowState(
            kept.contiguous(), self.end_position + new_kv.shape[2], self.window_tokens
        )
