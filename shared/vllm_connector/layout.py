"""One block of KV between vLLM's paged cache and the store's payload.

The store's payload is the kvfabric engine's page (`shared.engine.kv_cache.KVBlockLayout`):
`[full_layer, k_or_v, token_in_block, kv_head, head_dim]`, in the model's dtype, every
full-attention layer of B tokens in one contiguous run. A block written by a vLLM worker is
byte-for-byte what a kvfabric engine worker would write for the same tokens (up to
arithmetic), so a prefix stored by one hits in the other: same block hashes, same namespace,
same payload -- where both run the same dtype (a payload of the other size reads as a miss).

vLLM keeps one tensor per attention layer. Its CPU attention backend (`CPU_ATTN`) allocates
`[num_blocks, num_kv_heads, block_size, 2 * head_size]`: per block and head, B keys, then B
values, in the order its kernels for the CPU's ISA read them (`HeadLayout`):
- `vec` (float32, or any x86 CPU without AMX): keys transposed -- `[head_dim, token]`, B keys
  as columns, for the dot products -- then values as rows, `[token, head_dim]`;
- `amx` (bfloat16 on a CPU with AMX tiles): keys in runs of 16 tokens, each run VNNI-packed
  (pairs of dims), `[token / 16, head_dim / 2, 16, 2]`; values in runs of 16 dims, pairs
  of tokens interleaved, `[head_dim / 16, token / 2, 16, 2]`.
Found by comparing what vLLM wrote with the engine's own page for the same tokens (docs/vllm.md),
and checked at every start against vLLM's own cache-write kernel (`check_with_kernel`): a
layout that does not give back what the kernel wrote is refused, never guessed.

The block size must be the same on both sides (vLLM's `--block-size` = the namespace's
`block_size_tokens`, 64 by default: the CPU backend takes multiples of 32).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from shared.engine.kv_cache import KVBlockLayout

_LAYER_INDEX = re.compile(r"layers\.(\d+)\.")

# (key_cache, value_cache, slot_mapping, key, value) -> None: vLLM's cache write, as its
# attention layers call it; the caches are the [blocks, heads, B, D] halves of one tensor.
CacheWrite = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


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


def _columns(region: torch.Tensor, b: int, d: int) -> torch.Tensor:
    return region.unflatten(-1, (d, b)).transpose(-1, -2)  # [..., B, D]


def _rows(region: torch.Tensor, b: int, d: int) -> torch.Tensor:
    return region.unflatten(-1, (b, d))  # [..., B, D]


AMX_TILE = 16  # rows of an AMX tile: the amx kernels' keys come in runs of 16 tokens


def _amx_keys(region: torch.Tensor, b: int, d: int) -> torch.Tensor:
    # [B/16, D/2, 16 tokens, 2 dims] (VNNI pairs of dims) -> [..., B/16, 16, D/2, 2]
    return region.unflatten(-1, (b // AMX_TILE, d // 2, AMX_TILE, 2)).movedim(-2, -3)


def _amx_values(region: torch.Tensor, b: int, d: int) -> torch.Tensor:
    # [D/16, B/2, 16 dims, 2 tokens] (VNNI pairs of tokens) -> [..., B/2, 2, D/16, 16]
    tiles = region.unflatten(-1, (d // AMX_TILE, b // 2, AMX_TILE, 2))
    n = tiles.dim()
    return tiles.permute(*range(n - 4), n - 3, n - 1, n - 4, n - 2)


@dataclass(frozen=True)
class HeadLayout:
    """Where one head's B keys and B values sit in its `[2, B * D]` region of a vLLM block:
    each function views a `[..., B * D]` half as `[..., token..., dim...]`, the token and the
    dim each one axis or split in two, so `.reshape(..., B, D)` is K[t, d] (or V[t, d])."""

    isa: str
    keys: Callable[[torch.Tensor, int, int], torch.Tensor]
    values: Callable[[torch.Tensor, int, int], torch.Tensor]


HEAD_LAYOUTS = {
    "vec": HeadLayout("vec", _columns, _rows),
    "amx": HeadLayout("amx", _amx_keys, _amx_values),
}


@dataclass(frozen=True)
class VllmBlockConverter:
    """Copies whole blocks between vLLM's per-layer caches and store payloads."""

    caches: tuple[torch.Tensor, ...]  # one per full-attention layer, in layer order
    layout: KVBlockLayout  # the payload's (the caches' dtype)
    head: HeadLayout

    @classmethod
    def of(
        cls, kv_caches: Mapping[str, torch.Tensor], block_size_tokens: int, isa: str = "vec"
    ) -> VllmBlockConverter:
        """`isa`: the one vLLM's CPU backend picked for these caches (`vec`, `amx`)."""
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
        if isa not in HEAD_LAYOUTS:
            raise VllmLayoutError(
                f"vLLM's CPU attention uses the {isa!r} kernels; the layouts known here are "
                f"{', '.join(HEAD_LAYOUTS)}"
            )
        layout = KVBlockLayout(
            num_full_layers=len(caches), block_size_tokens=block_size,
            num_kv_heads=num_kv_heads, head_dim=two_head_dim // 2, dtype=first.dtype,
        )  # fmt: skip
        return cls(caches, layout, HEAD_LAYOUTS[isa])

    @property
    def num_blocks(self) -> int:
        return self.caches[0].shape[0]

    def _halves(self, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`cache`'s keys and values as [num_blocks, heads, token..., dim...] views."""
        layout = self.layout
        b, d = layout.block_size_tokens, layout.head_dim
        halves = cache.view(cache.shape[0], layout.num_kv_heads, 2, b * d)
        return self.head.keys(halves[:, :, 0], b, d), self.head.values(halves[:, :, 1], b, d)

    def gather(self, block_ids: Sequence[int]) -> torch.Tensor:
        """Payloads of vLLM blocks `block_ids`: [n, *layout.block_shape], contiguous (a copy:
        vLLM may reuse the blocks as soon as this returns)."""
        layout = self.layout
        ids = torch.as_tensor(list(block_ids), dtype=torch.long)
        n, b, d = len(ids), layout.block_size_tokens, layout.head_dim
        out = torch.empty((n, *layout.block_shape), dtype=layout.dtype)
        for layer, cache in enumerate(self.caches):
            for k_or_v, half in enumerate(self._halves(cache)):
                taken = half[ids].reshape(n, layout.num_kv_heads, b, d)
                out[:, layer, k_or_v] = taken.transpose(1, 2)  # [n, H, B, D] -> [n, B, H, D]
        return out

    def scatter(self, block_ids: Sequence[int], payloads: torch.Tensor) -> None:
        """Write payloads ([n, *layout.block_shape]) into vLLM blocks `block_ids`."""
        expected = (len(block_ids), *self.layout.block_shape)
        if tuple(payloads.shape) != expected or payloads.dtype != self.layout.dtype:
            raise VllmLayoutError(
                f"payloads {tuple(payloads.shape)} {payloads.dtype}, expected {expected} "
                f"{self.layout.dtype}"
            )
        ids = torch.as_tensor(list(block_ids), dtype=torch.long)
        for layer, cache in enumerate(self.caches):
            for k_or_v, half in enumerate(self._halves(cache)):
                rows = payloads[:, layer, k_or_v].transpose(1, 2)  # [n, B, H, D] -> [n, H, B, D]
                half[ids] = rows.reshape(len(ids), *half.shape[1:])


def check_with_kernel(converter: VllmBlockConverter, write: CacheWrite) -> None:
    """Have vLLM's own cache-write kernel fill one block of a small cache shaped like
    `converter`'s, then gather it through `converter`'s layout: every key and value must come
    back at its token, head and dim (three passes, each writing one coordinate, exact in any
    float dtype up to 256), and nothing else may be touched. A mismatch -- another vLLM,
    another ISA's kernels -- is refused at start (VllmLayoutError)."""
    layout = converter.layout
    b, h, d = layout.block_size_tokens, layout.num_kv_heads, layout.head_dim
    cache = torch.zeros((2, h, b, 2 * d), dtype=layout.dtype)
    probe = VllmBlockConverter.of(
        {"model.layers.0.attn": cache}, b, converter.head.isa
    )  # fmt: skip
    key_cache, value_cache = cache.view(2, h, 2 * b, d).chunk(2, dim=2)
    grids = torch.meshgrid(torch.arange(b), torch.arange(h), torch.arange(d), indexing="ij")
    for name, grid in zip(("token", "head", "dim"), grids, strict=True):
        cache.zero_()
        keys = (grid + 1).to(layout.dtype)  # [B, H, D], as the layer passes its new K
        values = -(grid + 1).to(layout.dtype)
        write(key_cache, value_cache, torch.arange(b, 2 * b), keys, values)  # block 1
        page = probe.gather([1])[0, 0]  # [2, B, H, D]
        if not (torch.equal(page[0], keys) and torch.equal(page[1], values)):
            raise VllmLayoutError(
                f"vLLM's cache-write kernel does not put each key and value where the "
                f"{converter.head.isa!r} layout reads them (by {name})"
            )
        if cache[0].any():
            raise VllmLayoutError("vLLM's cache-write kernel wrote outside the block it was given")
