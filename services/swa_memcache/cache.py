"""A RAM store of sliding-window snapshots: TTL (180 s by default) and capacity-bounded LRU.

Pure and synchronous. Agent steps come back within minutes (>98% hit in production, DESIGN.md
section 5), so a short TTL keeps the RAM for the sessions that are still live; the capacity
bound evicts the least recently used first when a burst of sessions overflows it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class Counters:
    num_hits: int = 0
    num_misses: int = 0
    num_expired: int = 0
    num_evicted: int = 0
    num_puts: int = 0
    num_rejected: int = 0  # larger than the whole capacity


@dataclass(frozen=True)
class _Entry:
    data: bytes
    expires_at: float


class SnapshotCache:
    def __init__(self, capacity_bytes: int, ttl_s: float) -> None:
        if capacity_bytes <= 0 or ttl_s <= 0:
            raise ValueError("capacity_bytes and ttl_s must be positive")
        self.capacity_bytes = capacity_bytes
        self.ttl_s = ttl_s
        self.used_bytes = 0
        self.counters = Counters()
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # least recently used first

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: int, now: float) -> bytes | None:
        entry = self._entries.get(key)
        if entry is None:
            self.counters.num_misses += 1
            return None
        if entry.expires_at <= now:
            self._drop(key)
            self.counters.num_expired += 1
            self.counters.num_misses += 1
            return None
        self._entries.move_to_end(key)
        self.counters.num_hits += 1
        return entry.data

    def contains(self, key: int, now: float) -> bool:
        """Whether a get would hit, without counting or refreshing (router's question)."""
        entry = self._entries.get(key)
        return entry is not None and entry.expires_at > now

    def put(self, key: int, data: bytes, now: float) -> bool:
        if len(data) > self.capacity_bytes:
            self.counters.num_rejected += 1
            return False
        if key in self._entries:
            self._drop(key)
        while self.used_bytes + len(data) > self.capacity_bytes:
            oldest = next(iter(self._entries))
            self._drop(oldest)
            self.counters.num_evicted += 1
        self._entries[key] = _Entry(data, now + self.ttl_s)
        self.used_bytes += len(data)
        self.counters.num_puts += 1
        return True

    def expire(self, now: float) -> int:
        """Drop every expired entry (a sweep, so idle memory is returned)."""
        expired = [key for key, entry in self._entries.items() if entry.expires_at <= now]
        for key in expired:
            self._drop(key)
        self.counters.num_expired += len(expired)
        return len(expired)

    def _drop(self, key: int) -> None:
        self.used_bytes -= len(self._entries.pop(key).data)
