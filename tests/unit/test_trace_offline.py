"""The offline trace replay (loadtest/trace/offline.py) through the real RoutePolicy and
KvIndex, over each worker's own memory and the shared store: the store reproduces the
trace's own repeat share exactly under any placement; no memory, policy or capacity beats
it; a bounded memory never beats an unlimited one under the same placement; the oracle
reaches the upper bound; kv keeps each prefix where it was computed on an idle cluster; and
the store's bytes are what the requests read from it."""

from __future__ import annotations

import dataclasses

import pytest

from loadtest.trace.caches import BlockCache, WindowMap
from loadtest.trace.offline import ORACLE, POLICY_NAMES, ReplayConfig, ReplayResult, replay
from loadtest.trace.synth import (
    PromptHashes,
    TraceRequest,
    load_trace,
    prompt_token_ids,
    upper_bound_hits,
)
from services.router.policy import KV, LEAST_LOADED, ROUND_ROBIN
from shared.blocks import RequestBlocks
from worker.cost_model import CostModel

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


def _local(result: ReplayResult) -> list[int]:
    return [o.num_local_tokens for o in result.outcomes]


def test_the_upper_bound_from_hash_ids_is_the_repeat_share(
    trace: list[TraceRequest], repeat_hits: list[int]
) -> None:
    assert upper_bound_hits(trace) == repeat_hits
    assert sum(repeat_hits) > 0.15 * sum(r.input_length for r in trace)  # a real share


@pytest.mark.parametrize(
    ("num_workers", "policy"), [(1, KV), (4, ROUND_ROBIN), (4, LEAST_LOADED), (4, ORACLE)]
)
def test_the_store_reproduces_the_repeat_share_exactly(
    spaced: list[TraceRequest],
    prompts: PromptHashes,
    repeat_hits: list[int],
    num_workers: int,
    policy: str,
) -> None:
    """The store keeps every block any worker wrote, so any placement will do: request by
    request, the replay hits what the trace repeats."""
    result = replay(spaced, prompts, ReplayConfig(num_workers=num_workers), policy)
    assert _cached(result) == repeat_hits
    assert result.hit_rate == sum(repeat_hits) / sum(r.input_length for r in spaced)
    assert result.num_blocks_evicted == 0
    assert all(loc <= c for loc, c in zip(_local(result), _cached(result), strict=True))


def test_the_block_holding_the_last_token_is_stored_by_decode(prompts: PromptHashes) -> None:
    """A 1,024-token prompt: prefill computes 15 blocks (decode computes the last token), and
    decode writes the 16th to the store when it ends; a later prompt extending it hits all
    16, the 16th from the store."""
    first = TraceRequest(0, 0, 1024, 4, (0, 1))
    longer = TraceRequest(1, 3_600_000, 1500, 4, (0, 1, 2))
    result = replay([first, longer], prompts, ReplayConfig(num_workers=1))
    assert _cached(result) == [0, 1024] == upper_bound_hits([first, longer])
    assert _local(result) == [0, 960]


@pytest.mark.parametrize("policy", POLICY_NAMES)
@pytest.mark.parametrize("capacity", [None, SMALL_CACHE])
def test_no_replay_beats_the_upper_bound(
    trace: list[TraceRequest],
    prompts: PromptHashes,
    repeat_hits: list[int],
    policy: str,
    capacity: int | None,
) -> None:
    """At the trace's own pace (prefills overlapping, 4 workers), every policy, bounded or
    not, the store starved or not: no request hits more than the blocks seen before it."""
    requests = trace[:600]  # a prefix of the trace: its bounds are the first 600
    config = ReplayConfig(
        num_workers=4, capacity_tokens=capacity, speed=4.0, store_gbps_per_gpu=capacity and 2.0
    )
    result = replay(requests, prompts, config, policy)
    assert [o.index for o in result.outcomes] == [r.index for r in requests]  # all served
    assert all(c <= bound for c, bound in zip(_cached(result), repeat_hits, strict=False))
    assert all(o.ttft_s > 0 for o in result.outcomes)
    if capacity is not None:
        assert result.num_blocks_evicted > 0


