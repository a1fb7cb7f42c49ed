from __future__ import annotations

import pytest

from services.swa_memcache.cache import Snapshot, SnapshotCache, checksum


def test_hit_miss_and_ttl_expiry() -> None:
    cache = SnapshotCache(capacity_bytes=100, ttl_s=180)
    assert cache.put(1, b"x" * 10, now=0)
    assert cache.get(1, now=179.9) == b"x" * 10
    assert cache.get(1, now=180.0) is None  # expired at exactly its TTL
    assert cache.get(2, now=0) is None
    c = cache.counters
    assert (c.num_hits, c.num_misses, c.num_expired) == (1, 2, 1)
    assert cache.used_bytes == 0


def test_capacity_evicts_least_recently_used() -> None:
    cache = SnapshotCache(capacity_bytes=30, ttl_s=180)
    for key in (1, 2, 3):
        cache.put(key, b"." * 10, now=key)
    cache.get(1, now=4)  # 1 is now more recent than 2
    cache.put(4, b"." * 10, now=5)
    assert cache.contains(1, now=5) and not cache.contains(2, now=5)
    assert cache.counters.num_evicted == 1 and cache.used_bytes == 30
    assert not cache.put(5, b"." * 31, now=6)  # larger than everything: refused, nothing lost
    assert cache.counters.num_rejected == 1 and len(cache) == 3


def test_put_replaces_and_sweep_returns_memory() -> None:
    cache = SnapshotCache(capacity_bytes=100, ttl_s=10)
    cache.put(1, b"a" * 40, now=0)
    cache.put(1, b"b" * 20, now=5)
    assert cache.used_bytes == 20 and cache.get(1, now=14) == b"b" * 20
    cache.put(2, b"c", now=0)
    assert cache.expire(now=12) == 1 and len(cache) == 1  # 2 expired at 10, 1 lives to 15
    with pytest.raises(ValueError):
        SnapshotCache(capacity_bytes=0, ttl_s=1)


def test_reservation_is_invisible_until_committed_and_abort_returns_it() -> None:
    cache = SnapshotCache(capacity_bytes=100, ttl_s=10)
    cache.put(1, b"a" * 40, now=0)
    region = cache.reserve(50, now=1)  # a put whose bytes are still arriving
    assert region is not None and cache.used_bytes == 90
    cache.view(region)[:] = 7
    assert not cache.contains(2, now=1) and cache.get(1, now=1) == b"a" * 40
    cache.commit(2, region, checksum(b"\x07" * 50), now=2)
    found = cache.find(2, now=2)
    assert found is not None and found.checksum == checksum(b"\x07" * 50)
    assert cache.get(2, now=2) == b"\x07" * 50
    failed = cache.reserve(10, now=3)
    assert failed is not None
    cache.abort(failed)  # a failed pull: nothing stored, the room is back
    assert len(cache) == 2 and cache.used_bytes == 90 and cache.counters.num_puts == 2


def test_pinned_entry_survives_eviction_until_its_lease_ends() -> None:
    cache = SnapshotCache(capacity_bytes=30, ttl_s=180)
    cache.put(1, b"1" * 10, now=0)
    snapshot = cache.find(1, now=0)
    assert snapshot is not None
    lease_id = cache.pin(snapshot, now=0, lease_s=5)
    for key in (2, 3, 4, 5):  # a flood: 1 is least recent, but pinned
        assert cache.put(key, bytes([key]) * 10, now=1 + key / 10)
    assert cache.contains(1, now=2) and cache.view(snapshot).tobytes() == b"1" * 10
    assert cache.counters.num_evicted == 2  # 2 and 3 went instead
    assert cache.release(lease_id, now=3) and cache.num_pinned == 0
    assert cache.put(6, b"6" * 10, now=4) and not cache.contains(1, now=4)  # evictable again


def test_lease_running_out_unpins_and_everything_pinned_refuses() -> None:
    cache = SnapshotCache(capacity_bytes=20, ttl_s=180)
    for key in (1, 2):
        cache.put(key, b"." * 10, now=0)
        found = cache.find(key, now=0)
        assert found is not None
        cache.pin(found, now=0, lease_s=5)
    assert cache.reserve(10, now=1) is None and cache.counters.num_no_room == 1
    assert not cache.put(3, b"." * 10, now=1) and len(cache) == 2
    assert cache.put(3, b"." * 10, now=5)  # both leases ran out at 5: 1 is evicted
    assert cache.num_pinned == 0 and not cache.contains(1, now=5)
    assert not cache.release(1, now=6)  # already over


