"""The SSD KV store (slot files under a shared directory, NIXL or aiofiles I/O) and the
prefill -> decode KV transfer over NIXL. Re-exports only."""

from shared.kvstore.backends import AIOFILES, AioFilesIO, BlockIO, IoOp, make_backend
from shared.kvstore.errors import (
    BackendUnavailable,
    DiskFull,
    KvStoreError,
    PayloadSizeError,
    StoreIOError,
    TransferError,
    TransferTimeout,
)
from shared.kvstore.scan import ScannedSlot
from shared.kvstore.slots import MissReason, SlotHeader, SlotRef
from shared.kvstore.store import KvStore, KvStoreConfig, SkipReason

__all__ = [
    "AIOFILES",
    "AioFilesIO",
    "BackendUnavailable",
    "BlockIO",
    "DiskFull",
    "IoOp",
    "KvStore",
    "KvStoreConfig",
    "KvStoreError",
    "MissReason",
    "PayloadSizeError",
    "ScannedSlot",
    "SkipReason",
    "SlotHeader",
    "SlotRef",
    "StoreIOError",
    "TransferError",
    "TransferTimeout",
    "make_backend",
]
