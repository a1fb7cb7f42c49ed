"""A RAM store of sliding-window snapshots: TTL (180 s by default) and capacity-bounded LRU.

Pure and synchronous. Agent steps come back within minutes (>98% hit in production,
docs/design.md, 'Sliding-window state'), so a short TTL keeps the RAM for the sessions that
are still live; the capacity bound evicts the least recently used first when a burst of
sessions overflows it.

The bytes live in one buffer of `capacity_bytes` (the memcache registers it with NIXL, so a
peer reads a snapshot where it lies), carved up by `Arena`. Two more states protect bytes a
peer is moving:
- a reservation (`reserve` -> `commit` | `abort`) is space a put is still filling; it is in
  no index, so nothing reads it half-written and nothing evicts it;
- a lease (`pin` -> `release` or its time running out) keeps an entry's range allocated and
  unchanged while a reader pulls it. A pinned entry is never evicted; one replaced or
  expired while pinned leaves the index at once (new gets miss) and its range is retired,
  freed when the last lease on it ends.

The cache also records which keys entered or left the index (a commit; a drop by TTL in
`find` or `expire`, by LRU in `reserve`, by a put replacing it) so that `events.py` can tell
the routers what this node holds: `take_changes` hands out the net change per key since the
last take (a key put and dropped again in between is not reported; a replaced key neither,
it is still held), `take_state` the full state (after a sweep) from which the next count.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import xxhash

from services.swa_memcache.arena import Arena, Region


@dataclass
class Counters:
    num_hits: int = 0
    num_misses: int = 0
    num_expired: int = 0
    num_evicted: int = 0
    num_puts: int = 0
    num_rejected: int = 0  # larger than the whole capacity
    num_no_room: int = 0  # no contiguous room even after evicting every unpinned entry
    num_leases: int = 0
    num_held: int = 0  # snapshots kept past their TTL for a staged session


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Where an entry's bytes lie in `SnapshotCache.buffer`, and their XXH3-64."""

    offset: int
    nbytes: int
    checksum: int


@dataclass(frozen=True, slots=True)
class _Entry:
    region: Region
    checksum: int
    expires_at: float


def checksum(data: bytes | memoryview | np.ndarray) -> int:
    return xxhash.xxh3_64_intdigest(data)


