"""The offline replay's caches: kv-index's own `KvIndex` fed the `BlocksStored` batches the
workers would publish, and the map of which nodes hold a boundary's sliding-window snapshot.

Only KvIndex's public surface is used (constructor, apply, match, evict), so the replay runs
whatever the index's internals are. One index per cache: a prefill worker's own cache, or
the one store every worker reads (kvfabric's SSD tier, `shared=True`).

Capacity: a block counts 1 "byte", so `capacity_bytes` is a count of blocks. The high
watermark is 1.0: once a store takes a cache past its capacity, `evict` drops the least
recently used blocks down to the low watermark (90%) in one sweep, as kv-index sweeps from
its high watermark to its low one. Evicting to exactly the capacity would call `evict`, a
pass over the whole table (0.4 ms at 100K blocks, measured), on nearly every one of a
replay's 24K stores once the caches are full.
The TTL (`ttl_s`) is set longer than the replay, so only capacity evicts, and no longer than
that: the index keeps access times to a resolution of ttl/16384 (LRU ties within one go by
row order), 5.3 s at its default day, under 0.1 s for a replay of ten minutes.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.kv_index.index import KvIndex
from shared.schema import BlocksStored, KvEventBatch, StoredBlock

TIER = "ssd"
UNLIMITED_BLOCKS = 1 << 62
LOW_WATERMARK = 0.9


class BlockCache:
    """One cache of `capacity_blocks` blocks (None: unlimited), behind a KvIndex."""

    def __init__(self, capacity_blocks: int | None, ttl_s: float) -> None:
        if capacity_blocks is not None and capacity_blocks <= 0:
            raise ValueError(f"capacity_blocks must be > 0, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks or UNLIMITED_BLOCKS
        self.index = KvIndex(
            {TIER: self.capacity_blocks},
            ttl_s=ttl_s,
            high_watermark=1.0,
            low_watermark=LOW_WATERMARK,
        )
        self._seq: dict[str, int] = {}
        # An upper bound on the blocks the index holds (a store may repeat some): counted so
        # that `evict`, a scan of the whole table, runs only when it may be past capacity.
        self._num_blocks_at_most = 0
        self.num_blocks_evicted = 0

    def num_hit_blocks(self, hashes: Sequence[int], now_s: float, *, refresh: bool) -> int:
        """The longest cached prefix of `hashes`, in blocks; `refresh` marks it used."""
        if not hashes:
            return 0
        results = self.index.match(list(hashes), now_s, refresh=refresh)
        return next(r.first_miss_index for r in results if r.tier == TIER)

    def store(self, writer_id: str, hashes: Sequence[int], now_s: float) -> None:
        """What `writer_id` publishes after computing `hashes`: one BlocksStored batch, next
        in its sequence; then eviction if the cache may have passed its capacity."""
        if not hashes:
            return
        seq = self._seq[writer_id] = self._seq.get(writer_id, 0) + 1
        blocks = tuple(StoredBlock(h, 0, slot, 0, 1) for slot, h in enumerate(hashes))
        batch = KvEventBatch(
            writer_id=writer_id,
            seq=seq,
            ts_ms=round(now_s * 1000),
            events=(BlocksStored(tier=TIER, blocks=blocks),),
        )
        self.index.apply(batch, now_s)
        self._num_blocks_at_most += len(hashes)
        if self._num_blocks_at_most > self.capacity_blocks:
            removed = sum(len(r.block_hashes) for r in self.index.evict(now_s))
            self.num_blocks_evicted += removed
            # After a sweep it holds at most the low watermark; with none, at most capacity.
            low = int(LOW_WATERMARK * self.capacity_blocks)
            self._num_blocks_at_most = low if removed else self.capacity_blocks


class Caches:
    """The caches of one replay: one per prefill worker, or one shared by all."""

    def __init__(
        self,
        worker_ids: Sequence[str],
        capacity_blocks: int | None,
        ttl_s: float,
        *,
        shared: bool,
    ) -> None:
        if shared:
            one = BlockCache(capacity_blocks, ttl_s)
            self._by_worker = dict.fromkeys(worker_ids, one)
        else:
            self._by_worker = {w: BlockCache(capacity_blocks, ttl_s) for w in worker_ids}

    def of(self, worker_id: str) -> BlockCache:
        return self._by_worker[worker_id]

    def best_hit_blocks(self, hashes: Sequence[int], now_s: float) -> int:
        """The longest prefix any cache holds (what kv-index's match over every writer's
        blocks reports), without refreshing anything."""
        caches = {id(c): c for c in self._by_worker.values()}.values()
        return max(c.num_hit_blocks(hashes, now_s, refresh=False) for c in caches)

    @property
    def num_blocks_evicted(self) -> int:
        caches = {id(c): c for c in self._by_worker.values()}.values()
        return sum(c.num_blocks_evicted for c in caches)


class WindowMap:
    """Which nodes hold the sliding-window snapshot at a block boundary: a prefill worker
    puts one into its node's swa-memcache at its prompt's last computed block, kept there
    `ttl_s` (the memcache's 180 s). What the router learns from the memcaches' events."""

    def __init__(self, ttl_s: float = 180.0) -> None:
        self.ttl_s = ttl_s
        self._put_s: dict[int, dict[str, float]] = {}

    def put(self, boundary_hash: int, node_id: str, now_s: float) -> None:
        self._put_s.setdefault(boundary_hash, {})[node_id] = now_s

    def holders(self, boundary_hash: int | None, now_s: float) -> frozenset[str]:
        if boundary_hash is None:
            return frozenset()
        nodes = self._put_s.get(boundary_hash, {})
        return frozenset(n for n, put_s in nodes.items() if now_s - put_s <= self.ttl_s)
