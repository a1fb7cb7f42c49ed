from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from services.kv_index.index import DAY_S
from shared.config import ConfigError, ServiceConfig

GIB = 1 << 30
MIB = 1 << 20


@dataclass(frozen=True, kw_only=True)
class KvIndexConfig(ServiceConfig):
    """Environment prefix KVF_KV_INDEX_; the fields every service has are in ServiceConfig."""

    env_prefix: ClassVar[str] = "KVF_KV_INDEX_"

    # This shard's number, in [0, num_shards): it owns the block hashes with
    # hash % num_shards == shard_id.
    shard_id: int = 0
    # Shards of the index; the same in every shard and in the router's (and vLLM
    # workers') kv_index_shards.
    num_shards: int = 1
    # Capacity per tier, "tier=bytes" pairs: the SSD tier's share indexed by this shard.
    capacity: tuple[str, ...] = (f"ssd={100 * GIB}", f"dram={8 * GIB}")
    # Seconds a block stays indexed without being stored or matched before it expires.
    ttl_s: float = DAY_S
    # A tier filled past this fraction of its capacity is evicted, least recently used
    # first, down to low_watermark (0 < low_watermark < high_watermark <= 1).
    high_watermark: float = 0.9
    # The fraction of a tier's capacity an eviction brings it down to.
    low_watermark: float = 0.8
    # Seconds between eviction sweeps (expiry and watermarks); writers are told what left.
    evict_interval_s: float = 5.0
    # Seconds between snapshots of this shard's index (and one at stop), for restarts.
    snapshot_interval_s: float = 60.0
    # The event log (JetStream) keeps at most this much: snapshots cover what it dropped.
    log_max_bytes: int = 1 * GIB
    # A restart replays an uncut log up to this size instead of loading the snapshot (the
    # entries' last use is then their last store, not their last hit: LRU order is coarser).
    replay_whole_log_bytes: int = 256 * MIB
    # Seconds the event log keeps an entry; snapshots cover what it dropped.
    log_max_age_s: float = DAY_S
    # How long start-up waits for the event log to be replayed before serving anyway, and
    # reporting itself not ready until it has caught up (0: do not wait).
    catch_up_timeout_s: float = 60.0
    # Seconds a worker's own-memory holdings are kept without an update from it (workers
    # send one at least every second): a worker gone is forgotten after this.
    holder_ttl_s: float = 5.0
    # Evicted blocks remembered (hash -> tier, why, when, idle how long), 22 bytes each
    # (services/kv_index/tombstones.py), so a later miss is told it was evicted.
    tombstones: int = 1 << 20

    def capacity_bytes(self) -> dict[str, int]:
        result = {}
        for item in self.capacity:
            tier, sep, value = item.partition("=")
            if not sep or not value.strip().isdigit():
                raise ConfigError(f"capacity item {item!r} must be tier=bytes")
            result[tier.strip()] = int(value)
        return result

    def validate(self) -> None:
        super().validate()
        if not 0 <= self.shard_id < self.num_shards:
            raise ConfigError(
                f"shard_id {self.shard_id} must be in [0, num_shards={self.num_shards})"
            )
        if not 0 < self.low_watermark < self.high_watermark <= 1:
            raise ConfigError("watermarks must satisfy 0 < low_watermark < high_watermark <= 1")
        for name in (
            "ttl_s",
            "evict_interval_s",
            "snapshot_interval_s",
            "log_max_age_s",
            "holder_ttl_s",
            "tombstones",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0")
        if self.catch_up_timeout_s < 0:
            raise ConfigError("catch_up_timeout_s must be >= 0")
        self.capacity_bytes()
