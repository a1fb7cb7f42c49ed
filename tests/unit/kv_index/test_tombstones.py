"""Tombstones: bounded, lossy by slot, 22 bytes an entry, by tier and reason."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from services.kv_index.tombstones import ENTRY_BYTES, Tombstones


def test_a_tombstone_says_tier_reason_when_and_how_long_unused() -> None:
    stones = Tombstones(capacity=1024)
    stones.add("ssd", "ttl", np.array([7, 9], np.uint64), 1_000.5, np.array([400.0, 990.0]))
    assert len(stones) == 2 and stones.num_added == 2
    seven = stones.get(7)
    assert seven is not None
    assert (seven.tier, seven.reason, seven.evicted_ms, seven.idle_s) == (
        "ssd",
        "ttl",
        1_000_500,
        600.5,
    )
    assert stones.get(7, "ssd") == seven and stones.get(7, "dram") is None
    assert stones.get(8) is None  # never evicted


def test_a_newer_eviction_takes_the_slot_of_an_older_one() -> None:
    """Lossy by design: hashes a capacity apart share a slot (this shard's residue divided
    out first), and only the newest is kept; the other is then unknown, never misnamed."""
    num_shards, capacity, shard = 3, 64, 1
    old, new = 1 + 3 * 5, 1 + 3 * (5 + 64)  # both owned by shard 1, same slot
    stones = Tombstones(capacity=capacity, num_shards=num_shards)
    stones.add("ssd", "capacity", np.array([old], np.uint64), 10.0, 5.0)
    stones.add("dram", "admin", np.array([new], np.uint64), 20.0, 20.0)
    assert old % num_shards == new % num_shards == shard
    assert stones.get(old) is None
    found = stones.get(new)
    assert found is not None and (found.tier, found.reason, found.idle_s) == ("dram", "admin", 0.0)
    # Hashes one apart land in different slots: both kept.
    stones.add("ssd", "ttl", np.array([old, old + 3], np.uint64), 30.0, 0.0)
    assert stones.get(old) is not None and stones.get(old + 3) is not None


def test_memory_is_stated_and_allocated_once() -> None:
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        stones = Tombstones(capacity=1 << 16)
        after_init = tracemalloc.get_traced_memory()[0]
        hashes = np.arange(1, 200_001, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        stones.add("ssd", "capacity", hashes, 5.0, np.zeros(len(hashes)))
        del hashes
        after_use = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert stones.nbytes == ENTRY_BYTES * (1 << 16) == 22 * 65_536
    assert abs((after_init - before) - stones.nbytes) < 4096  # the columns, nothing else
    assert after_use - after_init < 4096  # adding 200,000 grew nothing: overwritten in place
    assert len(stones) <= 1 << 16


def test_a_capacity_must_be_positive() -> None:
    with pytest.raises(ValueError, match="must be > 0"):
        Tombstones(capacity=0)
