"""The connector's load path without vLLM: real store files read into a cache laid out as
vLLM's CPU backend lays it out, or as its GPU backends do (on the GPU where there is one),
through the bounded buffer, in parts; a bad slot ends the loaded prefix there, and a store
whose files were emptied loads nothing."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from services.vllm_worker.connector.layout import VllmBlockConverter
from services.vllm_worker.connector.loading import BlockLoader
from services.vllm_worker.connector.loop import LoopThread
from worker.kvstore.slots import SlotRef
from worker.kvstore.store import KvStore, KvStoreConfig

LAYERS, BLOCKS, HEADS, BLOCK, DIM = 2, 12, 2, 32, 8
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
# (kernels, device): the CPU backend's caches, and the GPU backends' in their memory order
CACHES = [("vec", "cpu"), ("flash", "cpu"), pytest.param("flash", "cuda", marks=CUDA)]


@pytest.fixture
def loop() -> Iterator[LoopThread]:
    thread = LoopThread("test-loading")
    yield thread
    thread.stop()


def converter(kernels: str = "vec", device: str = "cpu") -> VllmBlockConverter:
    if kernels == "flash":  # vLLM's LBNHC: [blocks, B, heads, 2 * D] in memory
        shape, order = (BLOCKS, BLOCK, HEADS, 2 * DIM), (0, 2, 1, 3)
    else:
        shape, order = (BLOCKS, HEADS, BLOCK, 2 * DIM), (0, 1, 2, 3)
    caches = {
        f"model.layers.{i}.self_attn.attn": torch.zeros(shape, device=device).permute(order)
        for i in range(LAYERS)
    }
    return VllmBlockConverter.of(caches, BLOCK, kernels)


def stored(
    tmp_path: Path, loop: LoopThread, payloads: torch.Tensor
) -> tuple[KvStore, list[SlotRef]]:
    layout = converter().layout
    config = KvStoreConfig(
        root_dir=tmp_path,
        writer_id="w0",
        payload_nbytes=layout.block_nbytes,
        capacity_bytes=1 << 24,
        file_nbytes=1 << 22,
        backend="aiofiles",
    )
    store = KvStore.open(config)
    raw = payloads.view(torch.uint8).numpy().reshape(len(payloads), -1)
    blocks = [(1000 + i, memoryview(raw[i])) for i in range(len(payloads))]
    written = loop.call(store.write_blocks(blocks), timeout_s=10)
    refs = [SlotRef(s.block_hash, "w0", s.file_id, s.slot, s.generation) for s in written]
    return store, refs


@pytest.mark.parametrize(("kernels", "device"), CACHES)
@pytest.mark.parametrize("part_blocks", [1, 3, 100])
def test_loads_every_block_in_parts_through_one_buffer(
    tmp_path: Path, loop: LoopThread, part_blocks: int, kernels: str, device: str
) -> None:
    conv = converter(kernels, device)
    payloads = torch.randn(7, *conv.layout.block_shape)
    store, refs = stored(tmp_path, loop, payloads)
    loader = BlockLoader(store, conv, loop, part_bytes=part_blocks * conv.layout.block_nbytes)
    targets = [9, 2, 5, 0, 11, 3, 7]  # vLLM's blocks need not be in order
    loaded = loader.load(refs, targets, "r1")
    assert loaded.num_blocks == 7
    assert torch.equal(conv.gather(targets), payloads)
    assert loader.blocks_per_part == min(part_blocks, BLOCKS)
    assert all(b.is_pinned() == (device == "cuda") for b in loader._buffers)  # DMA to a GPU
    store.close()


@pytest.mark.parametrize(("kernels", "device"), CACHES)
def test_a_bad_slot_ends_the_prefix_there(
    tmp_path: Path, loop: LoopThread, kernels: str, device: str
) -> None:
    conv = converter(kernels, device)
    payloads = torch.randn(6, *conv.layout.block_shape)
    store, refs = stored(tmp_path, loop, payloads)
    refs[4] = SlotRef(
        refs[4].block_hash, "w0", refs[4].file_id, refs[4].slot, refs[4].generation + 1
    )  # a slot since reused: not this block
    loader = BlockLoader(store, conv, loop, part_bytes=3 * conv.layout.block_nbytes)
    targets = list(range(6))
    assert loader.load(refs, targets, "r2").num_blocks == 4
    assert torch.equal(conv.gather(targets[:4]), payloads[:4])
    assert not conv.gather([4, 5]).any(), "nothing past the miss is written"
    store.close()


def test_a_store_whose_files_were_emptied_loads_nothing(tmp_path: Path, loop: LoopThread) -> None:
    conv = converter()
    store, refs = stored(tmp_path, loop, torch.randn(3, *conv.layout.block_shape))
    for path in (tmp_path / "w0").glob("*.kvs"):  # the files emptied under the reader
        os.truncate(path, 0)
    loader = BlockLoader(store, conv, loop)
    assert loader.load(refs, [0, 1, 2], "r3").num_blocks == 0
    assert not conv.gather([0, 1, 2]).any()
    with pytest.raises(ValueError, match="3 slots for 2"):
        loader.load(refs, [0, 1], "r4")
    store.close()


class Recorded:
    """The store's reads and the converter's scatters, in the order the loader starts them."""

    def __init__(self, store: KvStore, conv: VllmBlockConverter, fail_scatter_at: int = -1):
        self.store, self.conv, self.fail_scatter_at = store, conv, fail_scatter_at
        self.layout, self.num_blocks, self.device = conv.layout, conv.num_blocks, conv.device
        self.events: list[tuple[str, int]] = []
        self.landed: list[int] = []  # parts whose reads ended

    def read_blocks(self, refs, into):  # noqa: ANN001, ANN201
        first = refs[0].block_hash - 1000
        self.events.append(("read", first))  # when the loader asks, not when the loop runs it
        return self._read(refs, into, first)

    async def _read(self, refs, into, first: int):  # noqa: ANN001, ANN202
        if first:  # every part after the first lands late
            await asyncio.sleep(0.2)
        payloads = await self.store.read_blocks(refs, into)
        self.landed.append(first)
        return payloads

    def scatter(self, block_ids, payloads) -> None:  # noqa: ANN001
        self.events.append(("scatter", block_ids[0]))
        if block_ids[0] == self.fail_scatter_at:
            raise RuntimeError("scatter failed")
        self.conv.scatter(block_ids, payloads)


def test_the_next_part_is_read_while_this_one_is_scattered(
    tmp_path: Path, loop: LoopThread
) -> None:
    conv = converter()
    payloads = torch.randn(7, *conv.layout.block_shape)
    store, refs = stored(tmp_path, loop, payloads)
    spy = Recorded(store, conv)
    loader = BlockLoader(spy, spy, loop, part_bytes=3 * conv.layout.block_nbytes)  # type: ignore[arg-type]
    assert loader.load(refs, list(range(7)), "r5").num_blocks == 7
    assert torch.equal(conv.gather(list(range(7))), payloads)  # two buffers, taken in turn
    assert spy.events == [
        ("read", 0),
        ("read", 3),
        ("scatter", 0),
        ("read", 6),
        ("scatter", 3),
        ("scatter", 6),
    ]
    store.close()


def test_a_failed_scatter_leaves_no_read_running(tmp_path: Path, loop: LoopThread) -> None:
    conv = converter()
    store, refs = stored(tmp_path, loop, torch.randn(6, *conv.layout.block_shape))
    spy = Recorded(store, conv, fail_scatter_at=0)
    loader = BlockLoader(spy, spy, loop, part_bytes=3 * conv.layout.block_nbytes)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="scatter failed"):
        loader.load(refs, list(range(6)), "r6")
    assert spy.events == [("read", 0), ("read", 3), ("scatter", 0)]
    assert spy.landed == [0, 3], "load returned with the second part's read still running"
    store.close()
