"""vLLM's CPU KV cache against the store's payload, without vLLM: a cache filled the way the
CPU backend's kernels fill it (per block and head, the keys transposed -- head_dim rows of B
tokens -- then B rows of values) gathers to the kvfabric engine's page layout, and scatter
puts it back bit for bit; layouts, dtypes and block sizes the converter does not know are
refused at start. The same for the `amx` kernels' tiled layout (bfloat16), for the GPU
backends' `flash` layout (key then value per token and head, in vLLM's GPU memory order; on
a CUDA device where there is one), and the check every connector runs at start against
vLLM's cache-write kernel, here against writers of each layout written out index by index.
(tests/e2e/test_vllm.py runs it against vLLM's CPU kernels, and KV one engine wrote gives the
other's from-scratch answer; vLLM's GPU kernel is met only on a GPU cluster.)"""

from __future__ import annotations

import pytest
import torch

from services.vllm_worker.connector.layout import (
    AMX_TILE,
    VllmBlockConverter,
    VllmLayoutError,
    _probe_like,
    check_with_kernel,
    layer_order,
)
from worker.engine.kv_cache import KVBlockLayout

LAYERS, BLOCKS, HEADS, BLOCK, DIM = 3, 6, 2, 32, 16  # the amx kernels tile by 16


def cpu_caches(dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Per layer [blocks, heads, block, 2 * dim], names out of order on purpose."""
    return {
        f"model.layers.{i}.self_attn.attn": torch.zeros(BLOCKS, HEADS, BLOCK, 2 * DIM, dtype=dtype)
        for i in (2, 0, 1)
    }


def key(layer: int, block: int, head: int, token: int, dim: int) -> float:
    return float(((layer * 10 + block) * 10 + head) * 100 + token) + dim / 100


def write_as_cpu_backend(caches: dict[str, torch.Tensor]) -> None:
    """What CPU_ATTN's `vec` kernels leave per block and head: keys as [dim, token] (each
    token a column), then values as [token, dim]."""
    for layer, name in enumerate(layer_order(list(caches))):
        halves = caches[name].view(BLOCKS, HEADS, 2, BLOCK * DIM)
        keys = halves[:, :, 0].view(BLOCKS, HEADS, DIM, BLOCK)
        values = halves[:, :, 1].view(BLOCKS, HEADS, BLOCK, DIM)
        for b in range(BLOCKS):
            for h in range(HEADS):
                for t in range(BLOCK):
                    for d in range(DIM):
                        keys[b, h, d, t] = key(layer, b, h, t, d)
                        values[b, h, t, d] = -key(layer, b, h, t, d)


def assert_pages_hold_keys(pages: torch.Tensor, blocks: list[int]) -> None:
    """Gathered pages of `blocks` (written by a backend's writer) hold `key` as K and -`key`
    as V, at their token, head and dim (sampled)."""
    for i, b in enumerate(blocks):
        for layer in range(LAYERS):
            for h in range(HEADS):
                for t in (0, 7, BLOCK - 1):
                    for d in (0, DIM - 1):
                        assert pages[i, layer, 0, t, h, d] == key(layer, b, h, t, d)
                        assert pages[i, layer, 1, t, h, d] == -key(layer, b, h, t, d)


def assert_round_trip(
    source: dict[str, torch.Tensor], target: dict[str, torch.Tensor], kernels: str
) -> torch.Tensor:
    """Seeded noise in `source`'s blocks 0, 3, 5, gathered and scattered into `target`'s 2, 0,
    4: those hold the same values, and nothing else in `target` is touched. The pages."""
    for i, cache in enumerate(source.values()):
        noise = torch.randn(cache.shape, generator=torch.Generator().manual_seed(i))
        cache.copy_(noise.to(cache.dtype))
    pages = VllmBlockConverter.of(source, BLOCK, kernels).gather([0, 3, 5])
    VllmBlockConverter.of(target, BLOCK, kernels).scatter([2, 0, 4], pages)
    for name in source:
        assert torch.equal(target[name][[2, 0, 4]], source[name][[0, 3, 5]])
        assert not target[name][[1, 3, 5]].any()  # nothing else touched
    return pages


def test_layer_order_follows_the_layer_index_not_the_name() -> None:
    names = [
        "model.layers.10.self_attn.attn",
        "model.layers.2.self_attn.attn",
        "model.layers.0.self_attn.attn",
        "model.layers.1.self_attn.attn",
    ]
    with pytest.raises(VllmLayoutError, match="not 0..n-1"):
        layer_order(names)  # 3..9 missing
    assert layer_order(names[1:]) == sorted(names[1:], key=lambda n: int(n.split(".")[2]))
    with pytest.raises(VllmLayoutError, match="no layer index"):
        layer_order(["lm_head"])


def test_gather_gives_the_engine_page_layout() -> None:
    caches = cpu_caches()
    write_as_cpu_backend(caches)
    converter = VllmBlockConverter.of(caches, BLOCK)
    assert converter.layout == KVBlockLayout(LAYERS, BLOCK, HEADS, DIM, torch.float32)
    pages = converter.gather([4, 1])
    assert tuple(pages.shape) == (2, LAYERS, 2, BLOCK, HEADS, DIM) and pages.is_contiguous()
    assert_pages_hold_keys(pages, [4, 1])
    # The payload is what the store writes: one block's bytes are layout.block_nbytes.
    assert pages[0].numel() * 4 == converter.layout.block_nbytes


def test_scatter_puts_gathered_blocks_back_in_other_blocks() -> None:
    assert_round_trip(cpu_caches(), cpu_caches(), "vec")


def test_refuses_what_it_does_not_know() -> None:
    with pytest.raises(VllmLayoutError, match="--block-size 64"):
        VllmBlockConverter.of(cpu_caches(), 64)
    older = {"model.layers.0.self_attn.attn": torch.zeros(2, BLOCKS, BLOCK, HEADS, DIM)}
    with pytest.raises(VllmLayoutError, match=r"\[num_blocks, num_kv_heads, block_size"):
        VllmBlockConverter.of(older, BLOCK)  # vLLM's older GPU layout, K and V apart
    lbnhc = {n: c.transpose(1, 2).contiguous().transpose(1, 2) for n, c in cpu_caches().items()}
    with pytest.raises(VllmLayoutError, match="not contiguous"):
        VllmBlockConverter.of(lbnhc, BLOCK, "vec")  # the CPU layouts view memory as it lies
    fp8 = {n: c.to(torch.float8_e4m3fn) for n, c in cpu_caches().items()}
    with pytest.raises(VllmLayoutError, match="quantized"):
        VllmBlockConverter.of(fp8, BLOCK, "flash")
    mixed = cpu_caches()
    mixed["model.layers.1.self_attn.attn"] = torch.zeros(BLOCKS, HEADS, BLOCK, 2 * DIM + 2)
    with pytest.raises(VllmLayoutError, match="differs"):
        VllmBlockConverter.of(mixed, BLOCK)
    with pytest.raises(VllmLayoutError, match="'neon' kernels"):
        VllmBlockConverter.of(cpu_caches(), BLOCK, "neon")
    converter = VllmBlockConverter.of(cpu_caches(), BLOCK)
    with pytest.raises(VllmLayoutError, match="payloads"):
        converter.scatter([0], torch.zeros(2, LAYERS, 2, BLOCK, HEADS, DIM))


def amx_offset(k_or_v: int, token: int, dim: int) -> int:
    """Where the `amx` kernels put K[token, dim] (0) or V[token, dim] (1) in one head's
    [2, B * D] region, written out: keys in runs of 16 tokens, each [D/2, 16, 2] (dim
    pairs); values in runs of 16 dims, each [B/2, 16, 2] (token pairs)."""
    if k_or_v == 0:
        run, t = divmod(token, AMX_TILE)
        return ((run * (DIM // 2) + dim // 2) * AMX_TILE + t) * 2 + dim % 2
    run, d = divmod(dim, AMX_TILE)
    return BLOCK * DIM + ((run * (BLOCK // 2) + token // 2) * AMX_TILE + d) * 2 + token % 2


def vec_offset(k_or_v: int, token: int, dim: int) -> int:
    return dim * BLOCK + token if k_or_v == 0 else BLOCK * DIM + token * DIM + dim


def writer(offset):  # noqa: ANN001, ANN201
    """A cache write like vLLM's `cpu_attn_reshape_and_cache`, placing by `offset`."""

    def write(key_cache, value_cache, slots, keys, values) -> None:  # noqa: ANN001
        per_block = HEADS * 2 * BLOCK * DIM  # the halves are views of one [blocks, ...] tensor
        blocks = key_cache.as_strided((key_cache.shape[0], per_block), (per_block, 1))
        for i, slot in enumerate(slots.tolist()):
            block, t = divmod(slot, BLOCK)
            for h in range(HEADS):
                for d in range(DIM):
                    head = h * 2 * BLOCK * DIM
                    blocks[block, head + offset(0, t, d)] = keys[i, h, d]
                    blocks[block, head + offset(1, t, d)] = values[i, h, d]

    return write


@pytest.mark.parametrize(("isa", "offset"), [("vec", vec_offset), ("amx", amx_offset)])
def test_each_layout_reads_what_its_kernel_writes(isa: str, offset) -> None:  # noqa: ANN001
    caches = cpu_caches(torch.bfloat16)
    converter = VllmBlockConverter.of(caches, BLOCK, isa)
    assert converter.layout.dtype == torch.bfloat16  # the payload keeps the cache's dtype
    check_with_kernel(converter, writer(offset))
    other = amx_offset if offset is vec_offset else vec_offset
    with pytest.raises(VllmLayoutError, match=f"'{isa}' layout reads them"):
        check_with_kernel(converter, writer(other))


def test_amx_blocks_round_trip_in_bfloat16() -> None:
    pages = assert_round_trip(cpu_caches(torch.bfloat16), cpu_caches(torch.bfloat16), "amx")
    assert pages.dtype == torch.bfloat16


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]


