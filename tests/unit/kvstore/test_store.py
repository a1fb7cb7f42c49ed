"""KvStore over real files through each backend: round trip, every kind of damage reads as
a miss with its counter, full disks and exhausted shares skip writes, reads go before the
rest of a running write, scans find slots."""

from __future__ import annotations

import asyncio
import errno
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest

from shared.schema import StoredBlock
from shared.testing.volumes import tmpfs
from worker.kvstore import (
    AIOFILES,
    BackendUnavailable,
    BlockIO,
    IoOp,
    KvStore,
    KvStoreConfig,
    PayloadSizeError,
    SlotRef,
    make_backend,
)
from worker.kvstore.backends import io_error
from worker.kvstore.slots import HEADER_NBYTES, file_path, slot_nbytes_for

PAYLOAD_NBYTES = 98_304  # 64 tokens x 3 full layers x K,V x 2 kv heads x 64 dim x 2 bytes
SLOT_NBYTES = slot_nbytes_for(PAYLOAD_NBYTES)
BACKENDS = [AIOFILES, "nixl:POSIX"]


def payload(i: int) -> bytes:
    return np.random.default_rng(i).integers(0, 256, PAYLOAD_NBYTES, dtype=np.uint8).tobytes()


def config(root: Path, backend: str, writer_id: str = "w1", **overrides) -> KvStoreConfig:
    values = {"capacity_bytes": 64 * SLOT_NBYTES, "file_nbytes": 8 * SLOT_NBYTES}
    values |= overrides
    return KvStoreConfig(root, writer_id, PAYLOAD_NBYTES, backend=backend, **values)


