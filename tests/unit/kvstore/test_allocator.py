"""Slot allocation: order, capacity, generations, stale frees, adoption after a restart."""

from __future__ import annotations

import pytest

from worker.kvstore.allocator import Allocation, SlotAllocator


def test_fills_files_in_order_then_reports_full():
    allocator = SlotAllocator(max_num_slots=5, slots_per_file=2, epoch=1)
    got = [allocator.allocate() for _ in range(6)]
    assert [(a.file_id, a.slot) for a in got[:5] if a] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0)]
    assert got[5] is None
    assert allocator.num_used == 5
    assert allocator.num_slots_in_file(2) == 1  # the last file holds only the share's rest
    assert allocator.num_slots_in_file(3) == 0


def test_reuse_bumps_generation_and_rejects_stale_free():
    allocator = SlotAllocator(max_num_slots=1, slots_per_file=1, epoch=7)
    first = allocator.allocate()
    assert first is not None and first.generation == (7 << 20) | 1
    assert allocator.free(first.file_id, first.slot, first.generation)
    assert not allocator.free(first.file_id, first.slot, first.generation)  # twice: no-op
    second = allocator.allocate()
    assert second is not None and second.generation == (7 << 20) | 2
    assert not allocator.free(0, 0, first.generation)  # a late free of the old block
    assert allocator.allocate() is None


def test_new_epoch_outranks_every_earlier_generation():
    before = SlotAllocator(1, 1, epoch=1)
    for _ in range(1000):
        a = before.allocate()
        assert a is not None
        before.free(a.file_id, a.slot, a.generation)
    after = SlotAllocator(1, 1, epoch=2).allocate()
    assert after is not None and after.generation > a.generation


def test_generations_fit_32_bits_and_skip_zero_when_they_wrap():
    allocator = SlotAllocator(1, 1, epoch=(1 << 12) + 5)  # the epoch wraps at 12 bits
    allocator._rewrites[0] = (1 << 20) - 3  # a slot rewritten a million times this run
    got = []
    for _ in range(3):
        a = allocator.allocate()
        assert a is not None
        got.append(a.generation)
        allocator.free(a.file_id, a.slot, a.generation)
    assert got == [(5 << 20) | ((1 << 20) - 2), (5 << 20) | ((1 << 20) - 1), (5 << 20) | 1]
    assert max(got) < 1 << 32  # kv-index keeps generations as u32


def test_adopt_keeps_found_slots_and_frees_the_gaps():
    allocator = SlotAllocator(max_num_slots=10, slots_per_file=4, epoch=3)
    allocator.adopt([Allocation(0, 1, 99), Allocation(1, 0, 98)])  # indices 1 and 4
    assert allocator.num_used == 2
    order = [allocator.allocate() for _ in range(4)]
    assert [(a.file_id, a.slot) for a in order if a] == [(0, 0), (0, 2), (0, 3), (1, 1)]
    assert allocator.free(0, 1, 99)
    with pytest.raises(RuntimeError):
        allocator.adopt([])
