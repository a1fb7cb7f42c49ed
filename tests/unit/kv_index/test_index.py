"""The kv-index core: match, eviction order, TTL, watermarks, gaps, shards, snapshots."""

from __future__ import annotations

import pytest

from services.kv_index.index import KvIndex
from shared.block_hashing import BlockHasher
from shared.kv_index_client import first_miss_eviction, merge, to_wire
from shared.schema import (
    AllBlocksCleared,
    BlocksPinned,
    BlocksRemoved,
    BlocksStored,
    KvEventBatch,
    StoredBlock,
    pack_block_hashes,
)
from shared.schema.kv_index import MatchReply

BLOCK_BYTES = 1000
HASHES = BlockHasher("m", block_size_tokens=4).hashes(range(4 * 20))  # a 20-block chain


def stored(
    writer: str, seq: int, hashes: list[int], tier: str = "ssd", first_slot: int = 0
) -> KvEventBatch:
    blocks = tuple(
        StoredBlock(
            block_hash=h, file_id=0, slot=first_slot + i, generation=1, num_bytes=BLOCK_BYTES
        )
        for i, h in enumerate(hashes)
    )
    return KvEventBatch(
        writer_id=writer, seq=seq, ts_ms=0, events=(BlocksStored(tier=tier, blocks=blocks),)
    )


def prefix_len(index: KvIndex, hashes: list[int], now: float = 0.0, tier: str = "ssd") -> int:
    return {r.tier: r.first_miss_index for r in index.match(hashes, now)}[tier]


def test_match_is_the_longest_consecutive_prefix() -> None:
    index = KvIndex(capacity_bytes={"ssd": 10**9})
    index.apply(stored("p0", 1, HASHES[:5] + HASHES[6:9]), now=0)
    [result] = index.match(HASHES, now=1)
    assert result.first_miss_index == 5  # block 5 is missing: 6..8 do not count
    assert [loc.slot for loc in result.locations.rows()] == [0, 1, 2, 3, 4]
    assert {loc.writer_id for loc in result.locations.rows()} == {"p0"}
    assert prefix_len(index, HASHES[:3]) == 3
    other_prompt = BlockHasher("m", block_size_tokens=4).hashes(range(1, 4 * 20))
    assert prefix_len(index, other_prompt) == 0


def test_reads_refresh_recency_so_reread_prefixes_survive() -> None:
    index = KvIndex(capacity_bytes={"ssd": 10 * BLOCK_BYTES}, high_watermark=0.9, low_watermark=0.6)
    index.apply(stored("p0", 1, HASHES[:5]), now=0)  # old, but read again below
    index.apply(stored("p0", 2, HASHES[10:14]), now=10)  # newer, never read
    index.match(HASHES[:5], now=20)
    index.apply(stored("p0", 3, HASHES[15:16]), now=30)  # 10 blocks: over 90%
    removals = index.evict(now=31)
    evicted = {h for r in removals for h in r.block_hashes}
    assert evicted == set(HASHES[10:14])  # down to 60%: the 4 least recently used
    assert prefix_len(index, HASHES, now=32) == 5


def test_watermarks() -> None:
    index = KvIndex(capacity_bytes={"ssd": 10 * BLOCK_BYTES})  # 90% high, 80% low
    index.apply(stored("p0", 1, HASHES[:9]), now=0)
    assert index.evict(now=1) == []  # exactly at 90%: not over
    index.apply(stored("p0", 2, HASHES[9:10]), now=2)
    removals = index.evict(now=3)
    assert sum(len(r.block_hashes) for r in removals) == 2  # 10 -> 8 blocks (80%)
    assert index.stats()["ssd"]["used_bytes"] == 8 * BLOCK_BYTES
    assert index.counters.num_evicted_capacity == 2


def test_ttl() -> None:
    index = KvIndex(capacity_bytes={"ssd": 10**9}, ttl_s=100)
    index.apply(stored("p0", 1, HASHES[:3]), now=0)
    index.apply(stored("p0", 2, HASHES[3:6]), now=50)
    index.match(HASHES[:1], now=60)  # block 0 read at 60
    removals = index.evict(now=120)
    assert sorted(h for r in removals for h in r.block_hashes) == sorted(HASHES[1:3])
    assert removals[0].writer_id == "p0" and removals[0].tier == "ssd"
    assert index.counters.num_evicted_ttl == 2


