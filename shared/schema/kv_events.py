"""KV cache events: writers (prefill, decode) tell kv-index what they stored or removed.

Batches carry a per-writer sequence number; kv-index detects a gap and resyncs that writer.
"""

from __future__ import annotations

import msgspec

from shared.schema.base import Message


class StoredBlock(msgspec.Struct, frozen=True, array_like=True):
    block_hash: int
    file_id: int
    slot: int
    generation: int
    num_bytes: int


class BlocksStored(Message, tag="blocks_stored"):
    tier: str
    blocks: tuple[StoredBlock, ...]
    parent_block_hash: int | None = None


class BlocksRemoved(Message, tag="blocks_removed"):
    tier: str
    block_hashes: bytes  # packed u64
    # kv-index's notice to the writer says why it evicted them (ttl, capacity, admin); the
    # writer logs it on, so every replica's tombstones say so too ("": the writer's own).
    reason: str = ""


class AllBlocksCleared(Message, tag="all_blocks_cleared"):
    tier: str


class BlocksPinned(Message, tag="blocks_pinned"):
    """A request's pinned prefix (a `cache_control` breakpoint, docs/ingress.md): kv-index
    evicts none of these blocks before `until_ms` (a later pin of one extends it)."""

    tier: str
    block_hashes: bytes  # packed u64
    until_ms: int


KvEvent = BlocksStored | BlocksRemoved | AllBlocksCleared | BlocksPinned


class KvEventBatch(Message, tag="kv_event_batch"):
    writer_id: str
    seq: int
    ts_ms: int
    events: tuple[KvEvent, ...]
