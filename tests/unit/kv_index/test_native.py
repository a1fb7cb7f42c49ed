"""Choosing the row index: the C one when this machine can build it, else the dict one, and
the same answers from either (the randomized comparison is test_against_reference.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from services.kv_index import native

PROGRAM = """
from services.kv_index import native
from services.kv_index.index import KvIndex
from shared.schema import BlocksStored, KvEventBatch, StoredBlock
index = KvIndex(capacity_bytes={"ssd": 10**9})
blocks = tuple(StoredBlock(h, 0, h, 1, 10) for h in (11, 12, 13))
index.apply(KvEventBatch(writer_id="w", seq=1, ts_ms=0, events=(BlocksStored("ssd", blocks),)), 0.0)
print(native.available(), type(index.tables["ssd"].index).__name__,
      index.match([11, 12, 99], 1.0)[0].first_miss_index)
"""


def run_with(env: dict[str, str]) -> str:
    done = subprocess.run(
        [sys.executable, "-c", PROGRAM],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=120,
        check=True,
    )
    return done.stdout.strip()


def test_without_a_compiler_the_dict_index_serves(tmp_path: Path) -> None:
    out = run_with({"CC": str(tmp_path / "no-such-cc"), "KVF_KERNEL_CACHE": str(tmp_path)})
    assert out == "False RowIndex 2"


@pytest.mark.skipif(not native.available(), reason="no C compiler here")
def test_with_a_compiler_the_c_index_is_built_into_the_cache(tmp_path: Path) -> None:
    assert run_with({"KVF_KERNEL_CACHE": str(tmp_path)}) == "True NativeRowIndex 2"
    assert [p.name.startswith(native.MODULE) for p in tmp_path.iterdir()] == [True]


def test_a_failed_build_says_why(tmp_path: Path) -> None:
    compiler = tmp_path / "cc"
    compiler.write_text(
        '#!/bin/sh\n[ "$1" = --version ] && echo fake 1.0 && exit 0\n'
        "echo 'row_index.c: error: nope' >&2; exit 1\n"
    )
    compiler.chmod(0o755)
    program = (
        "from services.kv_index import native\n"
        "try:\n    native.module()\nexcept native.NativeUnavailable as e:\n    print(e)\n"
    )
    env = {**os.environ, "CC": str(compiler), "KVF_KERNEL_CACHE": str(tmp_path / "cache")}
    done = subprocess.run(
        [sys.executable, "-c", program],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=True,
    )
    assert "building row_index.c failed" in done.stdout and "error: nope" in done.stdout