def gpu_caches(device: str, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """As vLLM's GPU model runner allocates them: [blocks, B, heads, 2 * dim] in memory
    (LBNHC), each a [blocks, heads, B, 2 * dim] view; names out of order on purpose."""
    return {
        f"model.layers.{i}.self_attn.attn": torch.zeros(
            BLOCKS, BLOCK, HEADS, 2 * DIM, dtype=dtype, device=device
        ).transpose(1, 2)
        for i in (2, 0, 1)
    }


def write_as_gpu_backend(caches: dict[str, torch.Tensor]) -> None:
    """What reshape_and_cache_flash leaves: key_cache[block, token, head] (and value_cache),
    the views `cache.transpose(1, 2).split(dim, -1)`, each the head's D values."""
    for layer, name in enumerate(layer_order(list(caches))):
        key_cache, value_cache = caches[name].transpose(1, 2).split(DIM, dim=-1)
        for b in range(BLOCKS):
            for t in range(BLOCK):
                for h in range(HEADS):
                    got = torch.tensor([key(layer, b, h, t, d) for d in range(DIM)])
                    key_cache[b, t, h] = got
                    value_cache[b, t, h] = -got


def flash_write(key_cache, value_cache, slots, keys, values) -> None:  # noqa: ANN001
    """reshape_and_cache_flash as its documentation says: token i to slot_mapping[i]."""
    blocks, offsets = slots // BLOCK, slots % BLOCK
    key_cache[blocks, offsets] = keys
    value_cache[blocks, offsets] = values


def swapped_write(key_cache, value_cache, slots, keys, values) -> None:  # noqa: ANN001
    flash_write(value_cache, key_cache, slots, keys, values)  # values first: another layout


@pytest.mark.parametrize("device", DEVICES)
def test_flash_gather_gives_the_engine_page_layout(device: str) -> None:
    caches = gpu_caches("cpu")
    write_as_gpu_backend(caches)  # filled on the host, index by index, then moved
    caches = {n: c.to(device) for n, c in caches.items()}  # .to keeps the memory order
    converter = VllmBlockConverter.of(caches, BLOCK, "flash")
    assert converter.layout == KVBlockLayout(LAYERS, BLOCK, HEADS, DIM, torch.float32)
    pages = converter.gather([4, 1])
    assert pages.device.type == "cpu" and pages.is_contiguous()
    assert_pages_hold_keys(pages, [4, 1])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flash_scatter_puts_gathered_blocks_back_in_other_blocks(
    device: str, dtype: torch.dtype
) -> None:
    assert_round_trip(gpu_caches(device, dtype), gpu_caches(device, dtype), "flash")


@pytest.mark.parametrize("device", DEVICES)
def test_the_flash_layout_reads_what_its_kernel_writes_and_no_other(device: str) -> None:
    converter = VllmBlockConverter.of(gpu_caches(device, torch.bfloat16), BLOCK, "flash")
    probe = _probe_like(converter.caches[0], 2)  # the check's cache: as vLLM's, 2 blocks
    assert probe.shape == (2, HEADS, BLOCK, 2 * DIM) and probe.device == converter.device
    assert probe.transpose(1, 2).is_contiguous() and not probe.any()  # LBNHC, zeroed
    check_with_kernel(converter, flash_write)
    with pytest.raises(VllmLayoutError, match="'flash' layout reads them"):
        check_with_kernel(converter, swapped_write)
    with pytest.raises(VllmLayoutError, match="'flash' layout reads them"):
        check_with_kernel(converter, writer(vec_offset))  # the CPU kernel's, on flash caches
