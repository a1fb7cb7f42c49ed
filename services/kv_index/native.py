"""The C row index (row_index.c): compiled on first use with the system's C compiler against
this Python's headers, cached beside the CPU kernels (`shared.kernels.cpu.cache_dir()`) under a name
that hashes the source, the flags, the compiler and the Python version. Without a compiler
(or if the build fails) `available()` is False and tables use the dict index instead.

Why C: a `BlocksStored` event is a tuple of msgspec structs, and reading 64 of them field by
field in Python costs more than decoding them did (~15 us against ~14 us, measured); the C
`put` reads them from their slots, checks and indexes them in ~5 us. A match's answer is
written straight into the bytes BlockLocations carries. And a slot is 4 bytes where a dict
entry and its int key cost ~100: ~30 bytes a block in all at 10M blocks (tracemalloc).

Only TierTable changes the arrays C points into, and it calls `bind` after each change.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import math
import os
import shutil
import subprocess
import sysconfig
import tempfile
import threading
from pathlib import Path
from types import ModuleType

import numpy as np

from services.kv_index.row_index import Columns
from shared.kernels.cpu import cache_dir
from shared.schema import StoredBlock

SOURCE = Path(__file__).with_name("row_index.c")
CFLAGS = ("-O2", "-fPIC", "-shared", "-fno-strict-aliasing")
MODULE = "_kv_row_index"
MAX_LOAD = 0.85  # live + tombstone slots past which the index is rehashed ...
TARGET_LOAD = 0.6  # ... into one this full: 4.7 to 6.7 bytes of slots per block, ...
DOUBLING_SLOTS = 1 << 22  # ... or twice as big while under 4M slots (16 MB): fewer rehashes
MIN_SLOTS = 1 << 12
MIN_ROW_BITS = 16
COLUMNS = ("hash", "kind", "file_id", "slot", "generation", "access")

_lock = threading.Lock()
_module: ModuleType | None = None
_failure: str | None = None


class NativeUnavailable(RuntimeError):
    """The C row index cannot be built or loaded here (no compiler, or it failed)."""


def available() -> bool:
    try:
        module()
    except NativeUnavailable:
        return False
    return True


def module() -> ModuleType:
    """The loaded extension (built on the first call in a process); NativeUnavailable if not."""
    global _module, _failure
    with _lock:
        if _module is not None:
            return _module
        if _failure is not None:
            raise NativeUnavailable(_failure)
        try:
            path = build()
            spec = importlib.util.spec_from_file_location(
                MODULE, path, loader=importlib.machinery.ExtensionFileLoader(MODULE, str(path))
            )
            if spec is None or spec.loader is None:
                raise NativeUnavailable(f"cannot load {path}")
            loaded = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(loaded)
            loaded.use_block_type(StoredBlock)
        except (NativeUnavailable, OSError, ImportError) as exc:
            _failure = str(exc)
            raise NativeUnavailable(_failure) from exc
        _module = loaded
        return loaded


def build() -> Path:
    """The shared library for this machine and Python, compiled now unless cached."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        raise NativeUnavailable("no C compiler (cc or gcc) on PATH; set CC to one")
    include = sysconfig.get_paths()["include"]
    if not (Path(include) / "Python.h").exists():
        raise NativeUnavailable(f"no Python.h in {include}")
    try:
        version = subprocess.run(
            [compiler, "--version"], capture_output=True, text=True, check=True, timeout=30
        ).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise NativeUnavailable(f"{compiler} --version failed: {exc}") from exc
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    key = hashlib.sha256(
        "\0".join((SOURCE.read_text(), " ".join(CFLAGS), version, include, suffix)).encode()
    ).hexdigest()[:16]
    target = cache_dir() / f"{MODULE}-{key}{suffix}"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".build-", suffix=suffix)
    os.close(fd)
    try:
        argv = [compiler, *CFLAGS, f"-I{include}", str(SOURCE), "-o", tmp]
        result = subprocess.run(argv, capture_output=True, text=True, timeout=300)
        if result.returncode != 0:
            raise NativeUnavailable(f"building {SOURCE.name} failed:\n{result.stderr.strip()}")
        os.replace(tmp, target)  # concurrent builders each rename their own file into place
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _row_bits(num_rows: int) -> int:
    """Bits a slot needs to hold row + 1 for `num_rows` rows (all ones stays a tombstone)."""
    return max(MIN_ROW_BITS, min(32, (num_rows + 2).bit_length()))