def test_replaced_or_expired_while_pinned_keeps_bytes_until_release() -> None:
    cache = SnapshotCache(capacity_bytes=40, ttl_s=10)
    cache.put(1, b"old" * 5, now=0)
    old = cache.find(1, now=0)
    assert old is not None
    lease_id = cache.pin(old, now=0, lease_s=5)
    assert cache.put(1, b"new" * 5, now=1)  # new bytes elsewhere, old range retired
    assert cache.get(1, now=1) == b"new" * 5 and cache.view(old).tobytes() == b"old" * 5
    assert cache.used_bytes == 30
    assert cache.release(lease_id, now=2) and cache.used_bytes == 15
    newer = cache.find(1, now=2)
    assert newer is not None
    cache.pin(newer, now=2, lease_s=100)
    assert cache.expire(now=11) == 1 and len(cache) == 0  # TTL wins for new gets...
    assert cache.used_bytes == 15  # ...but the reader's range stays until its lease ends
    assert cache.expire(now=102) == 0 and cache.used_bytes == 0
    with pytest.raises(ValueError):
        cache.pin(Snapshot(0, 0, 0), now=0, lease_s=1)


def test_changes_are_net_per_key_since_the_last_take() -> None:
    cache = SnapshotCache(capacity_bytes=100, ttl_s=10)
    assert cache.take_changes() == ([], [])
    cache.put(1, b"a" * 10, now=0)
    cache.put(2, b"b" * 10, now=0)
    cache.put(1, b"c" * 10, now=1)  # replaced: still one key held, added once
    assert cache.take_changes() == ([1, 2], [])
    assert cache.take_changes() == ([], [])  # taken: nothing new
    cache.put(1, b"d" * 10, now=2)  # replaced again: held before and after
    cache.put(3, b"e" * 10, now=2)
    cache.put(3, b"f" * 10, now=2)
    assert cache.take_changes() == ([3], [])
    cache.put(4, b"g" * 10, now=3)
    assert cache.get(2, now=10) is None  # TTL: dropped by the lookup
    assert cache.take_changes() == ([4], [2])


def test_ttl_sweep_and_lru_eviction_are_removals() -> None:
    cache = SnapshotCache(capacity_bytes=30, ttl_s=10)
    for key in (1, 2, 3):
        cache.put(key, b"." * 10, now=key)
    cache.take_changes()
    cache.put(4, b"." * 10, now=4)  # full: the least recently used (1) goes
    assert cache.take_changes() == ([4], [1])
    assert cache.expire(now=12.5) == 1  # 2 expired at 12; 3 lives to 13
    assert cache.take_changes() == ([], [2])


def test_a_key_added_and_dropped_between_takes_is_not_reported() -> None:
    cache = SnapshotCache(capacity_bytes=10, ttl_s=10)
    cache.put(1, b"." * 10, now=0)
    cache.put(2, b"." * 10, now=1)  # evicts 1, which nobody was told of
    assert cache.take_changes() == ([2], [])
    region = cache.reserve(10, now=2)  # a NIXL put making room: 2 goes
    assert region is not None
    cache.abort(region)  # the pull failed: nothing stored, 2 still gone
    assert cache.take_changes() == ([], [2])


def test_full_state_sweeps_first_and_counts_changes_from_it() -> None:
    cache = SnapshotCache(capacity_bytes=100, ttl_s=10)
    cache.put(1, b"." * 10, now=0)
    cache.put(2, b"." * 10, now=5)
    cache.put(3, b"." * 10, now=5)
    assert cache.keys(now=12) == [2, 3]  # 1 is past its TTL, not yet swept
    assert cache.take_state(now=12) == [2, 3]
    assert len(cache) == 2 and cache.counters.num_expired == 1  # the state swept it
    assert cache.take_changes() == ([], [])  # what changed before the state is in it
    cache.put(1, b"." * 10, now=12)
    cache.get(3, now=16)  # expired: dropped
    assert cache.take_changes() == ([1], [3])
    cache.put(4, b"." * 10, now=16)
    assert cache.take_state(now=100) == []
    assert cache.take_changes() == ([], [])  # 4 came and went before the state
