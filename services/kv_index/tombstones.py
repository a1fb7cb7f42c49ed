"""What kv-index evicted, kept so a later miss can say so: hash -> tier, why, when, and how
long the block had gone unused then (services/ingress/diagnosis.py names the cause `evicted`).

Bounded and lossy by design, as a cache is: `capacity` entries in numpy columns, each hash
in the slot `(hash // num_shards) % capacity` (this shard's hashes share a residue mod
num_shards, so that part is divided out first). A new tombstone overwrites whatever the slot
held; a lookup answers only when the slot still holds that very hash. 22 bytes an entry and
nothing else (`nbytes`): the default 1,048,576 entries take 22 MiB per shard, and keep the
last evictions of a shard that evicts up to about that many blocks between a block's
eviction and the turn that misses it (the chance a tombstone survives n newer ones is
(1 - 1/capacity)^n: 61 % after 0.5 M, 37 % after 1 M).

The idle time is the index's: to a tick (ttl / 16384, 5.3 s at the default day), and a
block unused for over two TTLs is told as idle for at least that long (older ticks clamp).

A tombstone is not cleared when its block is stored again: only a miss is looked up, and a
block stored again and evicted again gets a newer one. Tombstones live in memory only: a
restarted shard has none (its snapshot keeps what is cached, not what left).
"""

from __future__ import annotations

import numpy as np

from shared.schema.inference import Eviction

REASONS = ("ttl", "capacity", "admin", "removed")  # removed: its writer logged the removal
DEFAULT_CAPACITY = 1 << 20
ENTRY_BYTES = 8 + 8 + 4 + 1 + 1  # hash, evicted_at, idle_s, tier, reason


class Tombstones:
    def __init__(self, capacity: int = DEFAULT_CAPACITY, num_shards: int = 1) -> None:
        if capacity <= 0:
            raise ValueError(f"tombstone capacity must be > 0, got {capacity}")
        self.capacity, self.num_shards = capacity, num_shards
        self.hash = np.zeros(capacity, np.uint64)
        self.evicted_at = np.zeros(capacity, np.float64)  # epoch seconds; 0: an empty slot
        self.idle_s = np.zeros(capacity, np.float32)
        self.tier = np.zeros(capacity, np.uint8)
        self.reason = np.zeros(capacity, np.uint8)
        self.tiers: list[str] = []  # tier names by number (a handful)
        self.num_added = 0

    @property
    def nbytes(self) -> int:
        columns = (self.hash, self.evicted_at, self.idle_s, self.tier, self.reason)
        return sum(c.nbytes for c in columns)

    def __len__(self) -> int:
        return int(np.count_nonzero(self.evicted_at))

    def _slots(self, hashes: np.ndarray) -> np.ndarray:
        return (hashes // np.uint64(self.num_shards)) % np.uint64(self.capacity)

    def _tier_number(self, tier: str) -> int:
        if tier not in self.tiers:
            if len(self.tiers) == 255:
                raise ValueError("more than 255 tiers")
            self.tiers.append(tier)
        return self.tiers.index(tier)

    def add(
        self,
        tier: str,
        reason: str,
        hashes: np.ndarray,
        evicted_at: float,
        last_used: np.ndarray | float,
    ) -> None:
        """Blocks evicted from `tier` at `evicted_at`, last used at `last_used` (seconds)."""
        hashes = np.asarray(hashes, dtype=np.uint64)
        if not len(hashes):
            return
        slots = self._slots(hashes)
        self.hash[slots] = hashes
        self.evicted_at[slots] = evicted_at
        self.idle_s[slots] = np.maximum(evicted_at - np.asarray(last_used, np.float64), 0.0)
        self.tier[slots] = self._tier_number(tier)
        self.reason[slots] = REASONS.index(reason)
        self.num_added += len(hashes)

    def get(self, block_hash: int, tier: str | None = None) -> Eviction | None:
        """The block's latest tombstone (of `tier` only, when given), if still kept."""
        slot = int(self._slots(np.array([block_hash], np.uint64))[0])
        if self.evicted_at[slot] == 0 or int(self.hash[slot]) != block_hash:
            return None
        if tier is not None and self.tiers[self.tier[slot]] != tier:
            return None
        return Eviction(
            tier=self.tiers[self.tier[slot]],
            reason=REASONS[self.reason[slot]],
            evicted_ms=int(self.evicted_at[slot] * 1000),
            idle_s=round(float(self.idle_s[slot]), 1),
        )
