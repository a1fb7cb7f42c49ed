"""Small filesystems of their own for tests of a full disk: a tmpfs mounted at a path (root
only; the test is skipped, saying why, where mounting is refused), and a file that takes
every byte left on one."""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def tmpfs(mount_point: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` ("1m", "48m") at `mount_point` (made), unmounted on exit."""
    mount_point.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount_point)],
        capture_output=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount_point
    finally:
        # Lazy: a process that still has a file open there must not fail the unmount.
        subprocess.run(["umount", "--lazy", str(mount_point)], check=True)


def fill(directory: Path) -> Path:
    """A file in `directory` that takes every free byte of its filesystem (the next write
    there fails with ENOSPC); remove it to make room again."""
    filler = directory / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, b"\0" * (1 << 16))
    except OSError as exc:
        if exc.errno != errno.ENOSPC:  # full, as asked
            raise
    finally:
        os.close(fd)
    return filler
