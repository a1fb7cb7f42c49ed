"""Reproducible data selection: the Python standard library of the interpreter running this.

Files are listed in sorted order and split by a hash of their path relative to the stdlib
root, so the split does not depend on file contents, listing order or the machine. Test
suites are excluded (they are ~40% of the stdlib's .py bytes and full of deliberately odd
code), as are installed third-party packages.
"""

from __future__ import annotations

import hashlib
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

# Any path component in this set excludes the file: CPython's test suites (test/, tests/,
# idle_test/ and the per-package test/ dirs of ctypes, unittest, tkinter, lib2to3, distutils)
# and third-party code.
EXCLUDED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "__pycache__"})
HELD_OUT_PER_MILLE = 20  # 2% of files


@dataclass(frozen=True)
class SourceFile:
    path: Path
    rel_path: str  # relative to the stdlib root, '/'-separated

    @property
    def is_held_out(self) -> bool:
        digest = hashlib.sha256(self.rel_path.encode()).digest()
        return int.from_bytes(digest[:8], "big") % 1000 < HELD_OUT_PER_MILLE

    def read(self) -> str:
        return self.path.read_text(encoding="utf-8")


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def list_sources(root: Path | None = None) -> list[SourceFile]:
    """Every *.py under root outside EXCLUDED_DIRS that decodes as UTF-8, sorted by path."""
    root = root or stdlib_root()
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if EXCLUDED_DIRS.intersection(rel.parts[:-1]) or not path.is_file():
            continue
        try:
            path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:  # none outside the test suites on 3.11.7
            print(f"skipped {rel.as_posix()}: not UTF-8 ({exc.reason})", file=sys.stderr)
            continue
        out.append(SourceFile(path, rel.as_posix()))
    return out


def split(files: list[SourceFile]) -> tuple[list[SourceFile], list[SourceFile]]:
    """(train, held_out), both in sorted path order."""
    train = [f for f in files if not f.is_held_out]
    held_out = [f for f in files if f.is_held_out]
    return train, held_out


def describe(files: list[SourceFile]) -> str:
    num_bytes = sum(f.path.stat().st_size for f in files)
    return f"{len(files)} files, {num_bytes / 1e6:.1f} MB"
