"""Typed errors of the SSD store.

A store error never reaches a client: a failed read is a miss and a failed write is a skip,
both counted. These exceptions cross module boundaries (backend -> store) so that each
caller handles exactly the failures it can act on.
"""

from __future__ import annotations


class KvStoreError(Exception):
    """Base of every error the store raises on purpose."""


class PayloadSizeError(KvStoreError, ValueError):
    """A payload's length differs from the model's block size: a caller bug, not a miss."""


class BackendUnavailable(KvStoreError):
    """The configured I/O backend (a NIXL plugin such as GDS or HF3FS) cannot run here."""


class StoreIOError(KvStoreError):
    """A batch of reads or writes failed below the store (OS error, NIXL transfer error)."""

    def __init__(self, message: str, *, errno_code: int | None = None) -> None:
        super().__init__(message)
        self.errno_code = errno_code


class DiskFull(StoreIOError):
    """ENOSPC (or the filesystem reporting no free space): the write is skipped."""
