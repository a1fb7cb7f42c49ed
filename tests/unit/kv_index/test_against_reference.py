"""The index against its plain-Python meaning (reference.py) on random event sequences:
chained prompts stored in pieces by several writers on two tiers, re-stored by others,
repeated and mixed-size blocks, removals by holders and by others, AllBlocksCleared, TTL and
watermark evictions, admin evictions, compactions, index rebuilds and snapshots, with every
match, removal and count compared. Run on the numpy index and, where a C compiler is at
hand, on the C one."""

from __future__ import annotations

import dataclasses
import random

import msgspec
import numpy as np
import pytest

from services.kv_index import native
from services.kv_index.index import KvIndex, TierResult
from services.kv_index.table import TierTable
from shared.block_hashing import BlockHasher
from shared.schema import (
    AllBlocksCleared,
    BlocksRemoved,
    BlocksStored,
    KvEventBatch,
    StoredBlock,
    pack_block_hashes,
)
from tests.unit.kv_index.reference import ReferenceIndex


def _unburied(result: TierResult) -> TierResult:
    return dataclasses.replace(result, evicted=None)


TTL_S = 16_384.0  # one tick a second: integer times are exact in the index
WRITERS = ["prefill-0", "prefill-1", "decode-0", "decode-1"]
TIERS = ["ssd", "dram"]
BACKENDS = [
    pytest.param(False, id="numpy"),
    pytest.param(
        True,
        id="native",
        marks=pytest.mark.skipif(not native.available(), reason="no C compiler here"),
    ),
]


@pytest.fixture(autouse=True)
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    use_native = request.param if hasattr(request, "param") else False
    monkeypatch.setattr(native, "available", lambda: use_native)
    return use_native


def prompts(rng: random.Random, num: int) -> list[list[int]]:
    """Chains that share prefixes, as agents' conversations do: each forks an earlier one."""
    hasher = BlockHasher("m", block_size_tokens=2)
    chains: list[list[int]] = []
    for _ in range(num):
        if chains and rng.random() < 0.7:
            base = rng.choice(chains)
            cut = rng.randrange(len(base) + 1)
            extra = hasher.hashes(
                [rng.randrange(1000) for _ in range(2 * rng.randrange(1, 30))],
                parent_hash=base[cut - 1] if cut else 0,
            )
            chains.append(base[:cut] + extra)
        else:
            chains.append(
                hasher.hashes([rng.randrange(1000) for _ in range(2 * rng.randrange(1, 40))])
            )
    return chains


