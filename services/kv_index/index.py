"""The kv-index core: metadata of every cached block, by tier, for the hashes this shard owns.

Pure and synchronous (no NATS, no asyncio): handlers.py feeds it events and questions.

- `apply(batch)`: a writer's `KvEventBatch`. Per-writer sequence numbers: a repeat (JetStream
  redelivery, replay after restart) is ignored, a jump is a gap, reported so the service asks
  that writer to resync (its reply starts with AllBlocksCleared, so applying it is safe).
- `match(hashes)`: per tier, this shard's part of the longest cached prefix (see
  `shared.kv_index_client` for the merge across shards); a read refreshes recency.
- `evict(now)`: TTL first, then LRU from the high watermark down to the low one, per tier.
  Returns what was dropped, for the service to publish as BlocksRemoved (writers reuse slots).
- `BlocksPinned` (a request's `cache_control` prefix, logged by the writer that stored it):
  those blocks are kept out of TTL and watermark eviction until the pin's end (a later pin
  extends it); an admin's evict or flush drops them all the same. Pins are kept per hash
  (a dict entry, ~100 bytes each: pins are bounded by what accounts may pin), dropped with
  their block or when they end, and saved in snapshots.
- Every block that leaves a tier leaves a tombstone (tombstones.py: tier, why, when, idle
  how long), and a match names the tombstone of each tier's first miss, so a turn that
  misses what an earlier one stored can be told it was evicted.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import msgspec
import numpy as np

from services.kv_index.table import DAY_S, TierTable
from services.kv_index.tombstones import DEFAULT_CAPACITY, Tombstones
from shared.schema import (
    AllBlocksCleared,
    BlocksPinned,
    BlocksRemoved,
    BlocksStored,
    KvEventBatch,
    StoredBlock,
)
from shared.schema.inference import BlockLocations, Eviction
from shared.schema.tokens import unpack_block_hashes


@dataclass(frozen=True)
class Gap:
    writer_id: str
    expected_seq: int
    received_seq: int


@dataclass(frozen=True)
class Removal:
    tier: str
    writer_id: str
    block_hashes: list[int]
    reason: str = ""  # ttl | capacity | admin


@dataclass(frozen=True)
class TierResult:
    tier: str
    first_miss_index: int  # among the request's positions this shard owns; len(request) if none
    indices: list[int]  # request positions of the `locations` rows
    locations: BlockLocations
    evicted: Eviction | None = None  # the first miss's tombstone, if it has one


@dataclass
class Counters:
    num_batches: int = 0
    num_duplicate_batches: int = 0
    num_gaps: int = 0
    num_bad_batches: int = 0  # malformed or not applicable: their writer was asked to resync
    num_blocks_stored: int = 0
    num_blocks_removed: int = 0
    num_matches: int = 0
    num_blocks_matched: int = 0
    num_evicted_ttl: int = 0
    num_evicted_capacity: int = 0
    num_kept_pinned: int = 0  # blocks an eviction would have taken but a pin kept


@dataclass
class KvIndex:
    capacity_bytes: Mapping[str, int]
    shard_id: int = 0
    num_shards: int = 1
    ttl_s: float = DAY_S
    high_watermark: float = 0.9
    low_watermark: float = 0.8
    writer_ids: list[str] = field(default_factory=list)
    writer_seq: dict[str, int] = field(default_factory=dict)
    tables: dict[str, TierTable] = field(default_factory=dict)
    counters: Counters = field(default_factory=Counters)
    tombstone_capacity: int = DEFAULT_CAPACITY
    pins: dict[int, float] = field(default_factory=dict)  # hash -> pinned until (epoch s)

    def __post_init__(self) -> None:
        if not 0 <= self.shard_id < self.num_shards:
            raise ValueError(f"shard_id {self.shard_id} outside [0, {self.num_shards})")
        if not 0 < self.low_watermark < self.high_watermark <= 1:
            raise ValueError("watermarks must satisfy 0 < low < high <= 1")
        self._writer_index = {w: i for i, w in enumerate(self.writer_ids)}
        for tier, capacity in self.capacity_bytes.items():
            self.tables.setdefault(tier, TierTable(tier, capacity, self.ttl_s))
        self.tombstones = Tombstones(self.tombstone_capacity, self.num_shards)

    def owns(self, block_hash: int) -> bool:
        return block_hash % self.num_shards == self.shard_id

    def _writer(self, writer_id: str) -> int:
        index = self._writer_index.get(writer_id)
        if index is None:
            index = self._writer_index[writer_id] = len(self.writer_ids)
            self.writer_ids.append(writer_id)
        return index

    def _table(self, tier: str) -> TierTable:
        table = self.tables.get(tier)
        if table is None:  # a tier nobody configured: indexed, never evicted by capacity
            table = self.tables[tier] = TierTable(tier, 1 << 62, self.ttl_s)
        return table

    # -- events ----------------------------------------------------------------------------
    def apply(self, batch: KvEventBatch, now: float) -> Gap | None:
        last = self.writer_seq.get(batch.writer_id)
        if last is not None and batch.seq <= last:
            self.counters.num_duplicate_batches += 1
            return None
        gap = None
        if last is not None and batch.seq != last + 1:
            self.counters.num_gaps += 1
            gap = Gap(batch.writer_id, last + 1, batch.seq)
        self.writer_seq[batch.writer_id] = batch.seq
        self.counters.num_batches += 1
        writer = self._writer(batch.writer_id)
        for event in batch.events:
            if isinstance(event, BlocksStored):
                self.counters.num_blocks_stored += self._table(event.tier).put_blocks(
                    event.blocks, writer, now, self.num_shards, self.shard_id
                )
            elif isinstance(event, BlocksRemoved):
                table = self._table(event.tier)
                rows = table.find_many(unpack_block_hashes(event.block_hashes))
                rows = np.unique(rows[rows >= 0])
                # Only the writer that holds the slot may retire it.
                rows = rows[table.writers(rows) == writer]
                self._bury(table, rows, event.reason or "removed", now)
                table.remove_rows(rows)
                self.counters.num_blocks_removed += len(rows)
            elif isinstance(event, BlocksPinned):
                until = event.until_ms / 1000
                for h in unpack_block_hashes(event.block_hashes).tolist():
                    if self.owns(h) and self.pins.get(h, 0.0) < until:
                        self.pins[h] = until
            elif isinstance(event, AllBlocksCleared):
                table = self._table(event.tier)
                table.remove_rows(table.rows_of_writer(writer))
        return gap

    def adopt(self, tier: str, writer_id: str, blocks: tuple[StoredBlock, ...], now: float) -> int:
        """Index blocks found in a writer's slot headers (a rebuild); returns how many."""
        table, writer = self._table(tier), self._writer(writer_id)
        return table.put_blocks(blocks, writer, now, self.num_shards, self.shard_id)

    # -- questions -------------------------------------------------------------------------
    def match(
        self, block_hashes: Sequence[int] | np.ndarray, now: float, refresh: bool = True
    ) -> list[TierResult]:
        """Per tier, this shard's part of the longest cached prefix of `block_hashes` (ints,
        or a uint64 array such as the request's packed hashes, used without a copy)."""
        hashes = np.ascontiguousarray(block_hashes, dtype=np.uint64)
        if self.num_shards == 1:
            positions, keys = None, hashes
        else:
            positions = np.flatnonzero(hashes % np.uint64(self.num_shards) == self.shard_id)
            keys = hashes[positions]
        results = []
        for tier, table in self.tables.items():
            num_hits, used, columns = table.answer(keys, now, refresh)
            if positions is None:
                first_miss, hits = num_hits, _positions(num_hits)
            else:
                missed = num_hits < len(positions)
                first_miss = int(positions[num_hits]) if missed else len(hashes)
                hits = positions[:num_hits].tolist()
            # Name only the writers these blocks need, not every writer the index knows.
            writer_ids = tuple(self.writer_ids[w] for w in used)
            locations = BlockLocations(tier=tier, writer_ids=writer_ids, **columns)
            evicted = None
            if first_miss < len(hashes) and self.tombstones.num_added:
                evicted = self.tombstones.get(int(hashes[first_miss]), tier)
            results.append(TierResult(tier, first_miss, hits, locations, evicted))
            self.counters.num_blocks_matched += num_hits
        self.counters.num_matches += 1
        return results

    # -- eviction ---------------------------------------------------------------------------
    def evict(self, now: float) -> list[Removal]:
        removals = []
        if self.pins:
            self.pins = {h: until for h, until in self.pins.items() if until > now}
        for table in self.tables.values():
            pinned = self._pinned_rows(table)
            expired = table.expired_rows(now, self.ttl_s)
            if len(pinned):
                kept = np.isin(expired, pinned)
                self.counters.num_kept_pinned += int(kept.sum())
                expired = expired[~kept]
            removals += self._drop(table, expired, "ttl", now)
            self.counters.num_evicted_ttl += len(expired)
            if table.used_bytes > self.high_watermark * table.capacity_bytes:
                target = int(self.low_watermark * table.capacity_bytes)
                victims = table.rows_to_free(target, exclude=pinned)
                removals += self._drop(table, victims, "capacity", now)
                self.counters.num_evicted_capacity += len(victims)
        return removals

    def evict_fraction(
        self, tier: str | None, fraction: float, now: float | None = None
    ) -> list[Removal]:
        """Drop the least recently used `fraction` of a tier (all tiers when None)."""
        now = time.time() if now is None else now
        removals = []
        for table in self.tables.values():
            if tier in (None, table.tier):
                ordered = table.oldest_first(table.live_rows())
                chosen = ordered[: int(round(fraction * len(ordered)))]
                removals += self._drop(table, chosen, "admin", now)
        return removals

    def _pinned_rows(self, table: TierTable) -> np.ndarray:
        if not self.pins:
            return np.zeros(0, np.int64)
        rows = table.find_many(np.fromiter(self.pins, np.uint64, len(self.pins)))
        return rows[rows >= 0]

    def _bury(self, table: TierTable, rows: np.ndarray, reason: str, now: float) -> None:
        if len(rows):
            last_used = table.seconds(table.access[rows])
            self.tombstones.add(table.tier, reason, table.hash[rows], now, last_used)

    def _drop(self, table: TierTable, rows: np.ndarray, reason: str, now: float) -> list[Removal]:
        if not len(rows):
            return []
        self._bury(table, rows, reason, now)
        if self.pins:  # an admin's eviction drops pinned blocks too: their pins go with them
            for h in table.hash[rows].tolist():
                self.pins.pop(h, None)
        by_writer: dict[int, list[int]] = {}
        for writer, block_hash in zip(
            table.writers(rows).tolist(), table.hash[rows].tolist(), strict=True
        ):
            by_writer.setdefault(writer, []).append(block_hash)
        table.remove_rows(rows)
        return [
            Removal(table.tier, self.writer_ids[w], hashes, reason)
            for w, hashes in by_writer.items()
        ]

    def stats(self) -> dict[str, dict[str, int]]:
        return {
            tier: {
                "num_blocks": len(table),
                "used_bytes": table.used_bytes,
                "capacity_bytes": table.capacity_bytes,
            }
            for tier, table in self.tables.items()
        }

    # -- snapshots ---------------------------------------------------------------------------
    def snapshot(self) -> bytes:
        return msgspec.msgpack.encode(
            {
                "writer_ids": self.writer_ids,
                "writer_seq": self.writer_seq,
                "tiers": {t: table.to_columns() for t, table in self.tables.items()},
                "pins": self.pins,
            }
        )

    def restore(self, data: bytes) -> None:
        """Replace this index's state with a snapshot's (config stays this instance's)."""
        state = msgspec.msgpack.decode(data)
        self.writer_ids = list(state["writer_ids"])
        self._writer_index = {w: i for i, w in enumerate(self.writer_ids)}
        self.writer_seq = dict(state["writer_seq"])
        self.pins = {int(h): float(until) for h, until in state.get("pins", {}).items()}
        self.tables = {
            tier: TierTable.from_columns(
                tier, self.capacity_bytes.get(tier, 1 << 62), columns, self.ttl_s
            )
            for tier, columns in state["tiers"].items()
        }
        for tier, capacity in self.capacity_bytes.items():
            self.tables.setdefault(tier, TierTable(tier, capacity, self.ttl_s))


_POSITIONS: list[int] = []


def _positions(count: int) -> list[int]:
    """[0, 1, ... count - 1], sliced from a list kept for the purpose: list(range(1200))
    makes 1,200 int objects (~5 us, the largest cost of a match); a slice shares them."""
    global _POSITIONS
    if count > len(_POSITIONS):
        _POSITIONS = list(range(max(count, 2 * len(_POSITIONS))))
    return _POSITIONS[:count]
