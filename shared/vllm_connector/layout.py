"""One block of KV between vLLM's paged cache and the store's payload.

The store's payload is the kvfabric engine's page (`shared.engine.kv_cache.KVBlockLayout`):
`[full_layer, k_or_v, token_in_block, kv_head, head_dim]`, float32, every full-attention
layer of B tokens in one contiguous run. A block written by a vLLM worker is byte-for-byte
what a kvfabric engine worker would write for the same tokens (up to arithmetic), so a prefix
stored by one hits in the other: same block hashes, same namespace, same payload.

vLLM keeps one tensor per attention layer. Its CPU attention backend (the build this project
runs, `CPU_ATTN`) allocates `[num_blocks, num_kv_heads, block_size, 2 * head_size]`; per
block and head its kernels (the `vec` ones, x86 without AMX) keep the keys first, transposed
-- `[head_dim, token]`, B keys as columns, for the dot products -- then the values as rows,
`[token, head_dim]`. Found by comparing what vLLM wrote with the engine's own page for the
same tokens: values equal as rows, keys equal as columns (docs/vllm.md).

The block size must be the same on both sides (vLLM's `--block-size` = the namespace's
`block_size_tokens`, 64 by default: the CPU backend takes multiples of 32), and the cache
float32 (`--dtype float32`): the one dtype whose kernels' layout is checked here (bfloat16
on a CPU with AMX uses other, tiled kernels).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from shared.engine.kv_cache import KVBlockLayout

PAYLOAD_DTYPE = torch.float32
_LAYER_INDEX = re.compile(r"layers\.(\d+)\.")


class VllmLayoutError(ValueError):
    """vLLM's KV cache is not in a layout this module converts (another attention backend,
    block size or model): refused at start, never guessed."""


def layer_order(names: Sequence[str]) -> list[str]:
    """vLLM's attention layer names (`model.layers.12.self_attn.attn`) in layer order."""
    indexed = []
    for name in names:
        found = _LAYER_INDEX.search(name)
        if found is None:
            raise VllmLayoutError(f"attention layer {name!r} has no layer index")
        indexed.append((int(found.group(1)), name))
    indexed.sort()
    if [i for i, _ in indexed] != list(range(len(indexed))):
        raise VllmLayoutError(f"attention layers {[i for i, _ in indexed]} are not 0..n-1")
    return [name for _, name in indexed]


@dataclass(frozen=True)
class VllmBlockConverter:
    """Copies whole blocks between vLLM's per-layer caches and store payloads."""

    caches: tuple[torch.Tensor, ...]  # one per full-attention layer, in layer order
    layout: KVBlockLayout  # the payload's (float32)

    @classmethod
    def of(
        cls, kv_caches: Mapping[str, torch.Tensor], block_size_tokens: int
    ) -> VllmBlockConverter:
        names = layer_order(list(kv_caches))
        caches = tuple(kv_caches[n] for n in names)
        first = caches[0]
        if first.dim() != 4:
            raise VllmLayoutError(
                f"KV cache of {names[0]} has shape {tuple(first.shape)}: expected the CPU "
                "backend's [num_blocks, num_kv_heads, block_size, 2 * head_size]"
            )
        _, num_kv_heads, block_size, two_head_dim = first.shape
        if block_size != block_size_tokens:
            raise VllmLayoutError(
                f"vLLM's block size is {block_size}, the store's blocks are "
                f"{block_size_tokens} tokens: start vLLM with --block-size {block_size_tokens}"
            )
        for name, cache in zip(names, caches, strict=True):
            if cache.shape != first.shape or cache.dtype != first.dtype:
                raise VllmLayoutError(
                    f"{name}: KV cache {tuple(cache.shape)} {cache.dtype} differs from "
                    f"{names[0]}'s {tuple(first.shape)} {first.dtype}"
                )
            if not cache.is_contiguous():
                raise VllmLayoutError(f"{name}: KV cache is not contiguous")
        if first.dtype != PAYLOAD_DTYPE:
            raise VllmLayoutError(
                f"vLLM's KV cache is {first.dtype}: the layout is checked for float32 caches "
                "only; start vLLM with --dtype float32"
            )
        layout = KVBlockLayout(
            num_full_layers=len(caches), block_size_tokens=block_size,
            num_kv_heads=num_kv_heads, head_dim=two_head_dim // 2, dtype=PAYLOAD_DTYPE,
        )  # fmt: skip
        return cls(caches, layout)

    @property
    def num_blocks(self) -> int:
        return self.caches[0].shape[0]

    def _halves(self, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`cache`'s keys as [num_blocks, heads, head_dim, token] and values as
        [num_blocks, heads, token, head_dim] (views)."""
        layout = self.layout
        b, d = layout.block_size_tokens, layout.head_dim
        halves = cache.view(cache.shape[0], layout.num_kv_heads, 2, b * d)
        keys = halves[:, :, 0].unflatten(-1, (d, b))
        values = halves[:, :, 1].unflatten(-1, (b, d))
        return keys, values

    def gather(self, block_ids: Sequence[int]) -> torch.Tensor:
        """Payloads of vLLM blocks `block_ids`: [n, *layout.block_shape], float32, contiguous
        (a copy: vLLM may reuse the blocks as soon as this returns)."""
        ids = torch.as_tensor(list(block_ids), dtype=torch.long)
        out = torch.empty((len(ids), *self.layout.block_shape), dtype=PAYLOAD_DTYPE)
        for layer, cache in enumerate(self.caches):
            keys, values = self._halves(cache)
            out[:, layer, 0] = keys[ids].permute(0, 3, 1, 2)  # [n, H, D, B] -> [n, B, H, D]
            out[:, layer, 1] = values[ids].permute(0, 2, 1, 3)  # [n, H, B, D] -> [n, B, H, D]
        return out

    def scatter(self, block_ids: Sequence[int], payloads: torch.Tensor) -> None:
        """Write payloads ([n, *layout.block_shape], float32) into vLLM blocks `block_ids`."""
        expected = (len(block_ids), *self.layout.block_shape)
        if tuple(payloads.shape) != expected:
            raise VllmLayoutError(f"payloads {tuple(payloads.shape)}, expected {expected}")
        ids = torch.as_tensor(list(block_ids), dtype=torch.long)
        for layer, cache in enumerate(self.caches):
            keys, values = self._halves(cache)
            keys[ids] = payloads[:, layer, 0].permute(0, 2, 3, 1)  # [n, B, H, D] -> [n, H, D, B]
            values[ids] = payloads[:, layer, 1].permute(0, 2, 1, 3)  # -> [n, H, B, D]
