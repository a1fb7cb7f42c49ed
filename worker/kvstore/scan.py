"""Walk a store directory and yield every valid slot header, for rebuilding the index when
its log is lost, and for a writer re-adopting its own slots when it restarts.

Only headers are read (64 bytes per slot); a header is valid when its magic, version and
header checksum hold and it names the file and slot it was found in. Payloads are checked
only with `verify_payload` (a full read of the store), since every read checks them anyway.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from shared.schema import StoredBlock
from worker.kvstore.slots import (
    FILE_SUFFIX,
    HEADER_NBYTES,
    SlotHeader,
    SlotRef,
    checksum,
    parse_header,
    slot_nbytes_for,
)


@dataclass(frozen=True, slots=True)
class ScannedSlot:
    writer_id: str
    header: SlotHeader

    @property
    def ref(self) -> SlotRef:
        h = self.header
        return SlotRef(h.block_hash, self.writer_id, h.file_id, h.slot, h.generation)

    @property
    def stored_block(self) -> StoredBlock:
        h = self.header
        return StoredBlock(h.block_hash, h.file_id, h.slot, h.generation, h.payload_nbytes)


def scan_headers(
    root: Path,
    payload_nbytes: int,
    *,
    writer_id: str | None = None,
    verify_payload: bool = False,
) -> Iterator[ScannedSlot]:
    """Every valid slot under `root` (or under one writer's directory)."""
    slot_nbytes = slot_nbytes_for(payload_nbytes)
    writers = [root / writer_id] if writer_id else sorted(p for p in root.iterdir() if p.is_dir())
    for writer_dir in writers:
        if not writer_dir.is_dir():
            continue
        for path in sorted(writer_dir.glob(f"*{FILE_SUFFIX}")):
            if not path.stem.isdigit():
                continue
            yield from _scan_file(
                path, writer_dir.name, int(path.stem), slot_nbytes, payload_nbytes, verify_payload
            )


def _scan_file(
    path: Path,
    writer_id: str,
    file_id: int,
    slot_nbytes: int,
    payload_nbytes: int,
    verify_payload: bool,
) -> Iterator[ScannedSlot]:
    fd = os.open(path, os.O_RDONLY)
    try:
        num_slots = os.fstat(fd).st_size // slot_nbytes
        read_nbytes = slot_nbytes if verify_payload else HEADER_NBYTES
        for slot in range(num_slots):
            raw = memoryview(os.pread(fd, read_nbytes, slot * slot_nbytes))
            if len(raw) < read_nbytes:
                break
            header = parse_header(raw)
            if not isinstance(header, SlotHeader):
                continue
            if (header.file_id, header.slot, header.payload_nbytes) != (
                file_id,
                slot,
                payload_nbytes,
            ):
                continue
            if (
                verify_payload
                and checksum(raw[HEADER_NBYTES : HEADER_NBYTES + payload_nbytes])
                != header.payload_checksum
            ):
                continue
            yield ScannedSlot(writer_id, header)
    finally:
        os.close(fd)


def infer_payload_nbytes(root: Path) -> int | None:
    """A block's payload size, read from the first valid header at the start of any slot
    file (slot 0 sits at offset 0 whatever the slot size); None if no file has one."""
    for path in sorted(root.glob(f"*/*{FILE_SUFFIX}")):
        with path.open("rb") as file:
            header = parse_header(memoryview(file.read(HEADER_NBYTES).ljust(HEADER_NBYTES, b"\0")))
        if isinstance(header, SlotHeader):
            return header.payload_nbytes
    return None
