"""The SSD KV store: slot files under a shared directory read and written through NIXL or
aiofiles, and a writer's side of the KV event protocol. Its keys, the block hashes, are the
platform's (shared/block_hashing.py, shared/blocks.py): callers hash before any worker runs.
Re-exports only."""

from worker.kvstore.backends import AIOFILES, AioFilesIO, BlockIO, IoOp
from worker.kvstore.errors import (
    BackendUnavailable,
    DiskFull,
    KvStoreError,
    PayloadSizeError,
    StoreIOError,
)
from worker.kvstore.scan import ScannedSlot
from worker.kvstore.slots import MissReason, SlotHeader, SlotRef
from worker.kvstore.store import KvStore, KvStoreConfig, SkipReason, make_backend

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
    "make_backend",
]