def _address(array: np.ndarray) -> int:
    return array.__array_interface__["data"][0]


class NativeRowIndex:
    """The C index behind row_index.py's interface: the slots array lives here, sized in
    Python, filled and read in C."""

    def __init__(self) -> None:
        self._core = module().Core()
        self.slots = np.zeros(MIN_SLOTS, np.uint32)
        self.row_bits = 0  # bits of a slot that hold its row (bind sets them)
        self.table: Columns | None = None
        # The hot paths straight to C, without a Python frame between:
        self.put = self._core.put  # (blocks, num_bytes, kind, tick, num_shards, shard_id)
        self.answer = self._core.answer  # (keys: contiguous uint64 array, tick)

    # The counters live in the C object, where `put` and `remove_rows` update them.
    @property
    def num_rows(self) -> int:
        return self._core.num_rows

    @num_rows.setter
    def num_rows(self, value: int) -> None:
        self._core.num_rows = value

    @property
    def num_live(self) -> int:
        return self._core.num_live

    @num_live.setter
    def num_live(self, value: int) -> None:
        self._core.num_live = value

    @property
    def used_bytes(self) -> int:
        return self._core.used_bytes

    @used_bytes.setter
    def used_bytes(self, value: int) -> None:
        self._core.used_bytes = value

    @property
    def nbytes(self) -> int:
        return self.slots.nbytes

    def bind(self, table: Columns) -> None:
        """Hand the arrays to C after any of them changed. A slot numbers rows with as few
        bits as the columns' capacity (doubled) needs, the rest being fingerprint; columns
        that outgrow that make the slots be laid out again, as a rehash to more slots does."""
        self.table = table
        capacity = self._capacity()
        if self.row_bits < _row_bits(capacity):
            old_bits, self.row_bits = self.row_bits, _row_bits(2 * capacity)
            if old_bits and self.num_live:
                old, self.slots = self.slots, np.zeros_like(self.slots)
                self._bind(capacity)
                self._core.rehash(old, old_bits, None)
                return
        self._bind(capacity)

    def _capacity(self) -> int:
        return min(len(getattr(self._table, name)) for name in COLUMNS)

    def _bind(self, capacity: int) -> None:
        t = self._table
        self._core.bind(
            _address(t.hash),
            _address(t.kind),
            _address(t.file_id),
            _address(t.slot),
            _address(t.generation),
            _address(t.access),
            capacity,
            _address(self.slots),
            len(self.slots),
            int(MAX_LOAD * len(self.slots)),
            _address(t.kind_bytes),
            len(t.kind_bytes),
            self.row_bits,
        )

    def find_many(self, keys: np.ndarray) -> np.ndarray:
        out = np.empty(len(keys), np.int64)
        self._core.find_many(np.ascontiguousarray(keys, np.uint64), out)
        return out

    def remove_rows(self, rows: np.ndarray) -> None:
        self._core.remove_rows(np.ascontiguousarray(rows, np.int64))

    def reserve(self, num_entries: int) -> None:
        """Room for `num_entries` live entries without passing MAX_LOAD: a bigger index (or
        one without tombstones), rehashed from this one."""
        if num_entries + self._core.num_tombstones > MAX_LOAD * len(self.slots):
            old_bits, old = self.row_bits, self._fresh_slots(num_entries)
            self._core.rehash(old, old_bits, None)

    def reindex(self, remap: np.ndarray | None = None) -> None:
        """After the table moved its rows (row r is now remap[r]) or loaded them (remap
        None: every live row indexed afresh)."""
        old_bits, old = self.row_bits, self._fresh_slots(self.num_live)
        if remap is not None:
            self._core.rehash(old, old_bits, np.ascontiguousarray(remap, np.int64))
        else:
            live = np.flatnonzero(self._table.kind[: self.num_rows])
            self._core.num_tombstones = 0
            self._core.insert_rows(live)

    def _fresh_slots(self, num_entries: int) -> np.ndarray:
        old = self.slots
        size = max(MIN_SLOTS, math.ceil(num_entries / TARGET_LOAD))
        if num_entries > MAX_LOAD * len(old) and len(old) < DOUBLING_SLOTS:
            size = max(size, 2 * len(old))
        self.slots = np.zeros(size, np.uint32)
        self.row_bits = _row_bits(2 * self._capacity())  # a fresh layout, so a free choice
        self._bind(self._capacity())
        return old

    @property
    def _table(self) -> Columns:
        if self.table is None:
            raise RuntimeError("NativeRowIndex used before bind()")
        return self.table
