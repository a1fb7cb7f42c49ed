"""Slot header format and the pure checks every read runs."""

from __future__ import annotations

import os

from shared.schema import BlockLocation
from worker.kvstore.slots import (
    HEADER_NBYTES,
    MissReason,
    SlotGeometry,
    SlotHeader,
    SlotRef,
    check_slot,
    checksum,
    pack_header,
    parse_header,
    slot_nbytes_for,
)

PAYLOAD_NBYTES = 98_304


def make_slot(block_hash: int = 7, generation: int = 3, payload: bytes | None = None):
    payload = payload if payload is not None else os.urandom(PAYLOAD_NBYTES)
    raw = bytearray(slot_nbytes_for(len(payload)))
    header = SlotHeader(block_hash, generation, len(payload), checksum(payload), 2, 5, 123)
    pack_header(header, memoryview(raw))
    raw[HEADER_NBYTES : HEADER_NBYTES + len(payload)] = payload
    return raw, header, SlotRef(block_hash, "w", 2, 5, generation)


def test_slot_size_is_page_aligned_with_header():
    assert slot_nbytes_for(PAYLOAD_NBYTES) == 102_400
    assert slot_nbytes_for(4096 - HEADER_NBYTES) == 4096
    assert slot_nbytes_for(2 << 20) == (2 << 20) + 4096
    geometry = SlotGeometry.for_payload(PAYLOAD_NBYTES, file_nbytes=1 << 20)
    assert geometry.slots_per_file == 10
    assert geometry.offset(3) == 3 * 102_400


def test_ref_from_an_index_location():
    location = BlockLocation(7, "ssd", 2, 5, 3, writer_id="prefill-0", num_bytes=PAYLOAD_NBYTES)
    assert SlotRef.from_location(location) == SlotRef(7, "prefill-0", 2, 5, 3)


def test_header_round_trips():
    raw, header, _ = make_slot()
    assert parse_header(memoryview(raw)) == header


def test_intact_slot_passes():
    raw, _, ref = make_slot()
    assert check_slot(memoryview(raw), ref, PAYLOAD_NBYTES) is None


def test_each_damage_has_its_reason():
    raw, _, ref = make_slot()
    cases = {
        MissReason.EMPTY: bytearray(len(raw)),
        MissReason.BAD_MAGIC: bytearray(b"XXXX") + raw[4:],
        MissReason.BAD_VERSION: raw[:4] + bytearray(b"\x09\x00") + raw[6:],
        MissReason.BAD_HEADER: raw[:30] + bytearray([raw[30] ^ 1]) + raw[31:],
        MissReason.CHECKSUM: raw[:100] + bytearray([raw[100] ^ 0x80]) + raw[101:],
    }
    for reason, damaged in cases.items():
        assert check_slot(memoryview(damaged), ref, PAYLOAD_NBYTES) is reason, reason


def test_reused_slot_is_wrong_block_or_generation():
    raw, _, ref = make_slot(block_hash=7, generation=3)
    view = memoryview(raw)
    assert check_slot(view, SlotRef(8, "w", 2, 5, 3), PAYLOAD_NBYTES) is MissReason.WRONG_BLOCK
    assert check_slot(view, SlotRef(7, "w", 2, 5, 2), PAYLOAD_NBYTES) is (
        MissReason.WRONG_GENERATION
    )
    # A slot found at another address than its header names (misplaced bytes) is rejected.
    assert check_slot(view, SlotRef(7, "w", 2, 6, 3), PAYLOAD_NBYTES) is MissReason.BAD_HEADER
    assert check_slot(view, ref, PAYLOAD_NBYTES - 1) is MissReason.BAD_HEADER
