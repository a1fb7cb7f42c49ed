"""The kv-index core: metadata of every cached block, by tier, for the hashes this shard owns.

Pure and synchronous (no NATS, no asyncio): handlers.py feeds it events and questions.

- `apply(batch)`: a writer's `KvEventBatch`. Per-writer sequence numbers: a repeat (JetStream
  redelivery, replay after restart) is ignored, a jump is a gap, reported so the service asks
  that writer to resync (its reply starts with AllBlocksCleared, so applying it is safe).
- `match(hashes)`: per tier, this shard's part of the longest cached prefix (see
  `shared.kv_index_client` for the merge across shards); a read refreshes recency.
- `evict(now)`: TTL first, then LRU from the high watermark down to the low one, per tier.
  Returns what was dropped, for the service to publish as BlocksRemoved (writers reuse slots).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import msgspec
import numpy as np

from services.kv_index.table import TierTable
from shared.schema import (
    AllBlocksCleared,
    BlocksRemoved,
    BlocksStored,
    KvEventBatch,
    StoredBlock,
)
from shared.schema.inference import BlockLocations
from shared.schema.tokens import unpack_block_hashes

DAY_S = 86_400.0


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


@dataclass(frozen=True)
class TierResult:
    tier: str
    first_miss_index: int  # among the request's positions this shard owns; len(request) if none
    indices: list[int]  # request positions of the `locations` rows
    locations: BlockLocations


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

    def __post_init__(self) -> None:
        if not 0 <= self.shard_id < self.num_shards:
            raise ValueError(f"shard_id {self.shard_id} outside [0, {self.num_shards})")
        if not 0 < self.low_watermark < self.high_watermark <= 1:
            raise ValueError("watermarks must satisfy 0 < low < high <= 1")
        self._writer_index = {w: i for i, w in enumerate(self.writer_ids)}
        for tier, capacity in self.capacity_bytes.items():
            self.tables.setdefault(tier, TierTable(tier, capacity))

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
            table = self.tables[tier] = TierTable(tier, capacity_bytes=1 << 62)
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
                table = self._table(event.tier)
                for block in event.blocks:
                    if self.owns(block.block_hash):
                        table.put(block.block_hash, writer, block.file_id, block.slot,
                                  block.generation, block.num_bytes, now)  # fmt: skip
                        self.counters.num_blocks_stored += 1
            elif isinstance(event, BlocksRemoved):
                table = self._table(event.tier)
                for block_hash in unpack_block_hashes(event.block_hashes).tolist():
                    row = table.rows.get(block_hash)
                    # Only the writer that holds the slot may retire it.
                    if row is not None and int(table.cols["writer"][row]) == writer:
                        table.remove(block_hash)
                        self.counters.num_blocks_removed += 1
            elif isinstance(event, AllBlocksCleared):
                table = self._table(event.tier)
                rows = table.live_rows()
                table.remove_rows(rows[table.cols["writer"][rows] == writer])
        return gap

    def adopt(self, tier: str, writer_id: str, blocks: tuple[StoredBlock, ...], now: float) -> int:
        """Index blocks found in a writer's slot headers (a rebuild); returns how many."""
        table, writer = self._table(tier), self._writer(writer_id)
        num_indexed = 0
        for block in blocks:
            if self.owns(block.block_hash):
                table.put(block.block_hash, writer, block.file_id, block.slot, block.generation,
                          block.num_bytes, now)  # fmt: skip
                num_indexed += 1
        return num_indexed

    # -- questions -------------------------------------------------------------------------
    def match(self, block_hashes: list[int], now: float, refresh: bool = True) -> list[TierResult]:
        if self.num_shards == 1:
            positions = None
        else:
            owned = np.asarray(block_hashes, np.uint64) % self.num_shards == self.shard_id
            positions = np.flatnonzero(owned).tolist()
        results = []
        for tier, table in self.tables.items():
            first_miss, hits, rows = table.lookup(block_hashes, positions)
            if refresh:
                table.touch(rows, now)
            columns = {name: column[rows] for name, column in table.cols.items()}
            # Name only the writers these blocks need, not every writer the index knows.
            used, columns["writer"] = np.unique(columns["writer"], return_inverse=True)
            writer_ids = tuple(self.writer_ids[w] for w in used.tolist())
            results.append(
                TierResult(
                    tier,
                    len(block_hashes) if first_miss is None else first_miss,
                    hits,
                    BlockLocations.from_columns(tier, writer_ids, columns),
                )
            )
            self.counters.num_blocks_matched += len(hits)
        self.counters.num_matches += 1
        return results

    # -- eviction ---------------------------------------------------------------------------
    def evict(self, now: float) -> list[Removal]:
        removals = []
        for table in self.tables.values():
            live = table.live_rows()
            expired = live[table.cols["last_access"][live] < now - self.ttl_s]
            removals += self._drop(table, expired)
            self.counters.num_evicted_ttl += len(expired)
            if table.used_bytes > self.high_watermark * table.capacity_bytes:
                victims = table.rows_to_free(int(self.low_watermark * table.capacity_bytes))
                removals += self._drop(table, victims)
                self.counters.num_evicted_capacity += len(victims)
        return removals

    def evict_fraction(self, tier: str | None, fraction: float) -> list[Removal]:
        """Drop the least recently used `fraction` of a tier (all tiers when None)."""
        removals = []
        for table in self.tables.values():
            if tier in (None, table.tier):
                ordered = table.oldest_first(table.live_rows())
                removals += self._drop(table, ordered[: int(round(fraction * len(ordered)))])
        return removals

    def _drop(self, table: TierTable, rows: np.ndarray) -> list[Removal]:
        if not len(rows):
            return []
        by_writer: dict[int, list[int]] = {}
        for writer, block_hash in zip(
            table.cols["writer"][rows].tolist(),
            table.cols["block_hash"][rows].tolist(),
            strict=True,
        ):
            by_writer.setdefault(writer, []).append(block_hash)
        table.remove_rows(rows)
        return [Removal(table.tier, self.writer_ids[w], hashes) for w, hashes in by_writer.items()]

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
            }
        )

    def restore(self, data: bytes) -> None:
        """Replace this index's state with a snapshot's (config stays this instance's)."""
        state = msgspec.msgpack.decode(data)
        self.writer_ids = list(state["writer_ids"])
        self._writer_index = {w: i for i, w in enumerate(self.writer_ids)}
        self.writer_seq = dict(state["writer_seq"])
        self.tables = {
            tier: TierTable.from_columns(tier, self.capacity_bytes.get(tier, 1 << 62), columns)
            for tier, columns in state["tiers"].items()
        }
        for tier, capacity in self.capacity_bytes.items():
            self.tables.setdefault(tier, TierTable(tier, capacity))
