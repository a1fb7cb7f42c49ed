"""The hash -> row index of one tier, and the two hot paths that use it.

`TierTable` keeps a tier's blocks as rows of numpy columns (24 bytes a row); an index finds
a block's row from its hash. There are two, with the same methods and counters:

- `native.NativeRowIndex`: open addressing in C (row_index.c, built on first use), 4-byte
  slots at 60-85 % load: ~30 bytes a block in all, and the fast one.
- `RowIndex` (here): a dict, for a machine without a C compiler. Correct and simple, ~100
  bytes a block more (a dict entry and its int key).

What both do:

- `put(blocks, num_bytes, kind, tick, num_shards, shard_id)`: a `BlocksStored` event's
  blocks (the msgspec structs as decoded), checked first (ValueError naming the first bad
  field, nothing applied), then indexed in order: a known hash is updated in place, new ones
  take the next rows, so one event's blocks are consecutive rows. Returns how many blocks
  this shard owns; or, with nothing applied, MIXED_SIZES when a block's size is not
  `num_bytes` (the table then splits the event by size) or NEEDS_ROOM when the rows (or
  slots) reserved would not hold every block as a new one (the table reserves, then retries).
- `answer(keys, tick)`: a match: how many of `keys` are cached in a row, from the first,
  then their hash, kind, file, slot and generation columns as little-endian bytes (their
  last access set to `tick` unless it is negative). A prefix stored by one event costs one
  lookup and a walk of the rows after it: a chained hash names its whole prefix, so rows
  holding the request's next hashes are exactly its next blocks (a hash has one live row
  per tier); a key that breaks the run is looked up.
- `find_many`, `remove_rows`, `reserve` (room for more entries), `reindex` (after the table
  moved or loaded its rows), `nbytes`.
"""

from __future__ import annotations

import array
import sys
from collections.abc import Sequence
from itertools import chain, repeat
from typing import Any, Protocol

import msgspec
import numpy as np

MIXED_SIZES = -2
NEEDS_ROOM = -3
U32_MAX = 0xFFFF_FFFF
_FIELDS = ("block_hash", "file_id", "slot", "generation", "num_bytes")
_MAX_SCALAR_RUNS = 4  # runs after which a match looks the rest of its keys up at once


class Columns(Protocol):
    """What an index reads and writes of its table (TierTable): the row columns and the
    number of bytes of each kind."""

    hash: np.ndarray
    kind: np.ndarray
    file_id: np.ndarray
    slot: np.ndarray
    generation: np.ndarray
    access: np.ndarray
    kind_bytes: np.ndarray