class Driver:
    """Feeds the same random operations to the index and the reference, comparing as it goes."""

    def __init__(self, seed: int, num_shards: int, shard_id: int, capacity_blocks: int) -> None:
        self.rng = random.Random(seed)
        capacity = {"ssd": capacity_blocks * 1000, "dram": capacity_blocks * 300}
        kwargs = {
            "capacity_bytes": capacity,
            "shard_id": shard_id,
            "num_shards": num_shards,
            "ttl_s": TTL_S,
            "high_watermark": 0.9,
            "low_watermark": 0.7,
        }
        self.index = KvIndex(**kwargs)
        self.reference = ReferenceIndex(**kwargs)
        self.chains = prompts(self.rng, 60)
        self.seq = dict.fromkeys(WRITERS, 0)
        self.now = 100.0
        self.num_hits = self.num_evicted = self.num_removed = 0  # what a run exercised
        self.num_tombstones_told = 0

    def batch(self, writer: str, events: tuple) -> None:
        self.seq[writer] += 1
        batch = KvEventBatch(writer_id=writer, seq=self.seq[writer], ts_ms=0, events=events)
        self.index.apply(batch, self.now)
        self.reference.apply(batch, self.now)

    def store(self) -> None:
        rng = self.rng
        chain = rng.choice(self.chains)
        start = 0 if rng.random() < 0.5 else rng.randrange(len(chain))  # a turn, or its tail
        hashes = chain[start : start + rng.randrange(1, 80)]
        if rng.random() < 0.1 and len(hashes) > 2:  # a hash twice in one event
            hashes = [*hashes, hashes[0]]
        size = 1000 if rng.random() < 0.9 else rng.choice([999, 1001])  # now and then another
        blocks = tuple(
            StoredBlock(
                h,
                rng.randrange(4),
                rng.randrange(1 << 32),
                rng.randrange(1 << 32),
                size if rng.random() < 0.95 else 1000,
            )
            for h in hashes
        )
        tier = "ssd" if rng.random() < 0.75 else "dram"
        self.batch(rng.choice(WRITERS), (BlocksStored(tier=tier, blocks=blocks),))

    def remove(self) -> None:
        """Mostly hashes a writer holds (as its slot reuse logs them), some it does not."""
        rng = self.rng
        tier, writer = rng.choice(TIERS), rng.choice(WRITERS)
        held = [
            h
            for h, e in self.reference.tiers[tier].items()
            if self.reference.writer_ids[e.writer] == writer
        ]
        hashes = rng.sample(held, min(len(held), rng.randrange(1, 20)))
        chain = rng.choice(self.chains)
        hashes += rng.sample(chain, min(2, len(chain)))
        before = len(self.reference.tiers[tier])
        self.batch(writer, (BlocksRemoved(tier=tier, block_hashes=pack_block_hashes(hashes)),))
        self.num_removed += before - len(self.reference.tiers[tier])

    def clear(self) -> None:
        self.batch(self.rng.choice(WRITERS), (AllBlocksCleared(tier=self.rng.choice(TIERS)),))

    def match(self) -> None:
        chain = self.rng.choice(self.chains)
        query = chain[: self.rng.randrange(len(chain) + 1)]
        as_array = self.rng.random() < 0.5
        got = self.index.match(np.array(query, np.uint64) if as_array else query, self.now)
        want = self.reference.match(query, self.now)
        # Evictions compared apart: the index keeps last use to a tick (ttl / 16384).
        assert [_unburied(r) for r in got] == [_unburied(r) for r in want]
        for g, w in zip(got, want, strict=True):
            assert (g.evicted is None) == (w.evicted is None)
            if g.evicted is not None and w.evicted is not None:
                assert msgspec.structs.replace(g.evicted, idle_s=0) == msgspec.structs.replace(
                    w.evicted, idle_s=0
                )
                tick_s = self.index.tables[g.tier].tick_s
                if w.evicted.idle_s <= 2 * TTL_S:
                    assert abs(g.evicted.idle_s - w.evicted.idle_s) <= tick_s + 0.1
                else:  # ticks older than two TTLs clamp (table.py): told as at least that
                    assert 2 * TTL_S - tick_s <= g.evicted.idle_s <= w.evicted.idle_s
                self.num_tombstones_told += 1
        self.num_hits += sum(len(r.indices) for r in got)

    def evict(self) -> None:
        if self.rng.random() < 0.8:
            got, want = self.index.evict(self.now), self.reference.evict(self.now)
        else:
            tier, fraction = self.rng.choice([None, *TIERS]), self.rng.random() * 0.3
            got = self.index.evict_fraction(tier, fraction, self.now)
            want = self.reference.evict_fraction(tier, fraction, self.now)
        assert got == want
        self.num_evicted += sum(len(r.block_hashes) for r in got)

    def check_counts(self) -> None:
        for tier in self.reference.tiers:
            table = self.index.tables[tier]
            assert len(table) == len(self.reference.tiers[tier])
            assert table.used_bytes == self.reference.used_bytes(tier)

    def run(self, num_steps: int) -> None:
        operations = [self.store] * 6 + [self.match] * 6 + [self.remove, self.clear, self.evict]
        for step in range(num_steps):
            self.now += self.rng.choice([0, 0, 1, 2, 5])
            if self.rng.random() < 0.005:  # past the TTL: a TTL sweep finds work
                self.now += TTL_S
            self.rng.choice(operations)()
            if step % 50 == 0:
                self.check_counts()
            if step % 400 == 399:  # a snapshot restores the same answers
                copy = KvIndex(
                    capacity_bytes=self.index.capacity_bytes,
                    ttl_s=TTL_S,
                    shard_id=self.index.shard_id,
                    num_shards=self.index.num_shards,
                    high_watermark=0.9,
                    low_watermark=0.7,
                )
                copy.restore(self.index.snapshot())
                self.index = copy
                self.reference.tombstones.clear()  # not in a snapshot: memory only
        self.check_counts()


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize(("num_shards", "shard_id"), [(1, 0), (3, 1)])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_sequences_match_the_reference(seed: int, num_shards: int, shard_id: int) -> None:
    driver = Driver(seed, num_shards, shard_id, capacity_blocks=1500)
    driver.run(1200)
    assert driver.num_hits > 500 and driver.num_evicted > 0 and driver.num_removed > 0
    assert driver.num_tombstones_told > 0  # a match told an evicted block's tombstone


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_tight_capacity_evicts_and_compacts_as_the_reference(backend: bool) -> None:
    driver = Driver(7, 1, 0, capacity_blocks=200)
    driver.run(1500)
    assert driver.index.counters.num_evicted_capacity > 0 and driver.num_hits > 100


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_a_large_table_grows_compacts_and_answers_the_same(backend: bool) -> None:
    """Thousands of rows (the index grows several times), then a compaction after a mass
    removal: the rows move down in order, with their locations, and stay findable."""
    table = TierTable("ssd", 1 << 62, TTL_S)
    rng = np.random.default_rng(5)
    hashes = rng.integers(0, 1 << 64, 80_000, dtype=np.uint64)
    for start in range(0, len(hashes), 64):
        chunk = hashes[start : start + 64].tolist()
        blocks = tuple(StoredBlock(h, 1, start + i, 7, 100) for i, h in enumerate(chunk))
        assert table.put_blocks(blocks, writer=start // 64 % 3, now=0.0) == len(blocks)
    assert len(table) == 80_000 and table.used_bytes == 8_000_000
    assert (table.find_many(hashes) == np.arange(80_000)).all()
    gone = np.flatnonzero(rng.random(80_000) < 0.5)
    table.remove_rows(gone)
    assert table.num_rows == len(table) == 80_000 - len(gone)  # compacted: no holes left
    rows = table.find_many(hashes)
    assert (rows[gone] == -1).all()
    kept = np.setdiff1d(np.arange(80_000), gone)
    assert (table.hash[rows[kept]] == hashes[kept]).all()
    assert (table.slot[rows[kept]] == kept).all()  # locations moved with their rows
    assert (np.diff(rows[kept]) == 1).all()  # still in stored order
    num_hits, writers, columns = table.answer(hashes[kept][:300], now=1.0)
    assert num_hits == 300 and writers == [0, 1, 2]  # its events came from 3 writers
    assert (np.frombuffer(columns["slots"], "<u4") == kept[:300]).all()


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_prefix_of_a_fragmented_chain_finds_every_run(backend: bool) -> None:
    """A prefix stored one block per event, between other writers' events: no run is longer
    than a block (the dict index looks the rest up at once after a few runs)."""
    table = TierTable("ssd", 1 << 62, TTL_S)
    chain = BlockHasher("m", block_size_tokens=2).hashes(range(2 * 100))
    for i, h in enumerate(chain):
        table.put_blocks((StoredBlock(h, 0, i, 1, 10),), writer=0, now=0.0)
        table.put_blocks((StoredBlock(random.getrandbits(64), 0, i, 1, 10),), writer=1, now=0.0)
    keys = np.array(chain + [12345], np.uint64)
    num_hits, writers, columns = table.answer(keys, now=1.0)
    assert num_hits == 100 and writers == [0]
    assert (np.frombuffer(columns["slots"], "<u4") == np.arange(100)).all()
    assert columns["block_hashes"] == np.array(chain, "<u8").tobytes()
    table.remove_rows(table.find_many(keys[60:61]))
    assert table.answer(keys, now=2.0)[0] == 60


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_ticks_shift_down_when_time_runs_past_their_range(backend: bool) -> None:
    index = KvIndex(capacity_bytes={"ssd": 10**9}, ttl_s=100.0)
    hashes = BlockHasher("m", block_size_tokens=2).hashes(range(20))
    blocks = tuple(StoredBlock(h, 0, i, 1, 10) for i, h in enumerate(hashes))
    index.apply(
        KvEventBatch(writer_id="w", seq=1, ts_ms=0, events=(BlocksStored("ssd", blocks),)), 0.0
    )
    for now in (150.0, 300.0, 450.0):  # each far past the 4 TTLs a tick range spans
        assert index.match(hashes[:5], now)[0].first_miss_index == 5
    removals = index.evict(460.0)  # blocks 0-4 read at 450: kept; 5-9 last seen at 0: gone
    assert sorted(h for r in removals for h in r.block_hashes) == sorted(hashes[5:])
    assert len(index.tables["ssd"]) == 5


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize(
    ("bad", "field"),
    [
        (StoredBlock(1, 1 << 32, 0, 0, 10), "file_id"),
        (StoredBlock(1, 0, -1, 0, 10), "slot"),
        (StoredBlock(1, 0, 0, "7", 10), "generation"),  # type: ignore[arg-type]
        (StoredBlock(1 << 64, 0, 0, 0, 10), "block_hash"),
        (StoredBlock(1, 0, 0, 0, 1 << 40), "num_bytes"),
    ],
)
def test_out_of_range_blocks_are_rejected_whole(bad: StoredBlock, field: str) -> None:
    table = TierTable("ssd", 1 << 62, TTL_S)
    good = StoredBlock(2, 0, 0, 0, 10)
    with pytest.raises(ValueError, match=field):
        table.put_blocks((good, bad), writer=0, now=0.0)
    assert len(table) == 0 and table.used_bytes == 0


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_a_large_snapshot_restores_every_row(backend: bool) -> None:
    index = KvIndex(capacity_bytes={"ssd": 1 << 62}, ttl_s=TTL_S)
    chain = BlockHasher("m", block_size_tokens=2).hashes(range(2 * 30_000))
    for seq, start in enumerate(range(0, len(chain), 500), start=1):
        blocks = tuple(
            StoredBlock(h, 2, start + i, 3, 10) for i, h in enumerate(chain[start : start + 500])
        )
        index.apply(
            KvEventBatch(writer_id="w", seq=seq, ts_ms=0, events=(BlocksStored("ssd", blocks),)),
            float(seq),
        )
    copy = KvIndex(capacity_bytes={"ssd": 1 << 62}, ttl_s=TTL_S)
    copy.restore(index.snapshot())
    assert len(copy.tables["ssd"]) == 30_000
    assert copy.match(chain, 100.0) == index.match(chain, 100.0)
    assert copy.match(chain, 100.0)[0].first_miss_index == 30_000
