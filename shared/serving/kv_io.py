"""KV pages between a worker's pool, the SSD store and its NIXL staging buffer.

A page of the pool and a block of the store hold the same bytes (KVBlockLayout: block-major,
full-attention layers only), so every move here is one copy per block, never a re-layout.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from shared.config import EngineWorkerConfig
from shared.kvstore.hashing import BlockHasher
from shared.kvstore.slots import SlotRef
from shared.kvstore.store import KvStore, KvStoreConfig
from shared.kvstore.writer import KvEventPublisher
from shared.schema.inference import BlockLocations, GenerateRequest
from shared.schema.tokens import unpack_block_hashes

if TYPE_CHECKING:  # shared.engine imports torch; the mock workers (no torch) use this module
    from shared.engine.block_manager import BlockAllocator
    from shared.engine.kv_cache import PagedKVPool


@dataclass(frozen=True)
class LoadedPrefix:
    pages: list[int]  # pool pages holding blocks 0..len(pages)-1 of the prompt

    @property
    def num_blocks(self) -> int:
        return len(self.pages)


@dataclass
class BlockChain:
    """One sequence's chained block hashes, computed once and extended as it grows.

    A prompt of 77K tokens is 1,200 hashes; a worker needs them to restore the prefix, to
    name the blocks it writes and to key its window snapshot, and the router has already
    checked the ones the request carries -- so they are taken from the request, not hashed
    again at every step. The answer's blocks continue the chain from the prompt's last.
    """

    hasher: BlockHasher
    hashes: list[int]

    @classmethod
    def for_prompt(cls, request: GenerateRequest, token_ids: list[int]) -> BlockChain:
        """The request's hashes as the router checked and forwarded them; computed when a
        job comes without them (namespace: model, block size, tenant salt)."""
        hasher = BlockHasher(
            model_id=request.model,
            block_size_tokens=request.block_size_tokens,
            salt=request.cache_salt,
        )
        carried = unpack_block_hashes(request.block_hashes).tolist()
        if len(carried) == hasher.num_blocks(len(token_ids)):
            return cls(hasher, carried)
        return cls(hasher, hasher.hashes(token_ids))

    def upto(self, token_ids: list[int], num_blocks: int) -> list[int]:
        """Hashes of blocks 0..num_blocks-1 of `token_ids` (which extend the tokens hashed
        so far), hashing only the blocks not seen yet."""
        have = len(self.hashes)
        if num_blocks > have:
            size = self.hasher.block_size_tokens
            parent = self.hashes[-1] if have else 0
            new = token_ids[have * size : num_blocks * size]
            self.hashes += self.hasher.hashes(new, parent_hash=parent)
        return self.hashes[:num_blocks]


async def load_prefix(
    store: KvStore,
    pool: PagedKVPool,
    allocator: BlockAllocator,
    locations: BlockLocations,
    num_blocks: int,
) -> LoadedPrefix:
    """Read the first `num_blocks` cached blocks into freshly allocated pages.

    A block that reads as a miss (evicted, torn, corrupt) ends the prefix there: the pages
    after it are freed and the caller computes from that block on.
    """
    num_blocks = min(num_blocks, len(locations))
    if num_blocks == 0:
        return LoadedPrefix([])
    refs = [SlotRef.from_location(row) for row in locations.rows()[:num_blocks]]
    pages = allocator.allocate(num_blocks)
    try:
        results = await store.read_blocks(refs, [memoryview(pool.block_view(p)) for p in pages])
    except BaseException:
        allocator.free(pages)
        raise
    num_loaded = next((i for i, r in enumerate(results) if r is None), num_blocks)
    allocator.free(pages[num_loaded:])
    return LoadedPrefix(pages[:num_loaded])


async def store_blocks(
    publisher: KvEventPublisher,
    pool: PagedKVPool,
    pages: list[int],
    token_ids: list[int],
    chain: BlockChain,
    first_block: int,
    end_block: int,
) -> int:
    """Write blocks [first_block, end_block) of a sequence (page i holds block i) to the store
    and log them for kv-index; returns how many were written."""
    payloads = [memoryview(pool.block_view(pages[i])) for i in range(first_block, end_block)]
    return await store_payloads(publisher, token_ids, chain, first_block, payloads)


async def store_payloads(
    publisher: KvEventPublisher,
    token_ids: list[int],
    chain: BlockChain,
    first_block: int,
    payloads: Sequence[bytes | memoryview],
) -> int:
    """Write `payloads` as blocks first_block, first_block + 1, ... of `token_ids` and log
    them for kv-index; returns how many were written. (The mock engine's blocks have no
    pool pages: their payloads are placeholder bytes.)"""
    if not payloads:
        return 0
    end_block = first_block + len(payloads)
    hashes = chain.upto(token_ids, end_block)
    blocks = list(zip(hashes[first_block:end_block], payloads, strict=True))
    parent = hashes[first_block - 1] if first_block > 0 else None
    stored = await publisher.store_blocks(blocks, parent_block_hash=parent)
    return sum(b is not None for b in stored)


def stage_pages(pool: PagedKVPool, pages: list[int], buffer: np.ndarray, offset: int) -> int:
    """Copy pages, in order, into `buffer` at `offset`; returns the bytes written."""
    nbytes = pool.layout.block_nbytes
    for i, page in enumerate(pages):
        start = offset + i * nbytes
        buffer[start : start + nbytes] = pool.block_view(page)
    return len(pages) * nbytes


def unstage_pages(buffer: np.ndarray, offset: int, pool: PagedKVPool, pages: list[int]) -> None:
    nbytes = pool.layout.block_nbytes
    for i, page in enumerate(pages):
        start = offset + i * nbytes
        pool.block_view(page)[:] = buffer[start : start + nbytes]


async def open_store(config: EngineWorkerConfig, writer_id: str, payload_nbytes: int) -> KvStore:
    """The worker's store (blocking scan of its own files at open: off the event loop)."""
    store_config = KvStoreConfig(
        root_dir=config.store_dir,
        writer_id=writer_id,
        payload_nbytes=payload_nbytes,
        capacity_bytes=config.store_capacity_bytes,
        file_nbytes=config.store_file_nbytes,
        backend=config.store_backend,
    )
    config.store_dir.mkdir(parents=True, exist_ok=True)
    return await asyncio.to_thread(KvStore.open, store_config)