class SnapshotCache:
    def __init__(self, capacity_bytes: int, ttl_s: float) -> None:
        if capacity_bytes <= 0 or ttl_s <= 0:
            raise ValueError("capacity_bytes and ttl_s must be positive")
        self.capacity_bytes = capacity_bytes
        self.ttl_s = ttl_s
        self.counters = Counters()
        # np.empty maps pages lazily: an 8 GiB capacity costs RAM only as snapshots arrive.
        self.buffer = np.empty(capacity_bytes, dtype=np.uint8)
        self._arena = Arena(capacity_bytes)
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # least recently used first
        self._leases: dict[int, tuple[int, float]] = {}  # lease id -> (region offset, until)
        self._num_leases_by_offset: dict[int, int] = {}
        self._retired: dict[int, Region] = {}  # out of the index, still pinned
        self._next_lease_id = 1
        # Key -> whether it was in the index at the last take (set when first touched since).
        self._touched: dict[int, bool] = {}

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def used_bytes(self) -> int:
        """Arena bytes in use: entries, reservations being filled, retired pinned ranges."""
        return self._arena.used_bytes

    @property
    def num_pinned(self) -> int:
        return len(self._num_leases_by_offset)

    # -- reading -------------------------------------------------------------------------
    def find(self, key: int, now: float) -> Snapshot | None:
        """A counted lookup that refreshes the entry's recency (a get without the copy)."""
        entry = self._entries.get(key)
        if entry is None:
            self.counters.num_misses += 1
            return None
        if entry.expires_at <= now:
            self._drop(key, now)
            self.counters.num_expired += 1
            self.counters.num_misses += 1
            return None
        self._entries.move_to_end(key)
        self.counters.num_hits += 1
        return Snapshot(entry.region.offset, entry.region.nbytes, entry.checksum)

    def get(self, key: int, now: float) -> bytes | None:
        snapshot = self.find(key, now)
        return None if snapshot is None else self.view(snapshot).tobytes()

    def view(self, where: Snapshot | Region) -> np.ndarray:
        return self.buffer[where.offset : where.offset + where.nbytes]

    def contains(self, key: int, now: float) -> bool:
        """Whether a get would hit, without counting or refreshing (an operator's question;
        routers learn what we hold from `events.py`)."""
        entry = self._entries.get(key)
        return entry is not None and entry.expires_at > now

    def keys(self, now: float) -> list[int]:
        """Every key a get would hit at `now`."""
        return [key for key, entry in self._entries.items() if entry.expires_at > now]

    # -- what changed ----------------------------------------------------------------------
    def take_changes(self) -> tuple[list[int], list[int]]:
        """(added, removed): the keys that entered or left the index since the last take."""
        added = [k for k, was_held in self._touched.items() if not was_held and k in self._entries]
        removed = [
            k for k, was_held in self._touched.items() if was_held and k not in self._entries
        ]
        self._touched.clear()
        return added, removed

    def take_state(self, now: float) -> list[int]:
        """Every key held, after a sweep (so that the state and the index agree: no entry
        past its TTL is left to be reported later), and count the next changes from it."""
        self.expire(now)
        self._touched.clear()
        return list(self._entries)

    def pin(self, snapshot: Snapshot, now: float, lease_s: float) -> int:
        """Keep `snapshot`'s bytes in place for `lease_s` (a peer pulls them); the lease id."""
        if snapshot.nbytes == 0:
            raise ValueError("an empty snapshot has no bytes to pin: it travels inline")
        lease_id = self._next_lease_id
        self._next_lease_id += 1
        self._leases[lease_id] = (snapshot.offset, now + lease_s)
        self._num_leases_by_offset[snapshot.offset] = (
            self._num_leases_by_offset.get(snapshot.offset, 0) + 1
        )
        self.counters.num_leases += 1
        return lease_id

    def release(self, lease_id: int, now: float) -> bool:
        """End a lease early; whether it was still held (False: it had run out)."""
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return False
        self._unpin(lease[0])
        self._reclaim(now)
        return lease[1] > now

    # -- writing -------------------------------------------------------------------------
    def put(self, key: int, data: bytes, now: float) -> bool:
        if len(data) > self.capacity_bytes:
            self.counters.num_rejected += 1
            return False
        if key in self._entries:
            self._drop(key, now)
        region = self.reserve(len(data), now)
        if region is None:
            return False
        self.view(region)[:] = np.frombuffer(data, dtype=np.uint8)
        self.commit(key, region, checksum(data), now)
        return True

    def reserve(self, nbytes: int, now: float) -> Region | None:
        """Room for `nbytes`, evicting least recently used unpinned entries as needed; None
        when the snapshot is larger than the capacity or no room can be made."""
        if nbytes > self.capacity_bytes:
            self.counters.num_rejected += 1
            return None
        self._reclaim(now)
        while (region := self._arena.allocate(nbytes)) is None:
            victim = next((k for k, e in self._entries.items() if not self._is_pinned(e)), None)
            if victim is None:
                self.counters.num_no_room += 1
                return None
            self._drop(victim, now)
            self.counters.num_evicted += 1
        return region

    def commit(self, key: int, region: Region, snapshot_checksum: int, now: float) -> None:
        """Publish a filled reservation as `key` (replacing an older entry)."""
        if key in self._entries:
            self._drop(key, now)
        self._touched.setdefault(key, False)
        self._entries[key] = _Entry(region, snapshot_checksum, now + self.ttl_s)
        self.counters.num_puts += 1

    def hold(self, key: int, until: float, now: float) -> bool:
        """Keep the entry until `until` at least (past its TTL: a session staged over a tool
        call); refreshes its recency. False when it is not here."""
        entry = self._entries.get(key)
        if entry is None or entry.expires_at <= now:
            return False
        if until > entry.expires_at:
            self._entries[key] = _Entry(entry.region, entry.checksum, until)
        self._entries.move_to_end(key)
        self.counters.num_held += 1
        return True

    def abort(self, region: Region) -> None:
        """Give back a reservation that will not be committed (a failed pull)."""
        self._arena.free(region)

    def expire(self, now: float) -> int:
        """Drop every expired entry and ended lease (a sweep, so idle memory is returned)."""
        expired = [key for key, entry in self._entries.items() if entry.expires_at <= now]
        for key in expired:
            self._drop(key, now)
        self.counters.num_expired += len(expired)
        self._reclaim(now)
        return len(expired)

    # -- internals -----------------------------------------------------------------------
    def _is_pinned(self, entry: _Entry) -> bool:
        return entry.region.nbytes > 0 and entry.region.offset in self._num_leases_by_offset

    def _drop(self, key: int, now: float) -> None:
        entry = self._entries.pop(key)
        self._touched.setdefault(key, True)
        if self._is_pinned(entry):
            self._retired[entry.region.offset] = entry.region
        else:
            self._arena.free(entry.region)

    def _unpin(self, offset: int) -> None:
        remaining = self._num_leases_by_offset[offset] - 1
        if remaining:
            self._num_leases_by_offset[offset] = remaining
            return
        del self._num_leases_by_offset[offset]
        retired = self._retired.pop(offset, None)
        if retired is not None:
            self._arena.free(retired)

    def _reclaim(self, now: float) -> None:
        ended = [lease_id for lease_id, (_, until) in self._leases.items() if until <= now]
        for lease_id in ended:
            self._unpin(self._leases.pop(lease_id)[0])