def test_sequence_gaps_and_duplicates() -> None:
    index = KvIndex(capacity_bytes={"ssd": 10**9})
    assert index.apply(stored("p0", 1, HASHES[:1]), now=0) is None
    assert index.apply(stored("p0", 1, HASHES[1:2]), now=0) is None  # redelivered: ignored
    assert prefix_len(index, HASHES) == 1
    gap = index.apply(stored("p0", 5, HASHES[1:2]), now=0)
    assert gap is not None and (gap.expected_seq, gap.received_seq) == (2, 5)
    assert index.apply(stored("p1", 7, HASHES[5:6]), now=0) is None  # a new writer starts anywhere
    # The resync reply: clear that writer's blocks, then its whole state.
    resync = KvEventBatch(
        writer_id="p0",
        seq=6,
        ts_ms=0,
        events=(AllBlocksCleared(tier="ssd"), *stored("p0", 6, HASHES[:3]).events),
    )
    assert index.apply(resync, now=1) is None
    assert prefix_len(index, HASHES) == 3


def test_only_the_holder_removes_a_block() -> None:
    index = KvIndex(capacity_bytes={"ssd": 10**9})
    index.apply(stored("p0", 1, HASHES[:3]), now=0)
    removed = BlocksRemoved(tier="ssd", block_hashes=pack_block_hashes(HASHES[1:2]))
    index.apply(KvEventBatch(writer_id="p1", seq=1, ts_ms=0, events=(removed,)), now=0)
    assert prefix_len(index, HASHES) == 3
    index.apply(KvEventBatch(writer_id="p0", seq=2, ts_ms=0, events=(removed,)), now=0)
    assert prefix_len(index, HASHES) == 1


@pytest.mark.parametrize("num_shards", [1, 2, 3])
def test_shards_fan_out_and_merge_to_the_unsharded_answer(num_shards: int) -> None:
    shards = [
        KvIndex(capacity_bytes={"ssd": 10**9}, shard_id=s, num_shards=num_shards)
        for s in range(num_shards)
    ]
    whole = KvIndex(capacity_bytes={"ssd": 10**9})
    for target in [*shards, whole]:  # every shard sees every event, keeps what it owns
        target.apply(stored("p0", 1, HASHES[:7] + HASHES[8:12]), now=0)
        target.apply(stored("d0", 1, HASHES[:3], tier="dram"), now=0)
    assert sum(len(s.tables["ssd"]) for s in shards) == len(whole.tables["ssd"]) == 11
    replies = [
        MatchReply(
            shard_id=s.shard_id,
            num_shards=num_shards,
            tiers=tuple(
                to_wire(r.tier, r.first_miss_index, r.indices, r.locations)
                for r in s.match(HASHES, now=1)
            ),
        )
        for s in shards
    ]
    merged = merge(replies, len(HASHES))
    assert merged["ssd"].num_blocks == 7 and merged["dram"].num_blocks == 3
    assert [loc.block_hash for loc in merged["ssd"].locations.rows()] == HASHES[:7]
    assert {loc.writer_id for loc in merged["ssd"].locations.rows()} == {"p0"}
    assert {loc.writer_id for loc in merged["dram"].locations.rows()} == {"d0"}


def test_snapshot_restores_the_same_answers() -> None:
    index = KvIndex(capacity_bytes={"ssd": 10**9})
    index.apply(stored("p0", 4, HASHES[:6]), now=5)
    index.apply(stored("p1", 2, HASHES[6:8], first_slot=100), now=6)
    copy = KvIndex(capacity_bytes={"ssd": 10**9})
    copy.restore(index.snapshot())
    assert copy.match(HASHES, now=7) == index.match(HASHES, now=7)
    assert len(copy.match(HASHES, now=7)[0].locations) == 8
    assert copy.writer_seq == {"p0": 4, "p1": 2}
    assert copy.apply(stored("p0", 4, HASHES[8:9]), now=8) is None  # seq survives: a repeat
    assert prefix_len(copy, HASHES) == 8


