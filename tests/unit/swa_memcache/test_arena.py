from __future__ import annotations

import pytest

from services.swa_memcache.arena import Arena, Region


def _allocate(arena: Arena, nbytes: int) -> Region:
    region = arena.allocate(nbytes)
    assert region is not None
    return region


def test_first_fit_allocation_and_exhaustion() -> None:
    arena = Arena(100)
    a, b = arena.allocate(30), arena.allocate(70)
    assert (a, b) == (Region(0, 30), Region(30, 70))
    assert arena.used_bytes == 100 and arena.free_bytes == 0
    assert arena.allocate(1) is None
    assert arena.allocate(0) == Region(0, 0)  # empty: takes no space
    arena.free(Region(0, 0))
    assert arena.used_bytes == 100


def test_freeing_merges_neighbours_into_one_extent() -> None:
    arena = Arena(100)
    regions = [_allocate(arena, 20) for _ in range(5)]
    arena.free(regions[1])
    arena.free(regions[3])
    assert arena.num_free_extents == 2
    arena.free(regions[2])  # bridges the two holes on either side
    assert arena.num_free_extents == 1 and arena.largest_free_bytes == 60
    assert arena.allocate(60) == Region(20, 60)
    for region in (regions[0], regions[4], Region(20, 60)):
        arena.free(region)
    assert arena.num_free_extents == 1 and arena.largest_free_bytes == 100
    assert arena.used_bytes == 0


def test_fragmentation_refuses_though_free_bytes_add_up() -> None:
    arena = Arena(100)
    regions = [_allocate(arena, 25) for _ in range(4)]
    arena.free(regions[0])
    arena.free(regions[2])
    assert arena.free_bytes == 50 and arena.largest_free_bytes == 25
    assert not arena.can_allocate(30)
    assert arena.allocate(30) is None
    assert arena.allocate(25) == Region(0, 25)  # first fit: the lowest hole
    assert arena.allocate(10) == Region(50, 10)


def test_bad_frees_are_refused() -> None:
    arena = Arena(64)
    region = _allocate(arena, 16)
    arena.free(region)
    with pytest.raises(ValueError):
        arena.free(region)  # double free
    with pytest.raises(ValueError):
        arena.free(Region(8, 8))  # never allocated
    with pytest.raises(ValueError):
        arena.allocate(-1)
    with pytest.raises(ValueError):
        Arena(0)
