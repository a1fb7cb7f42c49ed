"""Workers' own-memory holdings, from the pool's allocator to a match answer: a worker's
`Holdings` as the allocator and host tier change, its updates applied by every shard of a
`HolderIndex`, and the merged answer equal to each worker's true leading run; a lost update,
a digest that differs, a new process and a goodbye each handled."""

from __future__ import annotations

import random
import tracemalloc

import numpy as np
import pytest

from services.kv_index.holders import HolderIndex
from shared.kv_index_client import MemoryHit, merge_holders
from shared.schema.kv_index import (
    HOLD_DEVICE,
    HOLD_HOST,
    HoldingsUpdate,
    MatchReply,
    digest_share,
)
from worker.engine.block_allocator import BlockAllocator
from worker.serving.holdings import Holdings

NUM_SHARDS = 3


def shards() -> list[HolderIndex]:
    return [HolderIndex(shard_id=s, num_shards=NUM_SHARDS) for s in range(NUM_SHARDS)]


def deliver(index: list[HolderIndex], update: HoldingsUpdate, holdings: Holdings) -> int:
    """`update` to every shard, each sync it asks answered at once; the number of syncs."""
    num_syncs = 0
    for shard in index:
        if shard.apply(update, 0.0):
            num_syncs += 1
            assert not shard.apply(holdings.snapshot(shard.shard_id, NUM_SHARDS), 0.0)
    return num_syncs


def answer(index: list[HolderIndex], chain: list[int]) -> dict[str, MemoryHit]:
    hashes = np.array(chain, np.uint64)
    replies = []
    for shard in index:
        first_owned, holders = shard.match(hashes)
        replies.append(
            MatchReply(
                shard_id=shard.shard_id,
                num_shards=NUM_SHARDS,
                first_owned_index=first_owned,
                holders=tuple(holders),
            )
        )
    return merge_holders(replies, len(chain))


def truth(masks: dict[str, dict[int, int]], chain: list[int]) -> dict[str, MemoryHit]:
    hits = {}
    for name, held in masks.items():
        memory = next((i for i, h in enumerate(chain) if h not in held), len(chain))
        device = next(
            (i for i, h in enumerate(chain) if not held.get(h, 0) & HOLD_DEVICE), len(chain)
        )
        if memory:
            hits[name] = MemoryHit(memory, min(device, memory))
    return hits


def test_the_pools_tags_become_a_workers_hit_on_every_shard() -> None:
    allocator = BlockAllocator(8)
    holdings = Holdings("prefill-0")
    allocator.on_hold = lambda h, held: holdings.set(h, HOLD_DEVICE, held)
    chain = [random.getrandbits(64) for _ in range(6)]
    pages = allocator.allocate(4)
    for page, block_hash in zip(pages, chain, strict=False):
        allocator.tag(page, block_hash)
    index = shards()
    assert deliver(index, holdings.take_update(), holdings) == NUM_SHARDS  # first: synced
    assert answer(index, chain) == {"prefill-0": MemoryHit(4, 4)}
    allocator.free(pages)
    allocator.allocate(8)  # every page handed out again: the tags are gone
    assert deliver(index, holdings.take_update(), holdings) == 0
    assert answer(index, chain) == {}
    assert all(not shard.blocks for shard in index)


def test_random_changes_from_several_workers_match_the_truth() -> None:
    rng = random.Random(7)
    universe = [rng.getrandbits(64) for _ in range(60)]
    workers = {f"w{i}": Holdings(f"w{i}") for i in range(4)}
    masks: dict[str, dict[int, int]] = {name: {} for name in workers}
    index = shards()
    for _ in range(40):
        for name, holdings in workers.items():
            for _ in range(rng.randrange(8)):
                block_hash, tier = rng.choice(universe), rng.choice((HOLD_DEVICE, HOLD_HOST))
                held = rng.random() < 0.7
                holdings.set(block_hash, tier, held)
                old = masks[name].get(block_hash, 0)
                new = old | tier if held else old & ~tier
                if new:
                    masks[name][block_hash] = new
                else:
                    masks[name].pop(block_hash, None)
            deliver(index, holdings.take_update(), holdings)
        chain = universe[: rng.randrange(1, 60)]
        assert answer(index, chain) == truth(masks, chain)


