"""Asking kv-index: a match fans out to every shard and the answers merge into, per tier, the
longest cached prefix of the request and the location of each of its blocks.

Each shard answers for the positions whose hash it owns (hash % num_shards): where its first
owned miss is, and its owned hits before that. The prefix ends at the earliest miss any shard
reports; every position before it is owned by exactly one shard that reported it as a hit.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import numpy as np

from shared.bus import Bus
from shared.schema import InternalError, pack_block_hashes, pack_token_ids, unpack_token_ids
from shared.schema.inference import BlockLocations, Eviction
from shared.schema.kv_index import MatchReply, MatchRequest, TierMatch


@dataclass(frozen=True)
class PrefixMatch:
    tier: str
    num_blocks: int
    locations: BlockLocations  # one row per block of the prefix, in order
    evicted: Eviction | None = None  # the tombstone of the block after the prefix, if any


def to_wire(
    tier: str,
    first_miss_index: int,
    indices: list[int],
    locations: BlockLocations,
    evicted: Eviction | None = None,
) -> TierMatch:
    return TierMatch(
        tier=tier,
        first_miss_index=first_miss_index,
        indices=pack_token_ids(indices),
        locations=locations,
        evicted=evicted,
    )


def first_miss_eviction(matches: dict[str, PrefixMatch]) -> Eviction | None:
    """Why the longest prefix of any tier ends where it does, if that block was evicted:
    the latest tombstone among the tiers whose prefix is that long."""
    if not matches:
        return None
    longest = max(m.num_blocks for m in matches.values())
    found = [m.evicted for m in matches.values() if m.num_blocks == longest and m.evicted]
    return max(found, key=lambda e: e.evicted_ms) if found else None


def merge(replies: list[MatchReply], num_blocks: int) -> dict[str, PrefixMatch]:
    shards = {r.shard_id for r in replies}
    num_shards = replies[0].num_shards if replies else 1
    if shards != set(range(num_shards)):
        raise InternalError(f"match answered by shards {sorted(shards)} of {num_shards}")
    by_tier: dict[str, list[TierMatch]] = {}
    for reply in replies:
        for tier_match in reply.tiers:
            by_tier.setdefault(tier_match.tier, []).append(tier_match)
    merged = {}
    for tier, parts in by_tier.items():
        # A shard that never heard of the tier owns no hit in it: the prefix is empty there.
        prefix = 0 if len(parts) < num_shards else min(p.first_miss_index for p in parts)
        prefix = min(prefix, num_blocks)
        writer_ids: list[str] = []
        indices, columns = [], []
        for part in parts:
            part_columns = part.locations.columns()
            # Renumber each part's writers into one list for the merged prefix.
            offset = len(writer_ids)
            writer_ids += part.locations.writer_ids
            part_columns["writer"] = part_columns["writer"].astype(np.int64) + offset
            indices.append(unpack_token_ids(part.indices).astype(np.int64))
            columns.append(part_columns)
        position = np.concatenate(indices) if indices else np.zeros(0, np.int64)
        keep = np.flatnonzero(position < prefix)
        order = keep[np.argsort(position[keep], kind="stable")]
        if not np.array_equal(position[order], np.arange(prefix)):
            raise InternalError(f"tier {tier}: shards' hits do not cover a {prefix}-block prefix")
        merged_columns = {
            name: np.concatenate([c[name] for c in columns])[order] for name in columns[0]
        }
        used, merged_columns["writer"] = np.unique(merged_columns["writer"], return_inverse=True)
        # The shard owning the block after the prefix says whether it was evicted.
        evicted = next(
            (p.evicted for p in parts if p.first_miss_index == prefix and p.evicted), None
        )
        merged[tier] = PrefixMatch(
            tier,
            prefix,
            BlockLocations.from_columns(
                tier, tuple(writer_ids[w] for w in used.tolist()), merged_columns
            ),
            evicted if prefix < num_blocks else None,
        )
    return merged


@dataclass(frozen=True)
class MemoryHit:
    """A worker's own hit: the request's leading blocks its memory holds (KV pool or host
    tier), and of those the leading ones in its pool."""

    num_blocks: int
    num_device_blocks: int


def merge_holders(replies: list[MatchReply], num_blocks: int) -> dict[str, MemoryHit]:
    """Each worker's own hit, from every shard's part: a worker's prefix ends at the first
    miss any shard reports for it, and a shard that does not name it reports its own first
    owned block. Workers whose hit is empty are left out."""
    parts = [{h.holder: h for h in reply.holders} for reply in replies]
    hits = {}
    for name in {name for named in parts for name in named}:
        memory, device = num_blocks, num_blocks
        for reply, named in zip(replies, parts, strict=True):
            part = named.get(name)
            if part is None:
                memory = min(memory, reply.first_owned_index)
                device = min(device, reply.first_owned_index)
            else:
                memory = min(memory, part.first_miss_index)
                device = min(device, part.first_device_miss_index)
        if memory:
            hits[name] = MemoryHit(memory, min(device, memory))
    return hits


async def match(
    bus: Bus,
    block_hashes: list[int] | bytes,
    *,
    num_shards: int,
    timeout_s: float = 1.0,
    refresh: bool = True,
) -> dict[str, PrefixMatch]:
    """Longest cached prefix per tier, asking every shard concurrently. `block_hashes` may
    come packed (u64, as a request carries them): the router sends them on as they came."""
    tiers, _ = await match_with_holders(
        bus, block_hashes, num_shards=num_shards, timeout_s=timeout_s, refresh=refresh
    )
    return tiers


async def match_with_holders(
    bus: Bus,
    block_hashes: list[int] | bytes,
    *,
    num_shards: int,
    timeout_s: float = 1.0,
    refresh: bool = True,
) -> tuple[dict[str, PrefixMatch], dict[str, MemoryHit]]:
    """`match`, and each worker's own hit in its memory (`merge_holders`), in one query."""
    if not block_hashes:
        return {}, {}
    packed = block_hashes if isinstance(block_hashes, bytes) else pack_block_hashes(block_hashes)
    request = MatchRequest(block_hashes=packed, refresh=refresh)
    replies = await asyncio.gather(
        *(
            bus.request(
                bus.subjects.kv_index_match_shard(shard), request, MatchReply, timeout_s=timeout_s
            )
            for shard in range(num_shards)
        )
    )
    num_blocks = len(packed) // 8
    return merge(list(replies), num_blocks), merge_holders(list(replies), num_blocks)