@pytest.fixture(params=BACKENDS)
def backend_name(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def store(tmp_path: Path, backend_name: str) -> Iterator[KvStore]:
    s = KvStore.open(config(tmp_path, backend_name))
    yield s
    s.close()


def ref(s: KvStore, block: StoredBlock | None) -> SlotRef:
    assert block is not None
    return SlotRef(block.block_hash, s.writer_id, block.file_id, block.slot, block.generation)


async def write(s: KvStore, hashes: Sequence[int]) -> list[SlotRef]:
    stored = await s.write_blocks([(h, payload(h)) for h in hashes])
    return [ref(s, b) for b in stored]


def damage(s: KvStore, r: SlotRef, at: int, data: bytes) -> None:
    """Overwrite bytes of slot `r` on disk, `at` bytes into the slot."""
    with open(file_path(s.config.root_dir, r.writer_id, r.file_id), "r+b") as f:
        f.seek(r.slot * SLOT_NBYTES + at)
        f.write(data)


async def test_round_trip_across_files_and_batches(tmp_path: Path, backend_name: str):
    # A 3-slot staging buffer: 20 blocks take 7 batches and span 3 files.
    s = KvStore.open(config(tmp_path, backend_name, staging_nbytes=3 * SLOT_NBYTES))
    try:
        refs = await write(s, range(1, 21))
        assert {r.file_id for r in refs} == {0, 1, 2}
        got = await s.read_blocks(refs[::-1])
        assert got == [payload(h) for h in range(20, 0, -1)]
        stats = s.stats()
        assert stats["num_blocks_written"] == 20 and stats["num_hits"] == 20
        assert stats["num_bytes_read"] == 20 * PAYLOAD_NBYTES
        assert stats["num_write_batches"] == 7
    finally:
        s.close()


async def test_read_into_caller_buffers(store: KvStore):
    refs = await write(store, [1, 2, 3])
    pool = np.zeros((4, PAYLOAD_NBYTES), dtype=np.uint8)  # e.g. pages of the KV pool
    damage(store, refs[1], HEADER_NBYTES + 7, b"\x01")
    got = await store.read_blocks(refs, into=[memoryview(pool[i]) for i in (3, 0, 1)])
    assert got[1] is None and store.stats()["num_misses.checksum"] == 1
    assert bytes(pool[3]) == payload(1) and bytes(pool[1]) == payload(3)
    assert got[0] is not None and bytes(got[0]) == payload(1)


async def test_payload_of_wrong_size_is_a_caller_error(store: KvStore):
    with pytest.raises(PayloadSizeError):
        await store.write_blocks([(1, b"short")])


async def test_flipped_payload_byte_is_a_checksum_miss(store: KvStore):
    refs = await write(store, [1, 2])
    damage(store, refs[0], HEADER_NBYTES + 5000, b"\xff\x00")
    assert await store.read_blocks(refs) == [None, payload(2)]
    assert store.stats()["num_misses.checksum"] == 1


async def test_damaged_magic_is_a_miss(store: KvStore):
    (r,) = await write(store, [1])
    damage(store, r, 0, b"JUNK")
    assert await store.read_blocks([r]) == [None]
    assert store.stats()["num_misses.bad_magic"] == 1


async def test_truncated_file_is_a_miss(store: KvStore):
    refs = await write(store, [1, 2, 3])
    os.truncate(file_path(store.config.root_dir, "w1", 0), 2 * SLOT_NBYTES + 100)
    assert await store.read_blocks(refs) == [payload(1), payload(2), None]
    assert store.stats()["num_misses.truncated"] == 1


async def test_rewritten_slot_is_a_generation_or_block_miss(tmp_path: Path, backend_name: str):
    s = KvStore.open(config(tmp_path, backend_name, capacity_bytes=SLOT_NBYTES))
    try:
        (old,) = await write(s, [1])
        assert s.free_slots([StoredBlock(1, old.file_id, old.slot, old.generation, 0)]) == 1
        (same_block,) = await write(s, [1])  # same slot, same block, next generation
        assert (same_block.slot, same_block.generation) == (old.slot, old.generation + 1)
        assert await s.read_blocks([old, same_block]) == [None, payload(1)]
        s.free_slots([StoredBlock(1, 0, 0, same_block.generation, 0)])
        (other,) = await write(s, [2])
        assert await s.read_blocks([same_block, other]) == [None, payload(2)]
        stats = s.stats()
        assert stats["num_misses.wrong_generation"] == 1
        assert stats["num_misses.wrong_block"] == 1
    finally:
        s.close()


async def test_reader_follows_a_file_that_grew_after_it_opened_it(
    tmp_path: Path, backend_name: str
):
    writer = KvStore.open(config(tmp_path, backend_name, "writer-a"))
    reader = KvStore.open(config(tmp_path, backend_name, "reader-b"))
    try:
        r1, _, r3 = await write(writer, [1, 2, 3])
        path = file_path(tmp_path, "writer-a", 0)
        full_nbytes = path.stat().st_size
        os.truncate(path, SLOT_NBYTES)  # as seen while the writer still reserves the file
        assert await reader.read_blocks([r1, r3]) == [payload(1), None]
        os.truncate(path, full_nbytes)
        (r4,) = await write(writer, [4])
        assert await reader.read_blocks([r1, r4]) == [payload(1), payload(4)]
        assert reader.stats()["num_misses.truncated"] == 1
        assert reader.stats()["num_misses.io_error"] == 0
    finally:
        writer.close()
        reader.close()


async def test_missing_file_and_never_written_slot_are_misses(store: KvStore):
    (r,) = await write(store, [1])
    absent = SlotRef(1, "nobody", 0, 0, r.generation)
    unwritten = SlotRef(9, "w1", 0, 5, r.generation)  # preallocated, still zeros
    assert await store.read_blocks([absent, unwritten]) == [None, None]
    stats = store.stats()
    assert stats["num_misses.missing_file"] == 1 and stats["num_misses.empty"] == 1


async def test_full_share_skips_writes_until_slots_are_freed(tmp_path: Path, backend_name: str):
    s = KvStore.open(config(tmp_path, backend_name, capacity_bytes=3 * SLOT_NBYTES + 100))
    try:
        stored = await s.write_blocks([(h, payload(h)) for h in range(1, 6)])
        assert [b is not None for b in stored] == [True, True, True, False, False]
        assert s.stats()["num_skipped.capacity"] == 2
        assert sum(f.stat().st_size for f in (tmp_path / "w1").glob("*.kvs")) == 3 * SLOT_NBYTES
        assert s.free_slots([b for b in stored[:1] if b]) == 1
        assert (await s.write_blocks([(6, payload(6))]))[0] is not None
    finally:
        s.close()


async def test_reused_slots_are_handed_out_in_ascending_order(store: KvStore):
    stored = await store.write_blocks([(h, payload(h)) for h in range(1, 6)])
    assert store.free_slots([b for b in stored if b]) == 5
    again = await store.write_blocks([(h, payload(h)) for h in range(6, 11)])
    # Blocks of one batch land in adjacent slots, in order: a prefix reads back sequentially.
    assert [b.slot for b in again if b] == [0, 1, 2, 3, 4]


class EnospcIO:
    """Wraps a real backend; its writes fail with ENOSPC, as a full disk's would."""

    def __init__(self, inner: BlockIO) -> None:
        self.inner = inner
        self.name = inner.name

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    async def write(self, buffer: np.ndarray, ops: Sequence[IoOp]) -> None:
        raise io_error(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), "write")