def test_a_lost_update_or_a_digest_that_differs_is_synced() -> None:
    holdings = Holdings("decode-0")
    index = shards()
    chain = [random.getrandbits(64) for _ in range(9)]
    deliver(index, holdings.take_update(), holdings)  # known, and its digests asked for
    for block_hash in chain[:5]:
        holdings.set(block_hash, HOLD_HOST, True)
    holdings.take_update()  # lost in flight
    holdings.set(chain[5], HOLD_HOST, True)
    assert deliver(index, holdings.take_update(), holdings) == NUM_SHARDS  # a gap on each
    assert answer(index, chain) == {"decode-0": MemoryHit(6, 0)}
    # A shard whose part was changed behind the worker's back: the next update's digest
    # differs and the shard syncs, even with nothing changed.
    victim = index[chain[0] % NUM_SHARDS]
    victim.blocks[chain[0]].pop("decode-0")
    held = victim.holders["decode-0"]
    held.hashes.discard(chain[0])
    held.digest ^= digest_share(chain[0], HOLD_HOST)  # its count is len(hashes)
    assert "decode-0" not in answer(index, chain)  # its first block lost here
    assert deliver(index, holdings.take_update(), holdings) == 1
    assert answer(index, chain) == {"decode-0": MemoryHit(6, 0)}


def test_a_new_process_replaces_the_old_ones_holdings_and_a_goodbye_drops_them() -> None:
    index = shards()
    chain = [random.getrandbits(64) for _ in range(4)]
    old = Holdings("prefill-1")
    deliver(index, old.take_update(), old)
    for block_hash in chain:
        old.set(block_hash, HOLD_DEVICE, True)
    deliver(index, old.take_update(), old)
    assert answer(index, chain) == {"prefill-1": MemoryHit(4, 4)}
    new = Holdings("prefill-1")  # restarted: another epoch, an empty pool
    new.set(chain[0], HOLD_DEVICE, True)
    deliver(index, new.take_update(), new)
    assert answer(index, chain) == {"prefill-1": MemoryHit(1, 1)}
    deliver(index, new.take_update(final=True), new)
    assert answer(index, chain) == {} and all(not s.holders for s in index)


def test_a_silent_holder_is_forgotten_after_its_ttl() -> None:
    shard = HolderIndex(ttl_s=5.0)
    holdings = Holdings("prefill-2")
    holdings.set(123, HOLD_DEVICE, True)
    assert shard.apply(holdings.take_update(), now_s=0.0)
    assert not shard.apply(holdings.snapshot(0, 1), now_s=0.0)
    assert shard.expire(4.0) == [] and shard.num_entries == 1
    assert shard.expire(5.5) == ["prefill-2"] and shard.num_entries == 0 and not shard.blocks


def test_memory_per_block_and_holder() -> None:
    """What docs/design.md states: the bytes one (block, holder) entry costs a shard."""
    holders = [Holdings(f"prefill-{i}") for i in range(8)]
    shard = HolderIndex()
    blocks = [random.getrandbits(64) for _ in range(22_000)]
    for holdings in holders:
        shard.apply(holdings.take_update(), 0.0)
        shard.apply(holdings.snapshot(0, 1), 0.0)
    tracemalloc.start()
    before, _ = tracemalloc.get_traced_memory()
    for i, holdings in enumerate(holders):
        for block_hash in blocks[i * 1000 : i * 1000 + 15_000]:  # overlapping: shared blocks
            holdings.set(block_hash, HOLD_DEVICE, True)
        assert not shard.apply(holdings.take_update(), 0.0)
    after, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    per_entry = (after - before) / shard.num_entries
    print(f"{shard.num_entries} entries: {per_entry:.0f} B per (block, holder)")
    assert shard.num_entries == 8 * 15_000
    assert 20 < per_entry < 400


def test_a_snapshot_of_a_shard_that_does_not_exist_is_refused() -> None:
    with pytest.raises(ValueError):
        Holdings("x").snapshot(3, 3)
