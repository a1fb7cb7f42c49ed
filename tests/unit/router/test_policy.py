"""Routing rules: cache-aware, load-aware, SLO rejection, decode pages, retries, no workers.

Expected numbers come from the cost model the policy uses, never typed in by hand.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from services.router.policy import PolicyConfig, Rejection, RequestFacts, RoutePolicy
from shared.blocks import RequestBlocks
from shared.load_table import InflightDelta
from shared.schema import GenerateRequest, pack_token_ids
from shared.schema.control import LoadReport
from shared.schema.errors import ErrorCode, Overloaded, Unavailable
from shared.schema.inference import RouteDecision, SamplingParams
from shared.subjects import VLLM_WORKER
from tests.unit.router.helpers import decoder, facts, report, table_with
from worker.cost_model import CostModel

# Round numbers so a reader can follow them: a 128-token replay costs 1.28 s, more than the
# 1 s of compute a 1,000-token queue costs, so the SWA snapshot can outweigh a longer queue.
COST = CostModel(
    prefill_tokens_per_s=1000.0,
    load_tokens_per_s=10_000.0,
    replay_tokens=128,
    replay_tokens_per_s=100.0,
)
NO_SLO = RoutePolicy(COST, PolicyConfig(ttft_objective_s=None, max_queued_tokens=10**9))
HIT = facts(num_prompt_tokens=2000, num_cached_tokens=1024)


def ttft(policy: RoutePolicy, f: RequestFacts, queued: int, has_swa: bool) -> float:
    return policy.cost.prefill(
        num_queued_tokens=queued,
        num_prompt_tokens=f.num_prompt_tokens,
        num_cached_tokens=f.num_cached_tokens,
        has_swa_snapshot=has_swa,
    ).ttft_s


def route(policy: RoutePolicy, *reports, swa=(), f=HIT, now_s=0.0) -> RouteDecision:
    decision = policy.choose(f, table_with(*reports, decoder()), set(swa), now_s)
    assert isinstance(decision, RouteDecision), decision
    return decision


@pytest.mark.parametrize(("queued_swa", "expected"), [(1000, "b"), (3000, "a")])
def test_swa_snapshot_wins_until_the_queue_costs_more_than_the_replay(queued_swa, expected):
    a = report("a", node_id="n-a", queued_tokens=500)
    b = report("b", node_id="n-b", queued_tokens=queued_swa)
    ttft_a = ttft(NO_SLO, HIT, 500, has_swa=False)
    ttft_b = ttft(NO_SLO, HIT, queued_swa, has_swa=True)
    assert (ttft_b < ttft_a) == (expected == "b")  # the case is what its name says
    decision = route(NO_SLO, a, b, swa={"n-b"})
    assert decision.prefill_worker_id == expected
    assert decision.has_swa_snapshot == (expected == "b")
    assert decision.estimated_ttft_ms == pytest.approx(min(ttft_a, ttft_b) * 1000)
    assert decision.num_cached_tokens == HIT.num_cached_tokens


def test_without_a_hit_the_snapshot_does_not_matter_and_the_shorter_queue_wins():
    miss = facts(num_prompt_tokens=2000, num_cached_tokens=0)
    a = report("a", node_id="n-a", queued_tokens=500)
    b = report("b", node_id="n-b", queued_tokens=600)
    decision = route(NO_SLO, a, b, swa={"n-b"}, f=miss)
    assert (decision.prefill_worker_id, decision.has_swa_snapshot) == ("a", False)


def test_load_aware_inflight_work_moves_the_next_request():
    policy = NO_SLO
    table = table_with(report("a", queued_tokens=100), report("b", queued_tokens=300), decoder())
    first = policy.choose(HIT, table, set(), 0.0)
    assert isinstance(first, RouteDecision) and first.prefill_worker_id == "a"
    for delta in policy.inflight_deltas("r1", first, HIT):
        table.record_sent(delta, 0.0)
    # a now has 100 + the job's tokens queued (compute, replay, and the load of its 1,024
    # cached tokens at 10K tokens/s in compute-token equivalents), more than b's 300.
    job = HIT.num_prompt_tokens - 1024 + 128 * 10 + round(1024 / 10_000 * 1000)
    assert table.view("a", 0.0).num_queued_tokens == 100 + job
    second = policy.choose(HIT, table, set(), 0.0)
    assert isinstance(second, RouteDecision) and second.prefill_worker_id == "b"


def test_ties_go_to_fewer_inflight_requests_then_the_smaller_id():
    policy = NO_SLO
    table = table_with(report("b"), report("a"), report("c"), decoder())
    first = policy.choose(HIT, table, set(), 0.0)
    assert first.prefill_worker_id == "a"
    table.record_sent(InflightDelta("r1", "b"), 0.0)
    # b has one request in flight (no tokens), a and c none: a still, then c over b.
    assert policy.prefill_options(HIT, table, set(), 0.0)[1].worker.instance_id == "c"


def test_slo_rejects_with_the_time_until_the_best_queue_drains_to_the_objective():
    policy = RoutePolicy(COST, PolicyConfig(ttft_objective_s=3.0, max_queued_tokens=10**9))
    a = report("a", node_id="n-a", queued_tokens=4000)
    b = report("b", node_id="n-b", queued_tokens=5000)
    table = table_with(a, b, decoder())
    outcome = policy.choose(HIT, table, {"n-b"}, 0.0)
    assert isinstance(outcome, Rejection) and outcome.code == ErrorCode.OVERLOADED
    expected = min(ttft(policy, HIT, 4000, False), ttft(policy, HIT, 5000, True)) - 3.0
    assert outcome.retry_after_s == pytest.approx(expected)
    assert isinstance(outcome.to_error(), Overloaded)
    # After retry_after_s the best queue has drained by retry_after_s x compute rate: admitted.
    drained = math.ceil(expected * COST.prefill_tokens_per_s)
    table.observe(report("b", node_id="n-b", queued_tokens=5000 - drained), 0.1)
    table.observe(report("a", node_id="n-a", queued_tokens=4000 - drained), 0.1)
    decision = policy.choose(HIT, table, {"n-b"}, 0.1)
    assert isinstance(decision, RouteDecision)
    assert 2999.0 < decision.estimated_ttft_ms <= 3000.0


def test_a_request_over_the_objective_on_its_own_is_admitted_to_an_idle_worker():
    policy = RoutePolicy(COST, PolicyConfig(ttft_objective_s=0.5))
    huge = facts(num_prompt_tokens=5000)  # 5 s of compute alone
    decision = route(policy, report("a", queued_tokens=0), report("b", queued_tokens=10))
    assert decision.prefill_worker_id == "a"
    busy = table_with(report("a", queued_tokens=200), decoder())
    outcome = policy.choose(huge, busy, set(), 0.0)
    assert isinstance(outcome, Rejection)
    assert outcome.retry_after_s == pytest.approx(COST.queue_wait_s(200))


def test_full_queues_reject_with_the_time_to_make_room():
    policy = RoutePolicy(COST, PolicyConfig(ttft_objective_s=None, max_queued_tokens=3000))
    miss = facts(num_prompt_tokens=1000)
    table = table_with(report("a", queued_tokens=2500), report("b", queued_tokens=2800), decoder())
    outcome = policy.choose(miss, table, set(), 0.0)
    assert isinstance(outcome, Rejection) and outcome.code == ErrorCode.OVERLOADED
    assert outcome.retry_after_s == pytest.approx(COST.queue_wait_s(2500 + 1000 - 3000))
    assert isinstance(policy.choose(facts(num_prompt_tokens=500), table, set(), 0.0), RouteDecision)


def test_decode_needs_room_for_prompt_and_max_tokens_then_prefers_the_smaller_batch():
    policy = NO_SLO
    f = facts(num_prompt_tokens=1000, max_tokens=280)  # 1,280 tokens = 20 pages of 64
    assert policy.pages_needed(f) == 20
    table = table_with(
        report("p"),
        decoder("d-full", pages_free=19, running=0),
        decoder("d-busy", pages_free=500, running=8),
        decoder("d-light", pages_free=20, running=2),
        decoder("d-light2", pages_free=40, running=2),
    )
    decision = policy.choose(f, table, set(), 0.0)
    assert decision.decode_worker_id == "d-light2"  # batch 2 ties, more free pages
    for delta in policy.inflight_deltas("r1", decision, f):
        table.record_sent(delta, 0.0)
    assert table.view("d-light2", 0.0).num_kv_pages_free == 20
    assert policy.choose(f, table, set(), 0.0).decode_worker_id == "d-light"  # batch 2 < 3


def test_decode_without_room_is_overloaded_and_a_too_long_request_is_bad():
    policy = NO_SLO
    table = table_with(report("p"), decoder("d", pages_free=10, pages_total=100))
    full = policy.choose(facts(num_prompt_tokens=1000, max_tokens=0), table, set(), 0.0)
    assert isinstance(full, Rejection) and full.code == ErrorCode.OVERLOADED
    assert full.retry_after_s == policy.config.decode_retry_after_s
    too_long = policy.choose(facts(num_prompt_tokens=7000), table, set(), 0.0)
    assert isinstance(too_long, Rejection) and too_long.code == ErrorCode.BAD_REQUEST


def test_retry_excludes_the_dead_worker_and_happens_once():
    policy = NO_SLO
    table = table_with(report("a", queued_tokens=0), report("b", queued_tokens=900), decoder())
    first = policy.choose(HIT, table, set(), 0.0)
    assert first.prefill_worker_id == "a"
    retry = policy.retry_target(first, HIT, table, set(), 0.0, attempt=0)
    assert isinstance(retry, RouteDecision)
    assert (retry.prefill_worker_id, retry.decode_worker_id) == ("b", first.decode_worker_id)
    again = policy.retry_target(retry, HIT, table, set(), 0.0, attempt=1)
    assert isinstance(again, Rejection) and again.code == ErrorCode.UNAVAILABLE


def test_retry_of_an_admitted_request_ignores_the_objective_but_not_full_queues():
    policy = RoutePolicy(COST, PolicyConfig(ttft_objective_s=1.0, max_queued_tokens=10_000))
    table = table_with(report("a"), report("b", queued_tokens=5000), decoder())
    first = policy.choose(HIT, table, set(), 0.0)
    assert first.prefill_worker_id == "a"
    retry = policy.retry_target(first, HIT, table, set(), 0.0, attempt=0)
    assert isinstance(retry, RouteDecision) and retry.prefill_worker_id == "b"
    assert retry.estimated_ttft_ms > 1000.0
    table.observe(report("b", queued_tokens=9500), 0.0)
    full = policy.retry_target(first, HIT, table, set(), 0.0, attempt=0)
    assert isinstance(full, Rejection) and full.code == ErrorCode.OVERLOADED


def test_retry_with_no_other_worker_and_a_vanished_decoder():
    policy = NO_SLO
    table = table_with(report("a"), decoder("d1"))
    first = policy.choose(HIT, table, set(), 0.0)
    alone = policy.retry_target(first, HIT, table, set(), 0.0, attempt=0)
    assert isinstance(alone, Rejection) and alone.code == ErrorCode.UNAVAILABLE
    table.observe(report("b"), 0.0)
    table.observe(decoder("d2"), 0.0)
    table.remove("d1")
    retry = policy.retry_target(first, HIT, table, set(), 0.0, attempt=0)
    assert (retry.prefill_worker_id, retry.decode_worker_id) == ("b", "d2")


def test_no_workers_is_a_typed_rejection_not_an_exception():
    policy = RoutePolicy()
    no_prefill = policy.choose(HIT, table_with(decoder()), set(), 0.0)
    no_decode = policy.choose(HIT, table_with(report("a")), set(), 0.0)
    for outcome, service in ((no_prefill, "prefill"), (no_decode, "decode")):
        assert isinstance(outcome, Rejection) and outcome.code == ErrorCode.UNAVAILABLE
        assert service in outcome.reason
        error = outcome.to_error()
        assert isinstance(error, Unavailable) and error.numeric_code == 503


def test_facts_keep_one_token_to_compute_and_name_the_boundary():
    tokens = list(range(64))  # exactly 4 blocks
    blocks = RequestBlocks.hash_prompt(tokens, model="m", block_size_tokens=16)
    request = GenerateRequest(
        request_id="r",
        model="m",
        prompt_token_ids=pack_token_ids(tokens),
        block_hashes=blocks.packed(),
        block_size_tokens=16,
        sampling=SamplingParams(max_tokens=7),
    )
    full_hit = RequestFacts.of(request, blocks, num_hit_blocks=4)
    assert (full_hit.num_cached_tokens, full_hit.boundary_block_hash) == (48, blocks.hashes[2])
    assert full_hit.max_tokens == 7 and full_hit.num_prompt_tokens == 64
    miss = RequestFacts.of(request, blocks, num_hit_blocks=0)
    assert (miss.num_cached_tokens, miss.boundary_block_hash) == (0, None)


# -- aggregated workers (vLLM: prefill and decode in one) --------------------------------------
def aggregated(instance_id: str, **kwargs: object) -> object:
    return report(instance_id, service=VLLM_WORKER, **kwargs)  # type: ignore[arg-type]


def test_a_model_only_aggregated_workers_serve_goes_whole_to_the_fastest_with_room() -> None:
    a = aggregated("v-a", queued_tokens=3000)
    b = aggregated("v-b", queued_tokens=500)
    full = aggregated("v-full", queued_tokens=0, pages_free=1)  # fastest, but no room
    decision = NO_SLO.choose(HIT, table_with(a, b, full), set(), 0.0)
    assert isinstance(decision, RouteDecision), decision
    assert decision.aggregated
    assert decision.prefill_worker_id == decision.decode_worker_id == "v-b"
    assert decision.estimated_ttft_ms == pytest.approx(ttft(NO_SLO, HIT, 500, False) * 1000)
    # Both in-flight deltas land on the one worker: its queue and its pages.
    prefill_delta, decode_delta = NO_SLO.inflight_deltas("r1", decision, HIT)
    assert prefill_delta.instance_id == decode_delta.instance_id == "v-b"
    assert prefill_delta.num_tokens > 0 and decode_delta.num_kv_pages == NO_SLO.pages_needed(HIT)


def test_prefill_and_decode_pairs_keep_a_model_they_serve_beside_aggregated_workers() -> None:
    table = table_with(report("p1"), decoder("d1"), aggregated("v-a"))
    decision = NO_SLO.choose(HIT, table, set(), 0.0)
    assert isinstance(decision, RouteDecision) and not decision.aggregated
    assert (decision.prefill_worker_id, decision.decode_worker_id) == ("p1", "d1")


def test_aggregated_workers_are_refused_like_the_others() -> None:
    needed = NO_SLO.pages_needed(HIT)
    busy = table_with(aggregated("v-a", pages_free=needed - 1))
    rejection = NO_SLO.choose(HIT, busy, set(), 0.0)
    assert isinstance(rejection, Rejection) and rejection.code is ErrorCode.OVERLOADED
    small = table_with(aggregated("v-a", pages_free=1, pages_total=needed - 1))
    rejection = NO_SLO.choose(HIT, small, set(), 0.0)
    assert isinstance(rejection, Rejection) and rejection.code is ErrorCode.BAD_REQUEST
    slo = RoutePolicy(COST, PolicyConfig(ttft_objective_s=0.5))
    slow = table_with(aggregated("v-a", queued_tokens=5000))
    rejection = slo.choose(HIT, slow, set(), 0.0)
    assert isinstance(rejection, Rejection) and rejection.code is ErrorCode.OVERLOADED
    assert rejection.retry_after_s is not None and rejection.retry_after_s > 0
    # An aggregated worker's model is served: not NOT_FOUND for it.
    models_table = table_with(
        LoadReport(
            service=VLLM_WORKER,
            instance_id="v-m",
            seq=1,
            ts_ms=0,
            model="smol",
            num_kv_pages_total=10,
            num_kv_pages_free=10,
        )
    )
    assert NO_SLO.unserved_model("smol", models_table, 0.0) is None
    assert NO_SLO.unserved_model("other", models_table, 0.0) is not None


# -- tiers: each worker's own memory, and the shared store's bandwidth ------------------------
def test_a_holder_in_memory_beats_an_idle_worker_only_when_the_store_is_saturated():
    """a holds the whole cached prefix in its own memory behind a 500-token queue (0.5 s);
    b is idle but must read the prefix from the store. Idle store: b's read (1,024 tokens at
    10K/s, 0.1 s) costs less than a's queue, so b. The store 10 s behind (10 GB queued at
    1 GB/s): b's read waits for it, so a."""
    held = dataclasses.replace(HIT, local_hit_blocks={"a": 16})
    table = table_with(report("a", queued_tokens=500), report("b"), decoder())
    idle = RoutePolicy(COST, PolicyConfig(ttft_objective_s=None, max_queued_tokens=10**9))
    assert idle.choose(held, table, set(), 0.0).prefill_worker_id == "b"

    saturated = RoutePolicy(
        COST,
        PolicyConfig(ttft_objective_s=None, max_queued_tokens=10**9, store_read_bytes_per_s=1e9),
    )
    saturated.store.add(10_000_000_000, 0.0)
    [best, other] = saturated.prefill_options(held, table, set(), 0.0)
    assert best.worker.instance_id == "a" and best.num_local_blocks == 16
    assert other.estimate.load_s == pytest.approx(10.0 + 1024 * COST.kv_bytes_per_token / 1e9)
    assert best.estimate.load_s == 0.0
    assert best.estimate.local_load_s == pytest.approx(1024 * COST.kv_bytes_per_token / 25e9)
    assert saturated.choose(held, table, set(), 0.0).prefill_worker_id == "a"


