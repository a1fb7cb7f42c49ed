"""kv-index requests: prefix match (fanned out over shards), resync, cache administration."""

from __future__ import annotations

import msgspec

from shared.schema.base import Message
from shared.schema.inference import BlockLocations
from shared.schema.kv_events import StoredBlock


class MatchRequest(Message, tag="match_request"):
    block_hashes: bytes  # packed u64, the request's chain in order
    refresh: bool = True  # a read refreshes LRU recency (a re-read prefix must not age out)


class TierMatch(msgspec.Struct, frozen=True, kw_only=True):
    """One shard's view of one tier: the first of the request's blocks that this shard owns
    and lacks (len(request) if none), and the locations of its owned hits before that."""

    tier: str
    first_miss_index: int
    indices: bytes = b""  # packed u32: positions in the request of the `locations` rows
    locations: BlockLocations = BlockLocations()


class MatchReply(Message, tag="match_reply"):
    shard_id: int
    num_shards: int
    tiers: tuple[TierMatch, ...] = ()


class ResyncRequest(Message, tag="resync_request"):
    """kv-index -> a writer whose event sequence jumped: send your whole state again."""

    writer_id: str
    expected_seq: int
    received_seq: int


class CacheCommand(Message, tag="cache_command"):
    """`kvfabric cache stats|evict|flush`: `evict` drops `fraction` of each tier (LRU first)."""

    action: str  # stats | evict | flush
    tier: str = ""  # "": every tier
    fraction: float = 0.0


class CacheStats(Message, tag="cache_stats"):
    shard_id: int
    instance_id: str
    tiers: dict[str, dict[str, int]] = {}
    counters: dict[str, int] = {}


class RebuildBatch(Message, tag="rebuild_batch"):
    """`kvfabric cache rebuild`: blocks found in one writer's slot headers, for an index whose
    event log is lost. Indexed as that writer's; its event sequence is left alone."""

    tier: str
    writer_id: str
    blocks: tuple[StoredBlock, ...]
    is_last: bool = False  # the index snapshots its state after the last batch


class RebuildReply(Message, tag="rebuild_reply"):
    num_indexed: int
