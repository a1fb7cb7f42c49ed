"""One tier of the index: block hash -> location, as numpy columns of 24 bytes a row plus a
hash index of 4-byte slots (services/kv_index/row_index.py); ~30 bytes a block in all, where
a dict of rows took ~113 (measured by loadtest/bench_kv_index.py).

A row is the hash (8 bytes), the slot's file, slot and generation (4 each), a kind (2) and
the last access (2). The kind numbers a (writer, block size) pair, so neither is stored per
row; kind 0 marks a free row. The last access is a tick of ttl/16384 (5.3 s at the default
day): LRU order and TTL are kept to that resolution, ties in row order. 65,536 ticks span 4
TTLs, the first event's time in the middle; when time runs past them they shift down by 2
TTLs (older ticks clamp to 0, long expired).

Rows are handed out in order and never reused in place: one event's blocks stay consecutive
rows, which is what lets a match verify a whole stored run with one comparison. Removed rows
are holes until they pass an eighth of the rows; then the live rows move down in order
(compaction) and the index is rebuilt. Columns grow in place by 1/16, at least 64K rows
(ndarray.resize: realloc, which large arrays get without a copy); the index makes its own
room (row_index.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import groupby
from operator import attrgetter
from typing import Any

import numpy as np

from services.kv_index import native
from services.kv_index.row_index import MIXED_SIZES, NEEDS_ROOM, U32_MAX, RowIndex

DAY_S = 86_400.0
TICKS_PER_TTL = 1 << 14
MAX_TICK = 0xFFFF
HALF_TICKS = (MAX_TICK + 1) // 2
NO_WRITER = 0xFFFF_FFFF
MAX_KINDS = 0xFFFF  # kind 0 is the free row

_COLUMNS = {
    "hash": np.uint64,
    "kind": np.uint16,
    "file_id": np.uint32,
    "slot": np.uint32,
    "generation": np.uint32,
    "access": np.uint16,
}
# The snapshot's columns: one per field, whatever the layout in memory.
SNAPSHOT_COLUMNS = {
    "block_hash": np.uint64,
    "writer": np.uint32,
    "file_id": np.uint32,
    "slot": np.uint32,
    "generation": np.uint32,
    "num_bytes": np.uint32,
    "last_access": np.float64,
}


class TierTable:
    def __init__(
        self,
        tier: str,
        capacity_bytes: int,
        ttl_s: float = DAY_S,
        initial_rows: int = 1024,
        *,
        use_native: bool | None = None,
    ) -> None:
        if not (ttl_s > 0 and math.isfinite(ttl_s)):
            raise ValueError(f"ttl_s must be a positive number, got {ttl_s}")
        self.tier = tier
        self.capacity_bytes = capacity_bytes
        self.tick_s = ttl_s / TICKS_PER_TTL
        self.tick_origin_s: float | None = None  # the time of tick 0, set by the first event
        for name, dtype in _COLUMNS.items():
            setattr(self, name, np.zeros(max(initial_rows, 1), dtype))
        self.kind_writer = np.array([NO_WRITER], np.uint32)
        self.kind_bytes = np.array([0], np.uint64)
        self._kinds: dict[tuple[int, int], int] = {}
        self._last_kind: dict[int, tuple[int, int]] = {}  # writer -> (num_bytes, kind)
        if use_native is None:
            use_native = native.available()
        self.index = native.NativeRowIndex() if use_native else RowIndex()
        self.index.bind(self)

    # declared for type checkers: set from _COLUMNS above
    hash: np.ndarray
    kind: np.ndarray
    file_id: np.ndarray
    slot: np.ndarray
    generation: np.ndarray
    access: np.ndarray

    def __len__(self) -> int:
        return self.index.num_live

    @property
    def used_bytes(self) -> int:
        return self.index.used_bytes

    @property
    def num_rows(self) -> int:
        return self.index.num_rows

    @property
    def nbytes(self) -> int:
        """Memory held by this table's arrays."""
        arrays = [getattr(self, name) for name in _COLUMNS]
        own = sum(a.nbytes for a in (*arrays, self.kind_writer, self.kind_bytes))
        return own + self.index.nbytes

    # -- time ------------------------------------------------------------------------------
    def tick(self, now: float) -> int:
        """`now` as an access tick, shifting every row's tick down when it runs past 65,535."""
        if self.tick_origin_s is None:  # the first time lands mid-range: earlier ones fit too
            self.tick_origin_s = now - HALF_TICKS * self.tick_s
        tick = math.floor((now - self.tick_origin_s) / self.tick_s)
        if tick > MAX_TICK:
            shift = tick - HALF_TICKS
            ticks = self.access[: self.num_rows].astype(np.int64) - shift
            self.access[: self.num_rows] = np.maximum(ticks, 0)
            self.tick_origin_s += shift * self.tick_s
            tick -= shift
        return max(tick, 0)

    def seconds(self, ticks: np.ndarray) -> np.ndarray:
        origin = self.tick_origin_s if self.tick_origin_s is not None else 0.0
        return origin + ticks.astype(np.float64) * self.tick_s

    # -- events ----------------------------------------------------------------------------
    def put_blocks(
        self,
        blocks: Sequence[Any],
        writer: int,
        now: float,
        num_shards: int = 1,
        shard_id: int = 0,
    ) -> int:
        """Index a writer's stored blocks (the ones this shard owns); returns how many."""
        if not blocks:
            return 0
        tick = self.tick(now)
        num_bytes, kind = self._last_kind.get(writer) or self._kind(writer, blocks[0].num_bytes)
        stored = self.index.put(blocks, num_bytes, kind, tick, num_shards, shard_id)
        if stored >= 0:
            return stored
        if stored == NEEDS_ROOM:
            self._reserve(len(blocks))
            stored = self.index.put(blocks, num_bytes, kind, tick, num_shards, shard_id)
        if stored == MIXED_SIZES:  # not this writer's last size: each run of one size in turn
            stored = 0
            for size, run in groupby(blocks, key=attrgetter("num_bytes")):
                _, kind = self._kind(writer, size)
                stored += self.index.put(tuple(run), size, kind, tick, num_shards, shard_id)
        return stored

    def remove_rows(self, rows: np.ndarray) -> None:
        """Forget live rows (unique); compacts the table when holes pass an eighth of it."""
        if len(rows):
            self.index.remove_rows(np.asarray(rows, np.int64))
            num_holes = self.num_rows - len(self)
            if num_holes > max(self.num_rows // 8, 1024):
                self.compact()

    def find_many(self, keys: np.ndarray) -> np.ndarray:
        return self.index.find_many(np.asarray(keys, np.uint64))

    def writers(self, rows: np.ndarray | slice) -> np.ndarray:
        return self.kind_writer[self.kind[rows]]

    def rows_of_writer(self, writer: int) -> np.ndarray:
        kinds = np.flatnonzero(self.kind_writer == writer)
        return np.flatnonzero(np.isin(self.kind[: self.num_rows], kinds))

    # -- questions -------------------------------------------------------------------------
    def answer(
        self, keys: np.ndarray, now: float, refresh: bool = True
    ) -> tuple[int, list[int], dict[str, bytes]]:
        """A match in this tier: how many of `keys` are here in a row from the first, the
        writers holding them, and their columns packed as BlockLocations carries them (the
        writer column numbering into those writers). `refresh` makes them recently used."""
        tick = self.tick(now) if refresh else -1
        keys = np.ascontiguousarray(keys, np.uint64)
        num_hits, hashes, kinds, file_ids, slots, generations = self.index.answer(keys, tick)
        # One kind, so one writer, needs no sort: compared as bytes (1 us, where numpy's
        # (kinds == kinds[0]).all() took 3.7 us on 1,200 rows).
        if num_hits and kinds == kinds[:2] * num_hits:
            kind = int.from_bytes(kinds[:2], "little")
            used = [int(self.kind_writer[kind])]
            writers = bytes(2 * num_hits)
            num_bytes = int(self.kind_bytes[kind]).to_bytes(4, "little") * num_hits
        else:
            kind_of = np.frombuffer(kinds, "<u2")
            unique, inverse = np.unique(self.kind_writer[kind_of], return_inverse=True)
            used = unique.tolist()
            writers = inverse.astype("<u2").tobytes()
            num_bytes = self.kind_bytes[kind_of].astype("<u4").tobytes()
        columns = {
            "block_hashes": hashes,
            "writers": writers,
            "file_ids": file_ids,
            "slots": slots,
            "generations": generations,
            "num_bytes": num_bytes,
        }
        return num_hits, used, columns

    def live_rows(self) -> np.ndarray:
        return np.flatnonzero(self.kind[: self.num_rows])

    def expired_rows(self, now: float, ttl_s: float) -> np.ndarray:
        """Live rows last accessed before `now - ttl_s`, to the tick."""
        threshold = self.tick(now) - math.ceil(ttl_s / self.tick_s - 1e-9)
        if threshold <= 0:
            return np.zeros(0, np.int64)
        live = self.live_rows()
        return live[self.access[live] < threshold]

    def oldest_first(self, rows: np.ndarray) -> np.ndarray:
        # A stable sort of 16-bit keys is a radix sort: linear, 10M rows in ~0.1 s.
        return rows[np.argsort(self.access[rows], kind="stable")]

    def rows_to_free(self, target_bytes: int, exclude: np.ndarray | None = None) -> np.ndarray:
        """The least recently used rows whose removal brings usage down to `target_bytes`
        (or as near as the rows not in `exclude` can)."""
        excess = self.used_bytes - target_bytes
        if excess <= 0:
            return np.zeros(0, np.int64)
        ordered = self.oldest_first(self.live_rows())
        if exclude is not None and len(exclude):
            ordered = ordered[~np.isin(ordered, exclude)]
        freed = np.cumsum(self.kind_bytes[self.kind[ordered]].astype(np.int64))
        count = int(np.searchsorted(freed, excess, side="left")) + 1
        return ordered[:count]

    # -- room ------------------------------------------------------------------------------
    def _reserve(self, num_blocks: int) -> None:
        needed = self.num_rows + num_blocks
        if needed > len(self.hash):  # steps of 1/16, at least 64K rows (each step zero-fills)
            self._resize_columns(max(needed, len(self.hash) + max(len(self.hash) // 16, 1 << 16)))
        self.index.reserve(len(self) + num_blocks)

    def _resize_columns(self, num_rows: int) -> None:
        for name in _COLUMNS:
            try:  # realloc: no copy of the data, zero-filled beyond it
                getattr(self, name).resize(num_rows, refcheck=True)
            except ValueError:  # someone holds a view of the column: copy it instead
                old = getattr(self, name)
                grown = np.zeros(num_rows, old.dtype)
                grown[: min(len(old), num_rows)] = old[:num_rows]
                setattr(self, name, grown)
        self.index.bind(self)

    def compact(self) -> None:
        """Move the live rows down, in order, over the holes, and tell the index."""
        live = self.live_rows()
        for name in _COLUMNS:
            getattr(self, name)[: len(live)] = getattr(self, name)[live]
            getattr(self, name)[len(live) : self.num_rows] = 0
        remap = np.full(self.num_rows, -1, np.int64)
        remap[live] = np.arange(len(live))
        self.index.num_rows = len(live)
        self.index.reindex(remap)
        if len(self.hash) > 2 * len(live) + 1024:  # give back what a mass eviction freed
            self._resize_columns(len(live) + len(live) // 16 + 1024)

    def _kind(self, writer: int, num_bytes: int) -> tuple[int, int]:
        if not isinstance(num_bytes, int) or not 0 <= num_bytes <= U32_MAX:
            raise ValueError(f"stored block num_bytes {num_bytes!r} is not in [0, 2**32)")
        kind = self._kinds.get((writer, num_bytes))
        if kind is None:
            kind = len(self.kind_writer)
            if kind > MAX_KINDS:
                raise ValueError(
                    f"tier {self.tier}: more than {MAX_KINDS} (writer, block size) pairs"
                )
            self._kinds[(writer, num_bytes)] = kind
            self.kind_writer = np.append(self.kind_writer, np.uint32(writer))
            self.kind_bytes = np.append(self.kind_bytes, np.uint64(num_bytes))
            self.index.bind(self)
        self._last_kind[writer] = (num_bytes, kind)
        return num_bytes, kind

    # -- snapshots -------------------------------------------------------------------------
    def to_columns(self) -> dict[str, bytes]:
        rows = self.live_rows()
        kinds = self.kind[rows]
        columns = {
            "block_hash": self.hash[rows],
            "writer": self.kind_writer[kinds],
            "file_id": self.file_id[rows],
            "slot": self.slot[rows],
            "generation": self.generation[rows],
            "num_bytes": self.kind_bytes[kinds],
            "last_access": self.seconds(self.access[rows]),
        }
        return {
            name: columns[name].astype(dtype).tobytes() for name, dtype in SNAPSHOT_COLUMNS.items()
        }

    @classmethod
    def from_columns(
        cls,
        tier: str,
        capacity_bytes: int,
        columns: dict[str, bytes],
        ttl_s: float = DAY_S,
        *,
        use_native: bool | None = None,
    ) -> TierTable:
        arrays = {
            name: np.frombuffer(columns[name], dtype) for name, dtype in SNAPSHOT_COLUMNS.items()
        }
        num_rows = len(arrays["block_hash"])
        table = cls(tier, capacity_bytes, ttl_s, initial_rows=num_rows, use_native=use_native)
        pairs = np.stack([arrays["writer"], arrays["num_bytes"]], axis=1).astype(np.int64)
        unique, inverse = np.unique(pairs, axis=0, return_inverse=True)
        kinds = np.array([table._kind(int(w), int(n))[1] for w, n in unique], np.uint16)
        table.hash[:num_rows] = arrays["block_hash"]
        table.kind[:num_rows] = kinds[inverse.reshape(-1)] if num_rows else 0
        table.file_id[:num_rows] = arrays["file_id"]
        table.slot[:num_rows] = arrays["slot"]
        table.generation[:num_rows] = arrays["generation"]
        if num_rows:
            last_access = arrays["last_access"]
            table.tick_origin_s = float(last_access.max()) - HALF_TICKS * table.tick_s
            ticks = np.floor((last_access - table.tick_origin_s) / table.tick_s)
            table.access[:num_rows] = np.clip(ticks, 0, MAX_TICK)
        table.index.num_rows = table.index.num_live = num_rows
        table.index.used_bytes = int(arrays["num_bytes"].astype(np.int64).sum())
        table.index.reindex()
        return table