class RowIndex:
    """The dict implementation. It reads the table's arrays through `table` at every call
    and keeps no reference of its own to them, so the table can resize them in place."""

    def __init__(self) -> None:
        self.table: Columns | None = None
        self.rows: dict[int, int] = {}
        self.num_rows = 0  # rows handed out, live or not (the next event's first row)
        self.num_live = 0
        self.used_bytes = 0

    def bind(self, table: Columns) -> None:
        self.table = table

    @property
    def nbytes(self) -> int:
        return sys.getsizeof(self.rows) + 36 * len(self.rows)  # the table and its int keys

    def find_many(self, keys: np.ndarray) -> np.ndarray:
        rows = map(self.rows.get, keys.tolist(), repeat(-1))
        return np.fromiter(rows, np.int64, count=len(keys))

    def answer(self, keys: np.ndarray, tick: int) -> tuple[int, bytes, bytes, bytes, bytes, bytes]:
        t = self._t
        rows = self._prefix_rows(keys)
        num_hits = rows.stop - rows.start if isinstance(rows, slice) else len(rows)
        if tick >= 0:
            t.access[rows] = tick
        columns = (t.hash, t.kind, t.file_id, t.slot, t.generation)
        little = (c[rows].astype(c.dtype.newbyteorder("<"), copy=False) for c in columns)
        return num_hits, *(column.tobytes() for column in little)

    def _prefix_rows(self, keys: np.ndarray) -> np.ndarray | slice:
        """The rows of the cached prefix of `keys`: a slice when one stored run holds it.
        Each run costs a lookup and one comparison of the rows after it."""
        t = self._t
        hashes, kinds, num_rows = t.hash, t.kind, self.num_rows
        runs: list[tuple[int, int]] = []  # (first row, length)
        i = 0
        while i < len(keys):
            if len(runs) == _MAX_SCALAR_RUNS:  # a fragmented prefix: the rest at once
                rows = self.find_many(keys[i:])
                missing = np.flatnonzero(rows < 0)
                tail = rows[: int(missing[0]) if len(missing) else len(rows)]
                return np.concatenate([*(np.arange(r, r + n) for r, n in runs), tail])
            row = self.rows.get(int(keys[i]))
            if row is None:
                break
            span = min(len(keys) - i, num_rows - row)
            same = (hashes[row : row + span] == keys[i : i + span]) & (kinds[row : row + span] != 0)
            runs.append((row, span if same.all() else int(same.argmin())))
            i += runs[-1][1]
        if len(runs) == 1:
            return slice(runs[0][0], runs[0][0] + runs[0][1])
        return np.concatenate([np.arange(r, r + n) for r, n in runs] or [np.zeros(0, np.int64)])

    def put(
        self,
        blocks: Sequence[Any],
        num_bytes: int,
        kind: int,
        tick: int,
        num_shards: int = 1,
        shard_id: int = 0,
    ) -> int:
        if not blocks:
            return 0
        if self.num_rows + len(blocks) > len(self._t.hash):
            return NEEDS_ROOM
        values = checked_columns(blocks)
        if (values[:, 4] != num_bytes).any():
            return MIXED_SIZES
        if num_shards > 1:
            values = values[values[:, 0] % np.uint64(num_shards) == shard_id]
        num_owned = len(values)
        first_new = next_row = self.num_rows
        rows = []
        for block_hash in values[:, 0].tolist():
            row = self.rows.get(block_hash)
            if row is None:
                row = self.rows[block_hash] = next_row
                next_row += 1
            rows.append(row)
        t = self._t
        at = np.array(rows, np.int64)
        if len(np.unique(at)) < len(at):  # a hash twice in one event: its last values win
            last = len(at) - 1 - np.unique(at[::-1], return_index=True)[1]
            at, values = at[last], values[last]
        replaced = at[at < first_new]
        self.used_bytes += len(at) * num_bytes - int(t.kind_bytes[t.kind[replaced]].sum())
        t.hash[at] = values[:, 0]
        t.kind[at] = kind
        t.file_id[at] = values[:, 1]
        t.slot[at] = values[:, 2]
        t.generation[at] = values[:, 3]
        t.access[at] = tick
        self.num_live += next_row - first_new
        self.num_rows = next_row
        return num_owned

    def remove_rows(self, rows: np.ndarray) -> None:
        t = self._t
        for block_hash in t.hash[rows].tolist():
            del self.rows[block_hash]
        self.used_bytes -= int(t.kind_bytes[t.kind[rows]].sum())
        t.kind[rows] = 0
        self.num_live -= len(rows)

    def reserve(self, num_entries: int) -> None:
        """A dict makes its own room."""

    def reindex(self, remap: np.ndarray | None = None) -> None:
        """After the table moved its rows or loaded them: the dict afresh from the rows."""
        t = self._t
        live = np.flatnonzero(t.kind[: self.num_rows])
        self.rows = dict(zip(t.hash[live].tolist(), live.tolist(), strict=True))

    @property
    def _t(self) -> Columns:
        if self.table is None:
            raise RuntimeError("RowIndex used before bind()")
        return self.table


def checked_columns(blocks: Sequence[Any]) -> np.ndarray:
    """The blocks' five fields as an (n, 5) uint64 array, or ValueError naming the first bad
    one. C-level throughout (astuple, chain, array): a Python loop over the blocks cost
    ~3x as much (measured on 64-block events)."""
    try:
        flat = array.array("Q", chain.from_iterable(map(msgspec.structs.astuple, blocks)))
    except (OverflowError, TypeError) as exc:
        raise ValueError(first_bad_field(blocks) or f"bad stored block: {exc}") from None
    values = np.frombuffer(flat, np.uint64).reshape(-1, 5).copy()
    if len(values) != len(blocks) or int(values[:, 1:].max()) > U32_MAX:
        raise ValueError(first_bad_field(blocks) or "bad stored block")
    return values


def first_bad_field(blocks: Sequence[Any]) -> str | None:
    for position, block in enumerate(blocks):
        for name in _FIELDS:
            value = getattr(block, name, None)
            bits = 64 if name == "block_hash" else 32
            if not isinstance(value, int) or value >> bits != 0:
                return (
                    f"stored block {position}: {name} {value!r} is not an integer in [0, 2**{bits})"
                )
    return None
