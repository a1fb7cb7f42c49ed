"""The host-memory tier behind a worker's KV pool (worker/engine/host_tier.py): a tagged page
the pool hands out again leaves its bytes there; a later prompt's leading blocks come back
from the pool first, then from there into fresh tagged pages, and only the rest from the
store; bounded, least recently used out first."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import torch

from shared.schema.inference import BlockLocations
from worker.engine.block_allocator import BlockAllocator
from worker.engine.errors import OutOfBlocksError
from worker.engine.host_tier import HostTier
from worker.engine.kv_cache import KVBlockLayout, PagedKVPool
from worker.kvstore import AIOFILES, KvStore, KvStoreConfig, SlotRef
from worker.kvstore.slots import slot_nbytes_for
from worker.serving.pages import take_prefix

LAYOUT = KVBlockLayout(
    num_full_layers=2, block_size_tokens=4, num_kv_heads=2, head_dim=3, dtype=torch.bfloat16
)


def tiered(num_blocks: int, capacity_blocks: int) -> tuple[PagedKVPool, BlockAllocator, HostTier]:
    pool = PagedKVPool(LAYOUT, num_blocks)
    host = HostTier(pool, capacity_blocks * LAYOUT.block_nbytes)
    return pool, BlockAllocator(num_blocks, on_evict=host.save), host


def written(pool: PagedKVPool, allocator: BlockAllocator, hashes: list[int]) -> dict[int, bytes]:
    """Pages holding random KV for `hashes`, tagged and freed: their bytes by hash."""
    pages = allocator.allocate(len(hashes))
    contents = {}
    for page, block_hash in zip(pages, hashes, strict=True):
        pool.kv[page].normal_()
        allocator.tag(page, block_hash)
        contents[block_hash] = pool.block_to_bytes(page)
    allocator.free(pages)
    return contents


def test_pages_handed_out_again_leave_their_bytes_in_the_host_tier_lru_bounded() -> None:
    pool, allocator, host = tiered(num_blocks=3, capacity_blocks=2)
    contents = written(pool, allocator, [11, 12, 13])
    assert host.num_blocks == 0  # free but still in the pool: nothing moved yet
    pages = allocator.allocate(3)  # every tagged page written over: 11, 12, 13 saved
    assert host.num_saved == 3 and host.num_evicted == 1  # 11, the oldest, out
    assert not host.holds(11) and host.holds(12) and host.holds(13)
    assert host.nbytes == 2 * LAYOUT.block_nbytes
    allocator.free(pages)

    restored = host.restore(allocator, [12, 13, 14])
    assert len(restored) == 2 and host.num_restored == 2
    assert [pool.block_to_bytes(p) for p in restored] == [contents[12], contents[13]]
    assert [allocator.ref_count(p) for p in restored] == [1, 1]  # the caller's
    allocator.free(restored)
    assert allocator.revive([12, 13]) == restored  # tagged: the pool holds them again


def test_no_room_in_the_pool_restores_nothing() -> None:
    pool, allocator, host = tiered(num_blocks=2, capacity_blocks=4)
    written(pool, allocator, [21, 22])
    held = allocator.allocate(2)  # 21 and 22 to the host tier; the pool full
    assert host.restore(allocator, [21, 22]) == []
    assert host.holds(21) and host.holds(22)
    allocator.free(held)


def test_a_prefix_comes_from_the_pool_then_the_host_tier_before_the_store() -> None:
    """Blocks 0-1 still in the pool, 2-3 only in the host tier: take_prefix returns all four
    without reading the store (its locations name none)."""
    pool, allocator, host = tiered(num_blocks=6, capacity_blocks=8)
    chain = [31, 32, 33, 34]
    contents = written(pool, allocator, chain[2:])
    allocator.free(allocator.allocate(6))  # every page handed out: 33, 34 to the host tier
    assert host.holds(33) and host.holds(34)
    contents |= written(pool, allocator, chain[:2])
    prefix = asyncio.run(
        take_prefix(None, pool, allocator, BlockLocations(), chain, 4, host=host)  # type: ignore[arg-type]
    )
    assert (prefix.num_blocks, prefix.num_local, prefix.num_host) == (4, 2, 2)
    assert [pool.block_to_bytes(p) for p in prefix.pages] == [contents[h] for h in chain]
    allocator.free(prefix.pages)


def test_the_pool_and_the_host_tier_alternate_along_a_prefix() -> None:
    """An earlier turn's oldest blocks were handed out first: blocks 0-1 in the host tier,
    2-3 still in the pool; all four come back, none from the store."""
    pool, allocator, host = tiered(num_blocks=4, capacity_blocks=8)
    chain = [51, 52, 53, 54]
    contents = written(pool, allocator, chain)  # pages 0-3, freed in chain order
    allocator.free(allocator.allocate(2))  # the two oldest free pages: 51's and 52's
    assert host.holds(51) and host.holds(52) and not host.holds(53)
    prefix = asyncio.run(
        take_prefix(None, pool, allocator, BlockLocations(), chain, 4, host=host)  # type: ignore[arg-type]
    )
    assert (prefix.num_blocks, prefix.num_local, prefix.num_host) == (4, 2, 2)
    assert [pool.block_to_bytes(p) for p in prefix.pages] == [contents[h] for h in chain]
    allocator.free(prefix.pages)


def test_a_worker_without_a_host_tier_keeps_nothing() -> None:
    pool = PagedKVPool(LAYOUT, 2)
    host = HostTier(pool, 0)
    allocator = BlockAllocator(2, on_evict=host.save)
    written(pool, allocator, [41, 42])
    allocator.free(allocator.allocate(2))
    assert host.num_blocks == 0 and host.num_saved == 0


async def stored_in(root: Path, hashes: list[int]) -> tuple[KvStore, BlockLocations]:
    """A real store (files under `root`) holding random KV for `hashes`, and where."""
    nbytes, slot = LAYOUT.block_nbytes, slot_nbytes_for(LAYOUT.block_nbytes)
    config = KvStoreConfig(
        root, "w1", nbytes, backend=AIOFILES, capacity_bytes=64 * slot, file_nbytes=8 * slot
    )
    store = KvStore.open(config)
    rng = np.random.default_rng(0)
    stored = await store.write_blocks([(h, rng.bytes(nbytes)) for h in hashes])
    columns = {
        "block_hash": np.array(hashes),
        "writer": np.zeros(len(hashes)),
        "file_id": np.array([s.file_id for s in stored]),
        "slot": np.array([s.slot for s in stored]),
        "generation": np.array([s.generation for s in stored]),
        "num_bytes": np.array([s.num_bytes for s in stored]),
    }
    return store, BlockLocations.from_columns("ssd", ("w1",), columns)


async def test_a_store_read_fits_the_free_pages_or_raises(tmp_path: Path) -> None:
    """With fewer free pages than the prefix, prefill's read (`fit_pool`) stops where they
    run out, bytes intact; without it (decode's) the shortage is an error."""
    pool, allocator = PagedKVPool(LAYOUT, 4), BlockAllocator(4)
    chain = [41, 42, 43, 44]
    store, where = await stored_in(tmp_path, chain)
    try:
        allocator.allocate(2)  # other jobs' pages: 2 free
        with pytest.raises(OutOfBlocksError):
            await take_prefix(store, pool, allocator, where, chain, 4)
        assert allocator.num_free_blocks == 2  # nothing kept by the failed read
        got = await take_prefix(store, pool, allocator, where, chain, 4, fit_pool=True)
        assert got.num_blocks == 2 and allocator.num_free_blocks == 0
        refs = [SlotRef.from_location(row) for row in where.rows()[:2]]
        expected = [bytes(b) for b in await store.read_blocks(refs)]
        assert [pool.block_to_bytes(p) for p in got.pages] == expected
        allocator.free(got.pages)
        allocator.allocate(2)  # none free: an empty prefix, not an error
        empty = await take_prefix(store, pool, allocator, where, chain, 4, fit_pool=True)
        assert empty.num_blocks == 0
    finally:
        store.close()
