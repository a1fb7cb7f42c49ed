from __future__ import annotations

import pytest

from services.swa_memcache.cache import SnapshotCache


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
