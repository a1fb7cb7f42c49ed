"""One block of KV between vLLM's paged cache and the store's payload.

The store's payload is the kvfabric engine's page (`worker.engine.kv_cache.KVBlockLayout`):
`[full_layer, k_or_v, token_in_block, kv_head, head_dim]`, in the model's dtype, every
full-attention layer of B tokens in one contiguous run. A block written by a vLLM worker is
byte-for-byte what a kvfabric engine worker would write for the same tokens (up to
arithmetic), so a prefix stored by one hits in the other: same block hashes, same namespace,
same payload -- where both run the same dtype (a payload of the other size reads as a miss).

vLLM keeps one tensor per attention layer, `[num_blocks, num_kv_heads, block_size,
2 * head_size]` on every backend (the memory order may differ: on a GPU it is usually
`[num_blocks, block_size, num_kv_heads, 2 * head_size]`, vLLM's `LBNHC`). What the last two
axes hold depends on the kernels that write and read them (`HeadLayout`):
- CPU backend (`CPU_ATTN`), per block and head, B keys then B values, in the order its
  kernels for the CPU's ISA read them:
  - `vec` (float32, or any x86 CPU without AMX): keys transposed -- `[head_dim, token]`, B
    keys as columns, for the dot products -- then values as rows, `[token, head_dim]`;
  - `amx` (bfloat16 on a CPU with AMX tiles): keys in runs of 16 tokens, each run
    VNNI-packed (pairs of dims), `[token / 16, head_dim / 2, 16, 2]`; values in runs of 16
    dims, pairs of tokens interleaved, `[head_dim / 16, token / 2, 16, 2]`.
- GPU backends (FlashAttention, FlashInfer, Triton: `flash`), per block, head and token, the
  key then the value, `[head_dim]` each: what vLLM's `reshape_and_cache_flash` writes into
  `cache.transpose(1, 2).split(head_size, -1)`.
Found by comparing what vLLM wrote with the engine's own page for the same tokens, or from
vLLM's attention backends (docs/vllm.md), and checked at every start against vLLM's own
cache-write kernel (`check_with_kernel`): a layout that does not give back what the kernel
wrote is refused, never guessed.

A cache on a GPU moves through host memory: `gather` gives host payloads, `scatter` takes
them (from pinned memory, one copy to the device, then the blocks placed there).

The block size must be the same on both sides (vLLM's `--block-size` = the namespace's
`block_size_tokens`, 64 by default: the CPU backend takes multiples of 32).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from worker.engine.kv_cache import KVBlockLayout

_LAYER_INDEX = re.compile(r"layers\.(\d+)\.")

# (key_cache, value_cache, slot_mapping, key, value) -> None: vLLM's cache write, as its
# attention layers call it; the caches are HeadLayout.kernel_caches' views of one tensor.
CacheWrite = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
# A `[..., B * D]` run of keys (or values) viewed as `[..., token..., dim...]`
RegionView = Callable[[torch.Tensor, int, int], torch.Tensor]


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


Halves = Callable[[torch.Tensor, int, int], tuple[torch.Tensor, torch.Tensor]]


def _per_head_runs(keys: RegionView, values: RegionView) -> Halves:
    """The CPU backend's: per block and head, a `[2, B * D]` region, B keys then B values."""

    def halves(cache: torch.Tensor, b: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
        regions = cache.view(cache.shape[0], cache.shape[1], 2, b * d)
        return keys(regions[:, :, 0], b, d), values(regions[:, :, 1], b, d)

    return halves


def _cpu_kernel_caches(cache: torch.Tensor, b: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    # cpu_attn_reshape_and_cache's key_cache and value_cache: the two runs of each head
    return cache.view(cache.shape[0], cache.shape[1], 2 * b, d).chunk(2, dim=2)


def _flash_halves(cache: torch.Tensor, b: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    # [blocks, heads, B, 2 * D] -> [blocks, heads, B, 2, D]: a view in any memory order
    pairs = cache.unflatten(-1, (2, d))
    return pairs[..., 0, :], pairs[..., 1, :]


def _flash_kernel_caches(cache: torch.Tensor, b: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    # reshape_and_cache_flash's key_cache and value_cache: [blocks, B, heads, D] each
    key_cache, value_cache = cache.transpose(1, 2).split(d, dim=-1)
    return key_cache, value_cache


@dataclass(frozen=True)
class HeadLayout:
    """How one layer's cache, `[num_blocks, heads, B, 2 * D]`, holds its keys and values.

    `halves(cache, B, D)`: the keys and the values as `[num_blocks, heads, token..., dim...]`
    views (the token and the dim each one axis or split in two), so `.reshape(n, heads, B,
    D)` of some blocks is K[t, d] (or V[t, d]). `kernel_caches(cache, B, D)`: the
    (key_cache, value_cache) views vLLM's cache-write kernel for this layout takes."""

    name: str
    halves: Halves
    kernel_caches: Halves
    any_memory_order: bool  # False: `halves` views the cache's memory as one contiguous run


HEAD_LAYOUTS = {
    "vec": HeadLayout("vec", _per_head_runs(_columns, _rows), _cpu_kernel_caches, False),
    "amx": HeadLayout("amx", _per_head_runs(_amx_keys, _amx_values), _cpu_kernel_caches, False),
    "flash": HeadLayout("flash", _flash_halves, _flash_kernel_caches, True),
}
# A GPU cache's dtypes that are pages as they are (an fp8 cache needs its scales: refused)
FLASH_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class VllmBlockConverter:
    """Copies whole blocks between vLLM's per-layer caches and store payloads (host
    tensors, wherever the caches are)."""

    caches: tuple[torch.Tensor, ...]  # one per full-attention layer, in layer order
    layout: KVBlockLayout  # the payload's (the caches' dtype)
    head: HeadLayout

    @classmethod
    def of(
        cls, kv_caches: Mapping[str, torch.Tensor], block_size_tokens: int, kernels: str = "vec"
    ) -> VllmBlockConverter:
        """`kernels`: the layout of the kernels vLLM picked for these caches (`vec`, `amx` on
        its CPU backend, `flash` on a GPU)."""
        names = layer_order(list(kv_caches))
        caches = tuple(kv_caches[n] for n in names)
        first = caches[0]
        if first.dim() != 4:
            raise VllmLayoutError(
                f"KV cache of {names[0]} has shape {tuple(first.shape)}: expected vLLM's "
                "[num_blocks, num_kv_heads, block_size, 2 * head_size]"
            )
        _, num_kv_heads, block_size, two_head_dim = first.shape
        if block_size != block_size_tokens:
            raise VllmLayoutError(
                f"vLLM's block size is {block_size}, the store's blocks are "
                f"{block_size_tokens} tokens: start vLLM with --block-size {block_size_tokens}"
            )
        if kernels not in HEAD_LAYOUTS:
            raise VllmLayoutError(
                f"vLLM's attention uses the {kernels!r} kernels; the layouts known here are "
                f"{', '.join(HEAD_LAYOUTS)}"
            )
        head = HEAD_LAYOUTS[kernels]
        for name, cache in zip(names, caches, strict=True):
            if cache.shape != first.shape or cache.dtype != first.dtype:
                raise VllmLayoutError(
                    f"{name}: KV cache {tuple(cache.shape)} {cache.dtype} differs from "
                    f"{names[0]}'s {tuple(first.shape)} {first.dtype}"
                )
            if cache.device != first.device:
                raise VllmLayoutError(
                    f"{name}: KV cache on {cache.device}, {names[0]}'s on {first.device}"
                )
            if not (head.any_memory_order or cache.is_contiguous()):
                raise VllmLayoutError(f"{name}: KV cache is not contiguous")
            if cache.stride(-1) != 1:
                raise VllmLayoutError(f"{name}: KV cache's head_size axis is not contiguous")
        if kernels == "flash" and first.dtype not in FLASH_DTYPES:
            raise VllmLayoutError(
                f"KV cache dtype {first.dtype}: pages are kept as "
                f"{', '.join(map(str, FLASH_DTYPES))} (a quantized cache is not converted)"
            )
        layout = KVBlockLayout(
            num_full_layers=len(caches),
            block_size_tokens=block_size,
            num_kv_heads=num_kv_heads,
            head_dim=two_head_dim // 2,
            dtype=first.dtype,
        )
        return cls(caches, layout, head)

    @property
    def num_blocks(self) -> int:
        return self.caches[0].shape[0]

    @property
    def device(self) -> torch.device:
        return self.caches[0].device

    def _halves(self, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`cache`'s keys and values as [num_blocks, heads, token..., dim...] views."""
        return self.head.halves(cache, self.layout.block_size_tokens, self.layout.head_dim)

    def gather(self, block_ids: Sequence[int]) -> torch.Tensor:
        """Payloads of vLLM blocks `block_ids`: [n, *layout.block_shape], contiguous, in host
        memory (a copy: vLLM may reuse the blocks as soon as this returns)."""
        layout = self.layout
        ids = torch.as_tensor(list(block_ids), dtype=torch.long, device=self.device)
        n, b, d = len(ids), layout.block_size_tokens, layout.head_dim
        out = torch.empty((n, *layout.block_shape), dtype=layout.dtype, device=self.device)
        for layer, cache in enumerate(self.caches):
            for k_or_v, half in enumerate(self._halves(cache)):
                taken = half[ids].reshape(n, layout.num_kv_heads, b, d)
                out[:, layer, k_or_v] = taken.transpose(1, 2)  # [n, H, B, D] -> [n, B, H, D]
        if self.device.type == "cpu":
            return out
        # Pinned (torch's caching host allocator keeps it for the next gather): one DMA copy,
        # where fresh pageable memory would be faulted in page by page (1.4 GB/s on an H200).
        host = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)
        return host.copy_(out)

    def scatter(self, block_ids: Sequence[int], payloads: torch.Tensor) -> None:
        """Write payloads ([n, *layout.block_shape], host memory: pinned for a GPU's caches,
        one copy to the device) into vLLM blocks `block_ids`. Returns when they are there,
        so the caller may reuse `payloads` at once."""
        expected = (len(block_ids), *self.layout.block_shape)
        if tuple(payloads.shape) != expected or payloads.dtype != self.layout.dtype:
            raise VllmLayoutError(
                f"payloads {tuple(payloads.shape)} {payloads.dtype}, expected {expected} "
                f"{self.layout.dtype}"
            )
        ids = torch.as_tensor(list(block_ids), dtype=torch.long, device=self.device)
        payloads = payloads.to(self.device)  # itself on the CPU; a blocking copy to a GPU
        for layer, cache in enumerate(self.caches):
            for k_or_v, half in enumerate(self._halves(cache)):
                rows = payloads[:, layer, k_or_v].transpose(1, 2)  # [n, B, H, D] -> [n, H, B, D]
                half[ids] = rows.reshape(len(ids), *half.shape[1:])
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # the blocks are in place


def _probe_like(cache: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """A zeroed cache of `num_blocks` blocks shaped like `cache`, on its device, in its
    memory order (the kernel writes by strides: the probe must have the same ones)."""
    order = sorted(range(cache.dim()), key=lambda i: (-cache.stride(i), i))  # outermost first
    shape = [num_blocks if i == 0 else cache.shape[i] for i in order]
    stored = torch.zeros(shape, dtype=cache.dtype, device=cache.device)
    return stored.permute([order.index(i) for i in range(cache.dim())])


def check_with_kernel(converter: VllmBlockConverter, write: CacheWrite) -> None:
    """Have vLLM's own cache-write kernel fill one block of a small cache shaped like
    `converter`'s (on its device, in its memory order), then gather it through `converter`'s
    layout: every key and value must come back at its token, head and dim (three passes,
    each writing one coordinate, exact in any float dtype up to 256), and nothing else may be
    touched. A mismatch -- another vLLM, other kernels -- is refused at start
    (VllmLayoutError)."""
    layout = converter.layout
    b, h, d = layout.block_size_tokens, layout.num_kv_heads, layout.head_dim
    device = converter.device
    cache = _probe_like(converter.caches[0], 2)
    probe = VllmBlockConverter.of({"model.layers.0.attn": cache}, b, converter.head.name)
    key_cache, value_cache = converter.head.kernel_caches(cache, b, d)
    grids = torch.meshgrid(torch.arange(b), torch.arange(h), torch.arange(d), indexing="ij")
    slots = torch.arange(b, 2 * b, device=device)  # block 1
    for name, grid in zip(("token", "head", "dim"), grids, strict=True):
        cache.zero_()
        keys = (grid + 1).to(layout.dtype)  # [B, H, D], as the layer passes its new K
        values = -(grid + 1).to(layout.dtype)
        write(key_cache, value_cache, slots, keys.to(device), values.to(device))
        page = probe.gather([1])[0, 0]  # [2, B, H, D]
        if not (torch.equal(page[0], keys) and torch.equal(page[1], values)):
            raise VllmLayoutError(
                f"vLLM's cache-write kernel does not put each key and value where the "
                f"{converter.head.name!r} layout reads them (by {name})"
            )
        if cache[0].any():
            raise VllmLayoutError("vLLM's cache-write kernel wrote outside the block it was given")