@pytest.mark.parametrize("num_shards", [1, 3])
def test_a_match_names_the_tombstone_where_the_prefix_ends(num_shards: int) -> None:
    """Blocks 4.. of a 7-block prefix expired: the merged match ends at 4 and says why,
    from the shard that owns block 4, and the router's pick is that tombstone."""
    shards = [
        KvIndex(
            capacity_bytes={"ssd": 10**9, "dram": 10**9},
            shard_id=s,
            num_shards=num_shards,
            ttl_s=100,
        )
        for s in range(num_shards)
    ]
    for shard in shards:
        shard.apply(stored("p0", 1, HASHES[:4]), now=100)
        shard.apply(stored("p0", 2, HASHES[4:7] + HASHES[10:16]), now=50)  # unused 150 s
        removals = shard.evict(now=200)
        assert all(r.reason == "ttl" for r in removals)
    replies = [
        MatchReply(
            shard_id=s.shard_id,
            num_shards=num_shards,
            tiers=tuple(
                to_wire(r.tier, r.first_miss_index, r.indices, r.locations, r.evicted)
                for r in s.match(HASHES, now=210)
            ),
        )
        for s in shards
    ]
    merged = merge(replies, len(HASHES))
    assert merged["ssd"].num_blocks == 4
    evicted = merged["ssd"].evicted
    assert evicted is not None
    assert (evicted.tier, evicted.reason, evicted.evicted_ms) == ("ssd", "ttl", 200_000)
    assert abs(evicted.idle_s - 150) <= shards[0].tables["ssd"].tick_s  # unused since 50
    assert merged["dram"].num_blocks == 0 and merged["dram"].evicted is None  # never stored
    assert first_miss_eviction(merged) == evicted
    # Stored again, it hits: the stale tombstone is never looked at.
    for shard in shards:
        shard.apply(stored("p0", 3, HASHES[4:7], first_slot=50), now=220)
        assert all(r.evicted is None or r.first_miss_index != 4 for r in shard.match(HASHES, 221))


def pinned(writer: str, seq: int, hashes: list[int], until_s: float) -> KvEventBatch:
    pin = BlocksPinned(
        tier="ssd", block_hashes=pack_block_hashes(hashes), until_ms=int(until_s * 1000)
    )
    return KvEventBatch(writer_id=writer, seq=seq, ts_ms=0, events=(pin,))


def test_pinned_blocks_outlive_ttl_and_watermark_sweeps_until_their_pin_ends() -> None:
    index = KvIndex(capacity_bytes={"ssd": 10 * BLOCK_BYTES}, ttl_s=100, low_watermark=0.5)
    index.apply(stored("p0", 1, HASHES[:4]), now=0)  # the oldest: LRU's first victims
    index.apply(pinned("p0", 2, HASHES[:3], until_s=1000), now=0)
    index.apply(stored("p0", 3, HASHES[10:16]), now=10)  # 10 blocks: over the watermark
    index.evict(now=20)
    assert prefix_len(index, HASHES[:4], now=21) == 3  # block 3 went; the pinned three stayed
    assert index.counters.num_evicted_capacity > 0
    assert index.evict(now=500) and prefix_len(index, HASHES[:3], now=500) == 3  # TTL: kept
    assert index.counters.num_kept_pinned >= 3
    copy = KvIndex(capacity_bytes={"ssd": 10 * BLOCK_BYTES}, ttl_s=100, low_watermark=0.5)
    copy.restore(index.snapshot())  # a restarted shard keeps the pins
    assert copy.pins == index.pins and len(copy.pins) == 3
    index.evict(now=1001)  # the pin ended: the TTL takes them at last
    assert prefix_len(index, HASHES[:3], now=1001) == 0 and not index.pins


def test_a_later_pin_extends_and_an_admin_flush_drops_pinned_blocks() -> None:
    index = KvIndex(capacity_bytes={"ssd": 10**9}, ttl_s=100)
    index.apply(stored("p0", 1, HASHES[:2]), now=0)
    index.apply(pinned("p0", 2, HASHES[:2], until_s=300), now=0)
    index.apply(pinned("p1", 1, HASHES[:1], until_s=200), now=0)  # shorter: changes nothing
    index.apply(pinned("p1", 2, HASHES[1:2], until_s=900), now=0)
    assert index.pins == {HASHES[0]: 300.0, HASHES[1]: 900.0}
    removals = index.evict_fraction(None, 1.0, now=1)
    assert sum(len(r.block_hashes) for r in removals) == 2 and not index.pins
