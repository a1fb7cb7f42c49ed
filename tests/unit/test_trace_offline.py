"""The offline trace replay (loadtest/trace/offline.py) through the real RoutePolicy and
KvIndex: with an unlimited cache it reproduces the trace's own repeat share exactly; no
cache, policy or capacity beats it; a bounded cache never beats an unlimited one under the
same placement; and what must hold of our policy against round-robin."""

from __future__ import annotations

import dataclasses

import pytest

from loadtest.trace.caches import BlockCache, WindowMap
from loadtest.trace.offline import ReplayConfig, ReplayResult, replay
from loadtest.trace.policies import OURS, OURS_PER_WORKER, POLICY_NAMES
from loadtest.trace.synth import (
    PromptHashes,
    TraceRequest,
    load_trace,
    prompt_token_ids,
    upper_bound_hits,
)
from shared.blocks import RequestBlocks

MODEL = "tiny-coder"
VOCAB = 8192
NUM_REQUESTS = 1000
SMALL_CACHE = 200_000  # tokens per worker: a few dozen prompts, so eviction bites


@pytest.fixture(scope="module")
def trace() -> list[TraceRequest]:
    return load_trace(limit=NUM_REQUESTS)


@pytest.fixture(scope="module")
def spaced(trace: list[TraceRequest]) -> list[TraceRequest]:
    """The same requests three hours apart: each one's prefill and decode end before the
    next arrives, so every earlier block is stored by then (what the repeat share means)."""
    return [dataclasses.replace(r, timestamp_ms=i * 10_800_000) for i, r in enumerate(trace)]


@pytest.fixture(scope="module")
def prompts() -> PromptHashes:
    return PromptHashes(MODEL, VOCAB)


@pytest.fixture(scope="module")
def repeat_hits(trace: list[TraceRequest]) -> list[int]:
    """Each request's tokens in 64-token blocks some earlier request had, from the synthetic
    prompts themselves: hashed here, looked up in a set (no cache, no replay code)."""
    seen: set[int] = set()
    hits = []
    for request in trace:
        blocks = RequestBlocks.hash_prompt(
            prompt_token_ids(request, VOCAB), model=MODEL, block_size_tokens=64
        )
        num_seen = 0
        while num_seen < len(blocks.hashes) and blocks.hashes[num_seen] in seen:
            num_seen += 1
        hits.append(64 * blocks.num_reusable_blocks(num_seen))
        seen.update(blocks.hashes)
    return hits


def _cached(result: ReplayResult) -> list[int]:
    return [o.num_cached_tokens for o in result.outcomes]


def test_the_upper_bound_from_hash_ids_is_the_repeat_share(
    trace: list[TraceRequest], repeat_hits: list[int]
) -> None:
    assert upper_bound_hits(trace) == repeat_hits
    assert sum(repeat_hits) > 0.15 * sum(r.input_length for r in trace)  # a real share


@pytest.mark.parametrize(
    ("num_workers", "shared", "policy"),
    [(1, False, OURS), (4, True, "round-robin"), (4, True, "random")],
)
def test_an_unlimited_cache_reproduces_the_repeat_share_exactly(
    spaced: list[TraceRequest],
    prompts: PromptHashes,
    repeat_hits: list[int],
    num_workers: int,
    shared: bool,
    policy: str,
) -> None:
    """One worker's cache, or one store every worker reads (kvfabric's SSD tier, so any
    placement will do): request by request, the replay hits what the trace repeats."""
    config = ReplayConfig(num_workers=num_workers, shared_cache=shared)
    result = replay(spaced, prompts, config, policy)
    assert _cached(result) == repeat_hits
    assert result.hit_rate == sum(repeat_hits) / sum(r.input_length for r in spaced)
    assert result.num_blocks_evicted == 0


def test_the_block_holding_the_last_token_is_stored_by_decode(prompts: PromptHashes) -> None:
    """A 1,024-token prompt: prefill computes 15 blocks (decode computes the last token), and
    decode writes the 16th when it ends; a later prompt extending it hits all 16."""
    first = TraceRequest(0, 0, 1024, 4, (0, 1))
    longer = TraceRequest(1, 3_600_000, 1500, 4, (0, 1, 2))
    result = replay([first, longer], prompts, ReplayConfig(num_workers=1))
    assert _cached(result) == [0, 1024] == upper_bound_hits([first, longer])


@pytest.mark.parametrize("policy", POLICY_NAMES)
@pytest.mark.parametrize("capacity", [None, SMALL_CACHE])
def test_no_replay_beats_the_upper_bound(
    trace: list[TraceRequest],
    prompts: PromptHashes,
    repeat_hits: list[int],
    policy: str,
    capacity: int | None,
) -> None:
    """At the trace's own pace (prefills overlapping, 4 caches), every policy, bounded or
    not: no request hits more than the blocks seen before it."""
    requests = trace[:600]  # a prefix of the trace: its bounds are the first 600
    config = ReplayConfig(num_workers=4, capacity_tokens=capacity, speed=4.0)
    result = replay(requests, prompts, config, policy)
    assert [o.index for o in result.outcomes] == [r.index for r in requests]  # all served
    assert all(c <= bound for c, bound in zip(_cached(result), repeat_hits, strict=False))
    assert all(o.ttft_s > 0 for o in result.outcomes)
    if capacity is not None:
        assert result.num_blocks_evicted > 0