async def test_enospc_at_the_backend_skips_and_serving_goes_on(tmp_path: Path, backend_name: str):
    cfg = config(tmp_path, backend_name, disk_full_backoff_s=60.0)
    s = KvStore.open(cfg, EnospcIO(make_backend(backend_name, agent_name="enospc-test")))
    try:
        assert await s.write_blocks([(1, payload(1)), (2, payload(2))]) == [None, None]
        assert await s.write_blocks([(3, payload(3))]) == [None]  # within the back-off
        stats = s.stats()
        assert stats["num_skipped.disk_full"] == 3 and stats["num_slots_used"] == 0
        assert await s.read_blocks([SlotRef(1, "w1", 0, 0, 1)]) == [None]  # reads still run
    finally:
        s.close()


class GatedIO:
    """A real backend whose calls are logged and may be held until a test lets them go."""

    def __init__(self, inner: BlockIO) -> None:
        self.inner = inner
        self.name = inner.name
        self.calls: list[str] = []
        self.hold = {"read": asyncio.Event(), "write": asyncio.Event()}
        for gate in self.hold.values():
            gate.set()

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    async def read(self, buffer: np.ndarray, ops: Sequence[IoOp]) -> None:
        self.calls.append("read")
        await self.hold["read"].wait()
        await self.inner.read(buffer, ops)
        self.calls.append("read done")

    async def write(self, buffer: np.ndarray, ops: Sequence[IoOp]) -> None:
        self.calls.append("write")
        await self.hold["write"].wait()
        await self.inner.write(buffer, ops)
        self.calls.append("write done")


async def _settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


async def _until(predicate, timeout_s: float = 10.0) -> None:  # noqa: ANN001
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.005)


async def test_a_read_goes_before_the_rest_of_a_write(tmp_path: Path, backend_name: str):
    """A prefix load waits for the write batch in flight, not for the whole write."""
    io = GatedIO(make_backend(backend_name, agent_name="gated-test"))
    s = KvStore.open(config(tmp_path, backend_name, staging_nbytes=2 * SLOT_NBYTES), io)
    try:
        stored = await write(s, [1, 2])
        io.calls.clear()
        io.hold["write"].clear()
        writing = asyncio.create_task(write(s, range(10, 16)))  # three batches of two
        await _settle()
        io.hold["read"].clear()
        reading = asyncio.create_task(s.read_blocks(stored))
        await _settle()
        io.hold["write"].set()  # the first batch lands; the read is still running
        await _until(lambda: "write done" in io.calls)
        await asyncio.sleep(0.1)
        assert io.calls.count("write") == 1  # the second batch waits for the read
        io.hold["read"].set()
        assert await reading == [payload(1), payload(2)]
        refs = await writing
        second_write = io.calls.index("write", 1)
        last_read = len(io.calls) - 1 - io.calls[::-1].index("read done")
        assert io.calls.count("write") == 3 and second_write > last_read
        assert await s.read_blocks(refs) == [payload(h) for h in range(10, 16)]
    finally:
        s.close()


