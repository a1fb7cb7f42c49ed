"""The SSD KV store: block hashes (the cache's keys), slot files under a shared directory
read and written through NIXL or aiofiles, and a writer's side of the KV event protocol.
Re-exports only."""

from shared.kvstore.backends import AIOFILES, AioFilesIO, BlockIO, IoOp
from shared.kvstore.errors import (
    BackendUnavailable,
    DiskFull,
    KvStoreError,
    PayloadSizeError,
    StoreIOError,
)
from shared.kvstore.scan import ScannedSlot
from shared.kvstore.slots import MissReason, SlotHeader, SlotRef
from shared.kvstore.store import KvStore, KvStoreConfig, SkipReason, make_backend

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
