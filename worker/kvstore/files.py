"""Open slot files: a writer's own (created and preallocated on first use, kept open) and
other writers' (opened read-only on first read, at most `max_open_files` at once, LRU).

Every fd is registered with the I/O backend once, when opened, and deregistered on close.
Own files are preallocated with posix_fallocate so that a full disk shows up as ENOSPC at
file creation (one clean skip) rather than in the middle of a NIXL batch, which reports a
failure without its errno.
"""

from __future__ import annotations

import errno
import os
from collections import OrderedDict
from pathlib import Path

from worker.kvstore.backends import BlockIO, io_error
from worker.kvstore.slots import file_path

EPOCH_FILE = "epoch"


class FileTable:
    def __init__(self, root: Path, backend: BlockIO, *, max_open_files: int = 1024) -> None:
        self.root = root
        self.backend = backend
        self.max_open_files = max_open_files
        self._own: dict[tuple[str, int], int] = {}
        # (writer id, file id) -> (fd, bytes registered with the backend)
        self._foreign: OrderedDict[tuple[str, int], tuple[int, int]] = OrderedDict()

    def own_fd(self, writer_id: str, file_id: int, nbytes: int) -> int:
        """The fd of one of our files, created with `nbytes` reserved on first use.
        Raises `DiskFull` or `StoreIOError`."""
        key = (writer_id, file_id)
        fd = self._own.get(key)
        if fd is not None:
            return fd
        path = file_path(self.root, writer_id, file_id)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise io_error(exc, f"creating {path}") from exc
        try:
            _reserve(fd, nbytes)
        except OSError as exc:
            os.close(fd)
            raise io_error(exc, f"reserving {nbytes} bytes for {path}") from exc
        self._close_foreign(key)
        self.backend.register_file(fd, nbytes)
        self._own[key] = fd
        return fd

    def read_fd(self, writer_id: str, file_id: int) -> tuple[int, int] | None:
        """(fd, current size in bytes) of any writer's file, or None if it does not exist.
        Raises `StoreIOError` for any other failure to open it."""
        key = (writer_id, file_id)
        fd = self._own.get(key)
        if fd is not None:
            return fd, os.fstat(fd).st_size
        opened = self._foreign.get(key)
        if opened is None:
            path = file_path(self.root, writer_id, file_id)
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                return None
            except OSError as exc:
                raise io_error(exc, f"opening {path}") from exc
            opened = self._foreign[key] = (fd, 0)
            while len(self._foreign) > self.max_open_files:
                self._close_foreign(next(iter(self._foreign)))
        self._foreign.move_to_end(key)
        fd, registered_nbytes = opened
        nbytes = os.fstat(fd).st_size
        if nbytes > registered_nbytes:
            # Opened while its writer was still reserving it: NIXL refuses a transfer outside
            # the registered range, so register the file again at its new size.
            if registered_nbytes:
                self.backend.deregister_file(fd)
            self.backend.register_file(fd, nbytes)
            self._foreign[key] = (fd, nbytes)
        return fd, nbytes

    def forget(self, writer_id: str, file_id: int) -> None:
        """Drop a cached read-only fd (the file may have been replaced: reopen next time)."""
        self._close_foreign((writer_id, file_id))

    def _close_foreign(self, key: tuple[str, int]) -> None:
        opened = self._foreign.pop(key, None)
        if opened is not None:
            self.backend.deregister_file(opened[0])
            os.close(opened[0])

    def close(self) -> None:
        for key in list(self._foreign):
            self._close_foreign(key)
        for fd in self._own.values():
            self.backend.deregister_file(fd)
            os.close(fd)
        self._own.clear()


def _reserve(fd: int, nbytes: int) -> None:
    if os.fstat(fd).st_size >= nbytes:
        return
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        # Some FUSE and distributed filesystems do not implement fallocate: a sparse file
        # works there, and ENOSPC then surfaces at write time instead.
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
        os.ftruncate(fd, nbytes)


def next_epoch(writer_dir: Path) -> int:
    """Read, increment and durably store the writer's open counter."""
    writer_dir.mkdir(parents=True, exist_ok=True)
    path = writer_dir / EPOCH_FILE
    try:
        epoch = int(path.read_text().strip() or 0) + 1
    except FileNotFoundError:
        epoch = 1
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as f:
        f.write(str(epoch))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return epoch
