"""The router's map of sliding-window snapshots: full states, increments, gaps, restarts."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from services.router.swa_map import SwaMap
from shared.schema import pack_block_hashes
from shared.schema.swa import SwaHeld


def held(
    seq: int,
    added: Sequence[int] = (),
    removed: Sequence[int] = (),
    *,
    instance_id: str = "swa-memcache-a",
    node_id: str = "node-a",
    is_full: bool = False,
) -> SwaHeld:
    return SwaHeld(
        instance_id=instance_id,
        node_id=node_id,
        seq=seq,
        is_full=is_full,
        added=pack_block_hashes(added),
        removed=pack_block_hashes(removed),
    )


def test_full_state_then_increments_in_sequence() -> None:
    swa = SwaMap()
    assert not swa.apply(held(100, [1, 2], is_full=True), now_s=0)
    assert not swa.apply(held(101, [3], [1]), now_s=0)
    assert not swa.apply(held(102), now_s=0)  # a sweep's empty batch: nothing missed
    assert swa.holders(1) == frozenset()
    assert swa.holders(2) == swa.holders(3) == frozenset({"node-a"})
    assert swa.num_held("swa-memcache-a") == 2
    assert swa.counters.num_gaps == 0 and swa.counters.num_resyncs_asked == 0


def test_two_nodes_holding_one_snapshot() -> None:
    swa = SwaMap()
    swa.apply(held(1, [7], is_full=True), now_s=0)
    swa.apply(held(1, [7, 8], instance_id="swa-memcache-b", node_id="node-b", is_full=True), 0)
    assert swa.holders(7) == frozenset({"node-a", "node-b"})
    assert swa.holders(8) == frozenset({"node-b"}) and swa.holders(9) == frozenset()
    assert len(swa) == 2


def test_a_gap_asks_once_applies_anyway_and_a_full_state_repairs() -> None:
    swa = SwaMap(resync_interval_s=1.0)
    swa.apply(held(10, [1, 2], is_full=True), now_s=0)
    assert swa.apply(held(12, [3]), now_s=0.1)  # 11 was lost (it removed 2, say)
    assert swa.holders(3) == frozenset({"node-a"})  # still the best knowledge
    assert not swa.apply(held(14, [4]), now_s=0.2)  # another gap: already asked
    assert swa.apply(held(16), now_s=1.5)  # the answer never came: ask again
    assert not swa.apply(held(17, [5]), now_s=1.6)
    assert not swa.apply(held(18, [1, 3], is_full=True), now_s=1.7)  # the resync's answer
    assert swa.holders(2) == swa.holders(4) == swa.holders(5) == frozenset()
    assert swa.holders(1) == frozenset({"node-a"})
    assert swa.apply(held(20), now_s=1.8)  # a new gap after the full state: asked at once
    assert swa.counters.num_gaps == 4 and swa.counters.num_resyncs_asked == 3


def test_repeated_or_older_batches_are_ignored() -> None:
    swa = SwaMap()
    swa.apply(held(5, [1], is_full=True), now_s=0)
    swa.apply(held(6, [2]), now_s=0)
    assert not swa.apply(held(6, [9]), now_s=0)
    assert not swa.apply(held(4, [], [1]), now_s=0)
    assert swa.holders(1) == frozenset({"node-a"}) and swa.holders(9) == frozenset()
    assert swa.counters.num_stale_batches == 2


def test_an_unknown_instance_is_learnt_and_asked_for_its_state_once() -> None:
    swa = SwaMap()  # a router that started after the memcache and missed its full state
    assert swa.apply(held(50, [1]), now_s=0)
    assert swa.holders(1) == frozenset({"node-a"})
    assert not swa.apply(held(51, [2]), now_s=0.1)  # in sequence from there: no second ask
    assert swa.counters.num_unknown == 1 and swa.counters.num_resyncs_asked == 1


def test_restart_replaces_state_and_forget_drops_an_instance() -> None:
    swa = SwaMap()
    swa.apply(held(1_000, [1, 2], is_full=True), now_s=0)
    # Restarted: its clock-based sequence jumped, and it starts with its (empty) full state.
    assert not swa.apply(held(9_000, [], is_full=True), now_s=1)
    assert swa.holders(1) == frozenset()
    # A full state counts even with a lower sequence (the restarted host's clock is behind).
    assert not swa.apply(held(500, [3], is_full=True, node_id="node-a2"), now_s=2)
    assert swa.holders(3) == frozenset({"node-a2"})
    assert swa.forget("swa-memcache-a") and not swa.forget("swa-memcache-a")
    assert swa.holders(3) == frozenset() and len(swa) == 0


def test_malformed_hashes_are_refused_before_anything_is_applied() -> None:
    swa = SwaMap()
    swa.apply(held(1, [1], is_full=True), now_s=0)
    bad = SwaHeld(instance_id="swa-memcache-a", node_id="node-a", seq=2, added=b"\x01\x02")
    with pytest.raises(ValueError):
        swa.apply(bad, now_s=0)
    assert swa.apply(held(3), now_s=0)  # seq 2 was never applied: a gap, so a resync