@pytest.mark.parametrize("policy", ["round-robin", "random"])
def test_a_bounded_cache_never_beats_an_unlimited_one(
    spaced: list[TraceRequest], prompts: PromptHashes, policy: str
) -> None:
    """Placements that ignore the cache send each request to the same worker whatever the
    capacity; that worker's bounded cache holds a subset of its unlimited one."""
    unlimited = replay(spaced, prompts, ReplayConfig(num_workers=3), policy)
    bounded = replay(
        spaced, prompts, ReplayConfig(num_workers=3, capacity_tokens=SMALL_CACHE), policy
    )
    assert [o.prefill_worker_id for o in bounded.outcomes] == [
        o.prefill_worker_id for o in unlimited.outcomes
    ]
    assert bounded.num_blocks_evicted > 0
    assert all(b <= u for b, u in zip(_cached(bounded), _cached(unlimited), strict=True))


def test_ours_against_round_robin_on_an_idle_cluster(
    spaced: list[TraceRequest], prompts: PromptHashes, repeat_hits: list[int]
) -> None:
    """Nothing queued anywhere: the router's estimates tie but for the window it would
    replay, so it keeps each conversation where its prefix was computed (the first worker,
    or the node with the window) and reaches the upper bound; round-robin spreads prefixes
    over both caches and cannot do better. Bounded, its placement is the same, so its hits
    can only fall; round-robin's bounded run is compared with its own above."""
    config = ReplayConfig(num_workers=2)
    ours = replay(spaced, prompts, config, OURS)
    rr = replay(spaced, prompts, config, "round-robin")
    assert _cached(ours) == repeat_hits
    assert rr.hit_rate <= ours.hit_rate
    small = dataclasses.replace(config, capacity_tokens=SMALL_CACHE)
    ours_small = replay(spaced, prompts, small, OURS)
    assert [o.prefill_worker_id for o in ours_small.outcomes] == [
        o.prefill_worker_id for o in ours.outcomes
    ]
    assert all(s <= u for s, u in zip(_cached(ours_small), _cached(ours), strict=True))
    assert ours_small.hit_rate < ours.hit_rate  # it did evict something needed again


def test_per_worker_hits_send_each_request_to_its_longest_prefix(
    spaced: list[TraceRequest], prompts: PromptHashes, repeat_hits: list[int]
) -> None:
    """Given each worker's own hit, the estimate is least where the most is cached: on an
    idle cluster every request finds its whole repeated prefix, over any number of caches."""
    result = replay(spaced, prompts, ReplayConfig(num_workers=4), OURS_PER_WORKER)
    assert _cached(result) == repeat_hits


def test_a_replay_is_deterministic(trace: list[TraceRequest], prompts: PromptHashes) -> None:
    config = ReplayConfig(num_workers=4, capacity_tokens=SMALL_CACHE, speed=8.0)
    first, again = (replay(trace[:400], prompts, config, "random") for _ in range(2))
    assert first.outcomes == again.outcomes


def test_bad_configs_are_refused(trace: list[TraceRequest], prompts: PromptHashes) -> None:
    with pytest.raises(ValueError, match="num_workers must be > 0"):
        ReplayConfig(num_workers=0)
    with pytest.raises(ValueError, match="capacity_tokens must be > 0"):
        ReplayConfig(capacity_tokens=0)
    with pytest.raises(ValueError, match="speed and heartbeat_s must be > 0"):
        ReplayConfig(speed=-1)
    with pytest.raises(ValueError, match="unknown policy 'fastest'"):
        replay(trace[:5], prompts, ReplayConfig(), "fastest")
    with pytest.raises(ValueError, match="no requests"):
        replay([], prompts, ReplayConfig())
    with pytest.raises(ValueError, match="requests must be in arrival order"):
        replay([trace[300], trace[0]], prompts, ReplayConfig())


def test_a_cache_evicts_the_least_recently_used_past_its_capacity() -> None:
    cache = BlockCache(capacity_blocks=50, ttl_s=600.0)
    old, new = list(range(1, 41)), list(range(101, 141))
    cache.store("w", old, now_s=1.0)
    assert cache.num_blocks_evicted == 0
    cache.store("w", new, now_s=2.0)  # 80 > 50: down to 45, the older chain first
    assert cache.num_blocks_evicted == 35
    assert cache.num_hit_blocks(new, 3.0, refresh=False) == 40
    assert cache.num_hit_blocks(old, 3.0, refresh=False) <= 5
    cache.num_hit_blocks(new[:10], 4.0, refresh=True)  # read: the newest now
    cache.store("w", list(range(201, 221)), now_s=5.0)  # 65 > 50: 20 go, from new[10:]
    assert cache.num_hit_blocks(new, 6.0, refresh=False) >= 10


def test_a_window_is_held_for_its_ttl() -> None:
    windows = WindowMap(ttl_s=180.0)
    windows.put(7, "node-1", 10.0)
    assert windows.holders(7, 190.0) == {"node-1"}
    assert windows.holders(7, 190.5) == frozenset()
    assert windows.holders(None, 10.0) == frozenset()