async def test_reads_never_hold_a_write_back_longer_than_write_yield_s(
    tmp_path: Path, backend_name: str
):
    io = GatedIO(make_backend(backend_name, agent_name="gated-test"))
    cfg = config(tmp_path, backend_name, staging_nbytes=2 * SLOT_NBYTES, write_yield_s=0.05)
    s = KvStore.open(cfg, io)
    try:
        stored = await write(s, [1])
        io.hold["read"].clear()
        reading = asyncio.create_task(s.read_blocks(stored))  # held: a read that never ends
        await _settle()
        refs = await asyncio.wait_for(write(s, range(10, 14)), timeout=10)
        assert not reading.done()
        io.hold["read"].set()
        assert await reading == [payload(1)]
        assert await s.read_blocks(refs) == [payload(h) for h in range(10, 14)]
    finally:
        s.close()


@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Iterator[Path]:
    with tmpfs(tmp_path / "tiny", "1m") as mount_point:
        yield mount_point


async def test_real_full_filesystem_skips_writes(tiny_tmpfs: Path, backend_name: str):
    # 1 MiB holds two 4-slot files (800 KiB); the third file's reservation fails: ENOSPC.
    cfg = config(tiny_tmpfs, backend_name, file_nbytes=4 * SLOT_NBYTES, disk_full_backoff_s=0.0)
    s = KvStore.open(cfg)
    try:
        stored = await s.write_blocks([(h, payload(h)) for h in range(1, 13)])
        written = [ref(s, b) for b in stored if b is not None]
        assert len(written) == 8
        assert s.stats()["num_skipped.disk_full"] == 4
        assert await s.read_blocks(written) == [payload(h) for h in range(1, 9)]
    finally:
        s.close()


async def test_scan_finds_every_valid_slot_of_every_writer(tmp_path: Path, backend_name: str):
    a = KvStore.open(config(tmp_path, backend_name, "writer-a"))
    b = KvStore.open(config(tmp_path, backend_name, "writer-b"))
    try:
        refs_a = await write(a, range(1, 11))
        refs_b = await write(b, range(100, 105))
        damage(a, refs_a[3], 0, b"JUNK")
        found = {s.ref for s in a.scan_headers()}
        assert found == (set(refs_a) - {refs_a[3]}) | set(refs_b)
        # Any writer reads any other's slots.
        assert await b.read_blocks(refs_a[:2]) == [payload(1), payload(2)]
        damage(a, refs_a[5], HEADER_NBYTES + 1, b"\x00\x01\x02")
        assert refs_a[5] in found
        verified = {s.ref for s in a.scan_headers(writer_id="writer-a", verify_payload=True)}
        assert verified == set(refs_a) - {refs_a[3], refs_a[5]}
    finally:
        a.close()
        b.close()


async def test_reopened_writer_keeps_its_blocks_and_never_reuses_a_generation(
    tmp_path: Path, backend_name: str
):
    first = KvStore.open(config(tmp_path, backend_name, capacity_bytes=4 * SLOT_NBYTES))
    refs = await write(first, [1, 2, 3])
    first.close()
    again = KvStore.open(config(tmp_path, backend_name, capacity_bytes=4 * SLOT_NBYTES))
    try:
        assert sorted(b.block_hash for b in again.adopted) == [1, 2, 3]
        assert await again.read_blocks(refs) == [payload(1), payload(2), payload(3)]
        stored = await again.write_blocks([(4, payload(4)), (5, payload(5))])
        assert stored[1] is None  # the adopted slots were not overwritten
        assert stored[0] is not None and stored[0].generation > max(r.generation for r in refs)
    finally:
        again.close()


@pytest.mark.parametrize("name", ["nixl:GDS", "nixl:HF3FS", "nixl:NOPE", "tape"])
def test_unavailable_backend_is_a_clear_error(name: str):
    with pytest.raises(BackendUnavailable, match=name.removeprefix("nixl:")):
        make_backend(name, agent_name=f"probe-{name.replace(':', '-')}")
