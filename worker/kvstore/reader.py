"""The store's read path: batches of slots, two in flight.

The read staging buffer is split in halves of ~4 MB. While one half's batch is being verified
and copied out (CPU), the next batch is already being read into the other half (disk, NIXL or
executor threads), so on a two-core machine the checksum and the copy hide behind the I/O.
The payload is copied out *before* its checksum is taken, and the checksum is taken on the
copy: whatever happens to the staging buffer afterwards (a cancelled read's I/O still
landing), the bytes handed out are the bytes verified.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import Sequence

from shared.logging import get_logger
from worker.kvstore.backends import BlockIO, IoOp, alloc_staging
from worker.kvstore.errors import StoreIOError
from worker.kvstore.files import FileTable
from worker.kvstore.slots import (
    HEADER_NBYTES,
    MissReason,
    SlotGeometry,
    SlotRef,
    check_header,
    checksum,
)

log = get_logger(__name__)

# Misses that mean another writer's file may have been replaced: reopen it next time.
_REOPEN_ON = {MissReason.WRONG_GENERATION, MissReason.EMPTY, MissReason.BAD_MAGIC}

# Slots per backend request: small enough that a 100-block call is several requests to
# overlap (2 MB blocks: 50 MB chunks left the verify+copy of one chunk exposed, 0.21 GB/s
# against 1.39 raw), large enough that per-request costs vanish (98 KB blocks: 41 slots).
CHUNK_NBYTES = 4 << 20

_ZERO_HEADER = bytes(HEADER_NBYTES)

Payload = bytes | memoryview
_Fetched = list[tuple[int, SlotRef, int]]  # (index in the call, ref, offset in the buffer)


class SlotReader:
    def __init__(
        self,
        files: FileTable,
        backend: BlockIO,
        geometry: SlotGeometry,
        *,
        batch_slots: int,
        counters: Counter[str],
        writer_id: str,
        chunk_nbytes: int = CHUNK_NBYTES,
    ) -> None:
        self.files = files
        self.backend = backend
        self.geometry = geometry
        self.slot_nbytes = geometry.slot_nbytes
        self.half_slots = max(1, min(batch_slots // 2, -(-chunk_nbytes // self.slot_nbytes)))
        self.counters = counters
        self.writer_id = writer_id
        self._buffer = alloc_staging(2 * self.half_slots * self.slot_nbytes)
        backend.register_buffer(self._buffer)
        self._view = memoryview(self._buffer)
        self._lock = asyncio.Lock()

    async def read(
        self, refs: Sequence[SlotRef], into: Sequence[memoryview] | None = None
    ) -> list[Payload | None]:
        results: list[Payload | None] = [None] * len(refs)
        async with self._lock:
            in_flight: asyncio.Task[_Fetched] | None = None
            try:
                for start in range(0, len(refs), self.half_slots):
                    half = (start // self.half_slots) % 2
                    chunk = refs[start : start + self.half_slots]
                    previous = in_flight
                    in_flight = asyncio.create_task(self._fetch(chunk, start, half))
                    if previous is not None:
                        self._finish(await previous, results, into)
                if in_flight is not None:
                    self._finish(await in_flight, results, into)
            finally:
                if in_flight is not None and not in_flight.done():
                    in_flight.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await in_flight
        return results

    async def _fetch(self, chunk: Sequence[SlotRef], start: int, half: int) -> _Fetched:
        fetched: _Fetched = []
        ops: list[IoOp] = []
        base = half * self.half_slots * self.slot_nbytes
        files: dict[tuple[str, int], tuple[int, int] | None] = {}  # one open + fstat per file
        for i, ref in enumerate(chunk):
            key = (ref.writer_id, ref.file_id)
            try:
                opened = files[key] if key in files else self.files.read_fd(*key)
            except StoreIOError:
                self._miss(MissReason.IO_ERROR)
                continue
            files[key] = opened
            if opened is None:
                self._miss(MissReason.MISSING_FILE)
                continue
            fd, file_nbytes = opened
            file_offset = self.geometry.offset(ref.slot)
            if file_offset + self.slot_nbytes > file_nbytes:
                self._miss(MissReason.TRUNCATED)
                continue
            offset = base + len(ops) * self.slot_nbytes
            # A short or failed read must not leave an earlier batch's valid header here.
            self._view[offset : offset + HEADER_NBYTES] = _ZERO_HEADER
            ops.append(IoOp(fd, file_offset, offset, self.slot_nbytes))
            fetched.append((start + i, ref, offset))
        self.counters["num_blocks_read"] += len(chunk)
        if not ops:
            return []
        try:
            await self.backend.read(self._buffer, ops)
        except StoreIOError as exc:
            log.warning("store read failed", writer_id=self.writer_id, error=str(exc))
            self._miss(MissReason.IO_ERROR, len(fetched))
            return []
        self.counters["num_read_batches"] += 1
        return fetched

    def _finish(
        self, fetched: _Fetched, results: list[Payload | None], into: Sequence[memoryview] | None
    ) -> None:
        payload_nbytes = self.geometry.payload_nbytes
        for i, ref, offset in fetched:
            header = check_header(self._view[offset : offset + HEADER_NBYTES], ref, payload_nbytes)
            if isinstance(header, MissReason):
                self._miss(header)
                if header in _REOPEN_ON and ref.writer_id != self.writer_id:
                    self.files.forget(ref.writer_id, ref.file_id)
                continue
            staged = self._view[offset + HEADER_NBYTES : offset + HEADER_NBYTES + payload_nbytes]
            payload: Payload
            if into is None:
                payload = bytes(staged)
            else:
                payload = into[i]
                payload[:payload_nbytes] = staged
            if checksum(payload) != header.payload_checksum:
                self._miss(MissReason.CHECKSUM)
                continue
            results[i] = payload
            self.counters["num_hits"] += 1
            self.counters["num_bytes_read"] += payload_nbytes

    def _miss(self, reason: MissReason, num_blocks: int = 1) -> None:
        self.counters[f"num_misses.{reason}"] += num_blocks
