"""KV pages between a model worker's pool, the SSD store and its NIXL staging buffer.

A page of the pool and a block of the store hold the same bytes (KVBlockLayout: block-major,
full-attention layers only), so every move here is one copy per block, never a re-layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from shared import telemetry
from shared.blocks import RequestBlocks
from shared.schema.inference import BlockLocations
from worker.engine.block_allocator import BlockAllocator
from worker.engine.errors import OutOfBlocksError
from worker.engine.host_tier import HostTier
from worker.engine.kv_cache import PagedKVPool
from worker.kvstore.slots import SlotRef
from worker.kvstore.store import KvStore
from worker.kvstore.writer import KvEventPublisher
from worker.serving.kv_io import store_payloads


@dataclass(frozen=True)
class LoadedPrefix:
    pages: list[int]  # pool pages holding blocks 0..len(pages)-1 of the prompt
    num_local: int = 0  # of them, found in the pool (not read from the store)
    num_host: int = 0  # copied back from the host-memory tier

    @property
    def num_blocks(self) -> int:
        return len(self.pages)


async def load_prefix(
    store: KvStore,
    pool: PagedKVPool,
    allocator: BlockAllocator,
    locations: BlockLocations,
    num_blocks: int,
    first_block: int = 0,
    *,
    fit_pool: bool = False,
) -> LoadedPrefix:
    """Read cached blocks `first_block`..`num_blocks - 1` into freshly allocated pages (the
    caller holds the ones before: the pool's own, `BlockAllocator.revive`).

    A block that reads as a miss (evicted, torn, corrupt) ends the prefix there: the pages
    after it are freed and the caller computes from that block on. `fit_pool`: a pool with
    fewer free pages than the read needs ends the prefix where they run out (the caller
    computes the rest once the scheduler has pages), instead of raising OutOfBlocksError.
    """
    num_blocks = min(num_blocks, len(locations)) - first_block
    pages = _allocate(allocator, num_blocks, fit_pool)
    num_blocks = len(pages)
    if num_blocks <= 0:
        return LoadedPrefix([])
    rows = locations.rows()[first_block : first_block + num_blocks]
    refs = [SlotRef.from_location(row) for row in rows]
    try:
        results = await store.read_blocks(refs, [memoryview(pool.block_view(p)) for p in pages])
    except BaseException:
        allocator.free(pages)
        raise
    num_loaded = next((i for i, r in enumerate(results) if r is None), num_blocks)
    allocator.free(pages[num_loaded:])
    return LoadedPrefix(pages[:num_loaded])


def _allocate(allocator: BlockAllocator, num_blocks: int, fit_pool: bool) -> list[int]:
    if num_blocks <= 0:
        return []
    if not fit_pool:
        return allocator.allocate(num_blocks)
    # The model thread reserves pages too: what was free a moment ago may not be now.
    while (num_fit := min(num_blocks, allocator.num_free_blocks)) > 0:
        try:
            return allocator.allocate(num_fit)
        except OutOfBlocksError:
            continue
    return []


async def take_prefix(
    store: KvStore,
    pool: PagedKVPool,
    allocator: BlockAllocator,
    locations: BlockLocations,
    block_hashes: Sequence[int],
    num_blocks: int,
    host: HostTier | None = None,
    *,
    fit_pool: bool = False,
) -> LoadedPrefix:
    """The first `num_blocks` cached blocks (fewer after a store miss, or with `fit_pool`
    where the pool's free pages run out): the leading ones the pool still holds from an
    earlier request (tagged with `tag_blocks`) or the host-memory tier kept, the rest read
    from the store (`load_prefix`). Recorded on the current span (the caller's load span)."""
    if num_blocks == 0:
        return LoadedPrefix([])
    # Every block of the prefix the pool still holds, pinned first: filling a gap from the
    # host tier takes free pages, and must not take those (an earlier turn's oldest blocks
    # are handed out first, so the pool and the host tier alternate along a prefix).
    hashes = list(block_hashes[:num_blocks])
    found: list[int | None] = []
    found += allocator.pin(hashes) if host is not None else allocator.revive(hashes)
    held: list[int] = []
    num_local = num_host = 0
    for i, page in enumerate(found):
        if page is None:  # only with a host tier: `revive` stops at the first gap
            kept = host.restore(allocator, [hashes[i]]) if host is not None else []
            if not kept:
                allocator.free([p for p in found[i + 1 :] if p is not None])
                break
            page, num_host = kept[0], num_host + 1
        else:
            num_local += 1
        held.append(page)
    try:
        rest = await load_prefix(
            store, pool, allocator, locations, num_blocks, len(held), fit_pool=fit_pool
        )
    except BaseException:
        allocator.free(held)
        raise
    span = telemetry.current_span()
    if span.is_recording():
        span.set_attributes(
            {
                "kvfabric.tier": locations.tier,
                "kvfabric.num_blocks": rest.num_blocks,
                "kvfabric.bytes": rest.num_blocks * pool.layout.block_nbytes,
                "kvfabric.num_local_blocks": num_local,
                "kvfabric.num_host_blocks": num_host,
            }
        )
    return LoadedPrefix(held + rest.pages, num_local=num_local, num_host=num_host)


def tag_blocks(
    allocator: BlockAllocator, pages: Sequence[int], block_hashes: Sequence[int]
) -> None:
    """Name pages[i] by block_hashes[i] (complete blocks only), so that `take_prefix` finds
    them in the pool until their pages are handed out again."""
    for page, block_hash in zip(pages, block_hashes, strict=False):
        allocator.tag(page, block_hash)


async def store_blocks(
    publisher: KvEventPublisher,
    pool: PagedKVPool,
    pages: Sequence[int],
    token_ids: Sequence[int],
    blocks: RequestBlocks,
    first_block: int,
    end_block: int,
) -> int:
    """Write blocks [first_block, end_block) of a sequence (page i holds block i) to the store
    and log them for kv-index; returns how many were written."""
    payloads = [memoryview(pool.block_view(pages[i])) for i in range(first_block, end_block)]
    return await store_payloads(publisher, token_ids, blocks, first_block, payloads)


def stage_pages(pool: PagedKVPool, pages: Sequence[int], buffer: np.ndarray, offset: int) -> int:
    """Copy pages, in order, into `buffer` at `offset`; returns the bytes written."""
    nbytes = pool.layout.block_nbytes
    for i, page in enumerate(pages):
        start = offset + i * nbytes
        buffer[start : start + nbytes] = pool.block_view(page)
    return len(pages) * nbytes


def unstage_pages(buffer: np.ndarray, offset: int, pool: PagedKVPool, pages: Sequence[int]) -> None:
    nbytes = pool.layout.block_nbytes
    for i, page in enumerate(pages):
        start = offset + i * nbytes
        pool.block_view(page)[:] = buffer[start : start + nbytes]
