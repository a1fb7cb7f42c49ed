"""Typed errors of the SSD store and of the prefill -> decode transfer path.

A store error never reaches a client: a failed read is a miss and a failed write is a skip,
both counted. These exceptions cross module boundaries (backend -> store, NIXL -> transfer)
so that each caller handles exactly the failures it can act on.
"""

from __future__ import annotations

from shared.schema import ErrorCode, Unavailable


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


class TransferError(Unavailable):
    """A NIXL transfer to or from a peer failed: peer gone, metadata unavailable, UCX error."""


class TransferTimeout(TransferError):
    """A NIXL transfer or notification did not complete within its timeout."""

    code = ErrorCode.DEADLINE_EXCEEDED
