"""The kv-index's meaning in plain Python, for the randomized tests to hold the real one to:
one dict per tier (hash -> entry, in insertion order), a match walks the request's owned
positions until the first absent hash, eviction sorts by last access (ties in insertion
order). Slow and obvious on purpose."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from services.kv_index.index import Removal, TierResult
from services.kv_index.tombstones import DEFAULT_CAPACITY
from shared.schema import AllBlocksCleared, BlocksRemoved, BlocksStored, KvEventBatch
from shared.schema.inference import BlockLocations, Eviction
from shared.schema.tokens import unpack_block_hashes


@dataclass
class Entry:
    writer: int
    file_id: int
    slot: int
    generation: int
    num_bytes: int
    last_access: float


@dataclass
class ReferenceIndex:
    capacity_bytes: dict[str, int]
    shard_id: int = 0
    num_shards: int = 1
    ttl_s: float = 86_400.0
    high_watermark: float = 0.9
    low_watermark: float = 0.8
    writer_ids: list[str] = field(default_factory=list)
    writer_seq: dict[str, int] = field(default_factory=dict)
    tiers: dict[str, dict[int, Entry]] = field(default_factory=dict)
    # slot -> (hash, tier, reason, evicted at, last access then): the newest eviction of the
    # hashes sharing a slot, as the index keeps them (a direct-mapped table of this size)
    tombstones: dict[int, tuple[int, str, str, float, float]] = field(default_factory=dict)
    tombstone_capacity: int = DEFAULT_CAPACITY

    def __post_init__(self) -> None:
        for tier in self.capacity_bytes:
            self.tiers.setdefault(tier, {})

    def _writer(self, writer_id: str) -> int:
        if writer_id not in self.writer_ids:
            self.writer_ids.append(writer_id)
        return self.writer_ids.index(writer_id)

    def _tier(self, tier: str) -> dict[int, Entry]:
        return self.tiers.setdefault(tier, {})

    def apply(self, batch: KvEventBatch, now: float) -> None:
        last = self.writer_seq.get(batch.writer_id)
        if last is not None and batch.seq <= last:
            return
        self.writer_seq[batch.writer_id] = batch.seq
        writer = self._writer(batch.writer_id)
        for event in batch.events:
            entries = self._tier(event.tier)
            if isinstance(event, BlocksStored):
                for b in event.blocks:
                    if b.block_hash % self.num_shards == self.shard_id:
                        entries[b.block_hash] = Entry(
                            writer, b.file_id, b.slot, b.generation, b.num_bytes, now
                        )
            elif isinstance(event, BlocksRemoved):
                for h in unpack_block_hashes(event.block_hashes).tolist():
                    if h in entries and entries[h].writer == writer:
                        last_access = entries.pop(h).last_access
                        reason = event.reason or "removed"
                        self._bury(h, event.tier, reason, now, last_access)
            elif isinstance(event, AllBlocksCleared):
                for h in [h for h, e in entries.items() if e.writer == writer]:
                    del entries[h]

    def match(self, hashes: list[int], now: float) -> list[TierResult]:
        positions = [i for i, h in enumerate(hashes) if h % self.num_shards == self.shard_id]
        results = []
        for tier, entries in self.tiers.items():
            hits = []
            first_miss = len(hashes)
            for p in positions:
                if hashes[p] not in entries:
                    first_miss = p
                    break
                hits.append(p)
            found = [entries[hashes[p]] for p in hits]
            for entry in found:
                entry.last_access = now
            used = sorted({e.writer for e in found})
            columns = {
                "block_hash": np.array([hashes[p] for p in hits], np.uint64),
                "writer": np.array([used.index(e.writer) for e in found], np.int64),
                "file_id": np.array([e.file_id for e in found], np.uint32),
                "slot": np.array([e.slot for e in found], np.uint32),
                "generation": np.array([e.generation for e in found], np.uint32),
                "num_bytes": np.array([e.num_bytes for e in found], np.uint32),
            }
            writer_ids = tuple(self.writer_ids[w] for w in used)
            locations = BlockLocations.from_columns(tier, writer_ids, columns)
            evicted = None
            missed = hashes[first_miss] if first_miss < len(hashes) else None
            stone = self.tombstones.get(self._slot(missed)) if missed is not None else None
            if stone is not None and stone[0] == missed and stone[1] == tier:
                _, _, reason, at, last_access = stone
                idle_s = round(max(at - last_access, 0.0), 1)
                evicted = Eviction(
                    tier=tier, reason=reason, evicted_ms=int(at * 1000), idle_s=idle_s
                )
            results.append(TierResult(tier, first_miss, hits, locations, evicted))
        return results

    def _slot(self, block_hash: int) -> int:
        return block_hash // self.num_shards % self.tombstone_capacity

    def _bury(self, block_hash: int, tier: str, reason: str, now: float, last: float) -> None:
        self.tombstones[self._slot(block_hash)] = (block_hash, tier, reason, now, last)

    def used_bytes(self, tier: str) -> int:
        return sum(e.num_bytes for e in self.tiers[tier].values())

    def _oldest_first(self, tier: str) -> list[int]:
        entries = self.tiers[tier]
        return sorted(entries, key=lambda h: entries[h].last_access)  # stable: insertion order

    def evict(self, now: float) -> list[Removal]:
        removals: list[Removal] = []
        for tier, entries in self.tiers.items():
            expired = [h for h, e in entries.items() if e.last_access < now - self.ttl_s]
            removals += self._drop(tier, expired, "ttl", now)
            capacity = self.capacity_bytes.get(tier, 1 << 62)
            if self.used_bytes(tier) > self.high_watermark * capacity:
                excess = self.used_bytes(tier) - int(self.low_watermark * capacity)
                victims, freed = [], 0
                for h in self._oldest_first(tier):
                    if freed >= excess:
                        break
                    victims.append(h)
                    freed += entries[h].num_bytes
                removals += self._drop(tier, victims, "capacity", now)
        return removals

    def evict_fraction(self, tier: str | None, fraction: float, now: float) -> list[Removal]:
        removals: list[Removal] = []
        for name in self.tiers:
            if tier in (None, name):
                ordered = self._oldest_first(name)
                chosen = ordered[: int(round(fraction * len(ordered)))]
                removals += self._drop(name, chosen, "admin", now)
        return removals

    def _drop(self, tier: str, hashes: list[int], reason: str, now: float) -> list[Removal]:
        by_writer: dict[int, list[int]] = {}
        for h in hashes:
            entry = self.tiers[tier].pop(h)
            self._bury(h, tier, reason, now, entry.last_access)
            by_writer.setdefault(entry.writer, []).append(h)
        return [Removal(tier, self.writer_ids[w], hs, reason) for w, hs in by_writer.items()]
