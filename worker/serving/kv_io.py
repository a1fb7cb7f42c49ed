"""A worker's KV writes to the SSD store: the store itself, and blocks written under the
request's chain and logged for kv-index.
Moving pages between the model's pool, the store and NIXL staging is `pages.py`."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from shared.blocks import RequestBlocks
from shared.config import EngineWorkerConfig
from worker.kvstore.store import KvStore, KvStoreConfig
from worker.kvstore.writer import KvEventPublisher


async def store_payloads(
    publisher: KvEventPublisher,
    token_ids: Sequence[int],
    blocks: RequestBlocks,
    first_block: int,
    payloads: Sequence[bytes | memoryview],
) -> int:
    """Write `payloads` as blocks first_block, first_block + 1, ... of `token_ids` (the
    prompt, and the answer after it) and log them for kv-index; returns how many were
    written."""
    if not payloads:
        return 0
    end_block = first_block + len(payloads)
    hashes = blocks.extend(token_ids, end_block)
    pairs = list(zip(hashes[first_block:end_block], payloads, strict=True))
    parent = hashes[first_block - 1] if first_block > 0 else None
    stored = await publisher.store_blocks(pairs, parent_block_hash=parent)
    return sum(b is not None for b in stored)


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