def test_an_overloaded_holder_loses_to_a_free_worker_when_the_arithmetic_says_so():
    """The spill-over: a holds the prefix but 5 s of work; b reads it from an idle store
    (0.1 s). The request goes to b, and b's in-flight work then counts the read."""
    held = dataclasses.replace(HIT, local_hit_blocks={"a": 16})
    table = table_with(report("a", queued_tokens=5000), report("b"), decoder())
    decision = NO_SLO.choose(held, table, set(), 0.0)
    assert decision.prefill_worker_id == "b" and decision.num_cached_blocks == 16
    for delta in NO_SLO.inflight_deltas("r1", decision, held):
        table.record_sent(delta, 0.0)
    job = 2000 - 1024 + 128 * 10 + round(1024 / 10_000 * 1000)
    assert table.view("b", 0.0).num_queued_tokens == job


def test_a_decision_counts_its_store_read_against_the_bandwidth():
    policy = RoutePolicy(
        COST,
        PolicyConfig(ttft_objective_s=None, max_queued_tokens=10**9, store_read_bytes_per_s=1e7),
    )
    half = dataclasses.replace(HIT, local_hit_blocks={"a": 6})
    table = table_with(report("a"), report("b", queued_tokens=10**6), decoder())
    decision = policy.choose(half, table, set(), 0.0)
    assert decision.prefill_worker_id == "a"
    # 10 of the 16 cached blocks come from the store, 6 from a's memory.
    assert policy.store.bytes_read == 10 * 64 * COST.kv_bytes_per_token
    # The next read of the same 10 blocks queues behind it at 10 MB/s (slower than one GPU's
    # 10K tokens/s here).
    later = policy.prefill_options(half, table, set(), 0.0)[0]
    assert later.estimate.load_s == pytest.approx(2 * 10 * 64 * COST.kv_bytes_per_token / 1e7)


def test_the_baseline_placements_ignore_the_cache():
    held = dataclasses.replace(HIT, local_hit_blocks={"a": 16})
    table = table_with(report("a"), report("b", queued_tokens=50), report("c"), decoder())
    config = {"ttft_objective_s": None, "max_queued_tokens": 10**9}
    rr = RoutePolicy(COST, PolicyConfig(placement="round-robin", **config))
    assert [rr.choose(held, table, set(), 0.0).prefill_worker_id for _ in range(4)] == [
        "a", "b", "c", "a",
    ]  # fmt: skip
    least = RoutePolicy(COST, PolicyConfig(placement="least-loaded", **config))
    # a and c tie at 0 queued tokens: the tie goes round them in turn; b's 50 never wins.
    picks = [least.choose(held, table, set(), 0.0).prefill_worker_id for _ in range(4)]
    assert picks == ["a", "c", "c", "a"]
    with pytest.raises(ValueError, match="placement must be one of kv, least-loaded"):
        PolicyConfig(placement="random")
