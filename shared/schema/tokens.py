"""Token ids and block hashes travel packed: little-endian u32 / u64 bytes, not lists of ints.

A 200K-token prompt is 800 KB packed (MessagePack would spend up to 5 bytes per int and
msgspec would build 200K Python ints on decode), well under the 8 MB max payload.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

_U32 = np.dtype("<u4")
_U64 = np.dtype("<u8")


def _pack(values: Iterable[int] | np.ndarray, dtype: np.dtype, what: str) -> bytes:
    if isinstance(values, np.ndarray):
        array = values
    else:
        items = list(values)
        array = np.array(items)
        # Python ints past 2**63 (or mixed with small ones) come out as object or float64:
        # check them exactly, then convert.
        if array.size and array.dtype.kind not in "iu":
            if not all(isinstance(v, int) and 0 <= v < 1 << 64 for v in items):
                raise ValueError(f"{what} must be integers in [0, 2**64)")
            array = np.array(items, dtype=np.uint64)
    if array.size == 0:
        return b""
    if array.dtype.kind not in "iu":
        raise ValueError(f"{what} must be integers, got dtype {array.dtype}")
    if array.dtype.kind == "i" and int(array.min()) < 0:
        raise ValueError(f"{what} must be non-negative")
    if int(array.max()) >= 1 << (8 * dtype.itemsize):
        raise ValueError(f"{what} must be below 2**{8 * dtype.itemsize}")
    return array.astype(dtype, copy=False).tobytes()


def _unpack(data: bytes, dtype: np.dtype, what: str) -> np.ndarray:
    if len(data) % dtype.itemsize:
        raise ValueError(f"packed {what} length {len(data)} is not a multiple of {dtype.itemsize}")
    return np.frombuffer(data, dtype=dtype)


def pack_token_ids(token_ids: Iterable[int] | np.ndarray) -> bytes:
    return _pack(token_ids, _U32, "token ids")


def unpack_token_ids(data: bytes) -> np.ndarray:
    """A read-only uint32 view of the packed ids (no copy)."""
    return _unpack(data, _U32, "token ids")


def pack_block_hashes(block_hashes: Iterable[int] | np.ndarray) -> bytes:
    return _pack(block_hashes, _U64, "block hashes")


def unpack_block_hashes(data: bytes) -> np.ndarray:
    return _unpack(data, _U64, "block hashes")


def num_packed_tokens(data: bytes) -> int:
    return len(data) // _U32.itemsize
