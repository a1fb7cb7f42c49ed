"""kv-index requests: prefix match (fanned out over shards), resync, cache administration."""

from __future__ import annotations

import msgspec

from shared.schema.base import Message
from shared.schema.inference import BlockLocations, Eviction
from shared.schema.kv_events import StoredBlock

HOLD_DEVICE = 1  # HoldingsUpdate.masks: in the worker's KV pool
HOLD_HOST = 2  # in its host-memory tier
_MASK64 = (1 << 64) - 1


def digest_share(block_hash: int, mask: int) -> int:
    """One holding's share of a `HoldingsUpdate` digest: the shares XORed together, so the
    order never matters and a change is two XORs."""
    return (block_hash ^ (mask * 0x9E3779B97F4A7C15)) & _MASK64


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
    evicted: Eviction | None = None  # the first miss's tombstone, if this shard evicted it


class HolderMatch(msgspec.Struct, frozen=True, kw_only=True):
    """One shard's view of one worker's own memory: the first of the request's blocks that
    this shard owns and the worker holds neither in its device pool nor in its host tier,
    and the first it does not hold in its device pool."""

    holder: str
    first_miss_index: int
    first_device_miss_index: int


class MatchReply(Message, tag="match_reply"):
    shard_id: int
    num_shards: int
    tiers: tuple[TierMatch, ...] = ()
    # The first of the request's blocks this shard owns (len(request) if none): a worker
    # `holders` does not name lacks it, so its own hit ends there on this shard.
    first_owned_index: int = 0
    holders: tuple[HolderMatch, ...] = ()


class HoldingsUpdate(Message, tag="holdings_update"):
    """A prefill or decode worker -> kv-index (core NATS): the blocks its own memory holds,
    as changes since its previous update, or whole (`full`, answering `HoldingsSync`).

    `masks[i]` says where `block_hashes[i]` is now: HOLD_DEVICE (the KV pool), HOLD_HOST
    (the host tier), both, or 0 (gone). Updates are numbered per `epoch` (one per process):
    a shard that sees a gap asks for the whole set again. `digests[n][k]` is (count, digest)
    of the holdings whose hash % n == k, for each shard count n a shard asked about: a shard
    whose own count and digest differ after an update asks again too. `final`: the worker
    is stopping, forget it."""

    holder: str
    epoch: int
    seq: int
    block_hashes: bytes = b""  # packed u64
    masks: bytes = b""  # one byte per hash
    full: bool = False
    digests: dict[int, list[tuple[int, int]]] = {}
    final: bool = False


class HoldingsSync(Message, tag="holdings_sync"):
    """kv-index shard -> a worker: send me the holdings this shard owns (hash % num_shards
    == shard_id), whole; and their digest in every update from now on."""

    shard_id: int
    num_shards: int


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