def test_a_bounded_memory_never_beats_an_unlimited_one(
    spaced: list[TraceRequest], prompts: PromptHashes
) -> None:
    """Round-robin sends each request to the same worker whatever the capacity; that
    worker's bounded memory holds a subset of its unlimited one, and the store the rest."""
    unlimited = replay(spaced, prompts, ReplayConfig(num_workers=3), ROUND_ROBIN)
    bounded = replay(
        spaced, prompts, ReplayConfig(num_workers=3, capacity_tokens=SMALL_CACHE), ROUND_ROBIN
    )
    assert [o.prefill_worker_id for o in bounded.outcomes] == [
        o.prefill_worker_id for o in unlimited.outcomes
    ]
    assert bounded.num_blocks_evicted > 0
    assert all(b <= u for b, u in zip(_local(bounded), _local(unlimited), strict=True))
    assert _cached(bounded) == _cached(unlimited)
    assert bounded.local_hit_rate < unlimited.local_hit_rate


def test_with_unlimited_memory_the_oracle_reaches_the_upper_bound(
    spaced: list[TraceRequest], prompts: PromptHashes, repeat_hits: list[int]
) -> None:
    bound = sum(repeat_hits) / sum(r.input_length for r in spaced)
    oracle = replay(spaced, prompts, ReplayConfig(num_workers=4), ORACLE)
    assert oracle.hit_rate == bound
    one = replay(spaced, prompts, ReplayConfig(num_workers=1), ORACLE)
    assert _local(one) == repeat_hits  # one worker's memory holds every block seen


def test_kv_keeps_each_prefix_where_it_was_computed_on_an_idle_cluster(
    spaced: list[TraceRequest], prompts: PromptHashes
) -> None:
    """Nothing queued anywhere: the estimates differ by the load of the hit, faster from a
    worker's own memory than from the store, so kv sends each request to the worker holding
    the most of it, as the oracle does; round-robin spreads prefixes over the workers."""
    config = ReplayConfig(num_workers=4)
    kv = replay(spaced, prompts, config, KV)
    oracle = replay(spaced, prompts, config, ORACLE)
    rr = replay(spaced, prompts, config, ROUND_ROBIN)
    assert _local(kv) == _local(oracle)
    assert rr.local_hit_rate < kv.local_hit_rate
    assert kv.store_bytes_read < rr.store_bytes_read


def test_the_store_counts_the_bytes_requests_read_from_it(
    trace: list[TraceRequest], prompts: PromptHashes
) -> None:
    cost = CostModel()
    config = ReplayConfig(num_workers=4, capacity_tokens=SMALL_CACHE, speed=4.0, cost=cost)
    result = replay(trace[:400], prompts, config, ROUND_ROBIN)
    read = sum(o.num_cached_tokens - o.num_local_tokens for o in result.outcomes)
    assert result.store_bytes_read == read * cost.kv_bytes_per_token > 0
    assert result.store_bytes_per_s == result.store_bytes_read / result.end_s


def test_a_starved_store_slows_what_reads_from_it(
    trace: list[TraceRequest], prompts: PromptHashes
) -> None:
    """The same placement (round-robin) with the store at 0.05 GB/s per GPU: requests wait
    for its bandwidth, so TTFT grows; with every block in memory nothing reads the store."""
    base = ReplayConfig(num_workers=4, capacity_tokens=SMALL_CACHE, speed=4.0)
    free = replay(trace[:400], prompts, base, ROUND_ROBIN)
    starved_config = dataclasses.replace(base, store_gbps_per_gpu=0.05)
    starved = replay(trace[:400], prompts, starved_config, ROUND_ROBIN)
    assert starved.mean_ttft_s > 1.5 * free.mean_ttft_s
    assert _cached(starved) == _cached(free)


def test_a_replay_is_deterministic(trace: list[TraceRequest], prompts: PromptHashes) -> None:
    config = ReplayConfig(num_workers=4, capacity_tokens=SMALL_CACHE, speed=8.0)
    first, again = (replay(trace[:400], prompts, config, LEAST_LOADED) for _ in range(2))
    assert first.outcomes == again.outcomes


def test_bad_configs_are_refused(trace: list[TraceRequest], prompts: PromptHashes) -> None:
    with pytest.raises(ValueError, match="num_workers must be > 0"):
        ReplayConfig(num_workers=0)
    with pytest.raises(ValueError, match="capacity_tokens must be > 0"):
        ReplayConfig(capacity_tokens=0)
    with pytest.raises(ValueError, match="store_gbps_per_gpu must be > 0"):
        ReplayConfig(store_gbps_per_gpu=0)
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
