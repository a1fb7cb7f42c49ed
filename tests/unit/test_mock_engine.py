"""The mock engine: timing per its cost model, deterministic tokens, real block hashes,
usage that adds up, abort, length and stop limits, page reservation."""

from __future__ import annotations

import dataclasses

import pytest

from shared.block_hashing import BlockHasher
from shared.blocks import RequestBlocks
from worker.cost_model import CostModel, CostModelError
from worker.mock_engine import (
    FinishReason,
    MockEngine,
    MockEngineConfig,
    MockRequestError,
    MockSamplingParams,
    MockStepOutput,
    fake_tokens,
)

CONFIG = MockEngineConfig(model_id="m", block_size_tokens=16, vocab_size=1000)
COST = CostModel(
    prefill_tokens_per_s=1000.0,
    load_tokens_per_s=10_000.0,
    replay_tokens=128,
    replay_tokens_per_s=100.0,
    decode_step_base_s=0.01,
    decode_step_per_seq_s=0.001,
    decode_step_per_context_token_s=1e-6,
)
PROMPT = list(range(1, 101))  # 100 tokens: 6 whole blocks of 16


def engine(**changes: object) -> MockEngine:
    return MockEngine(dataclasses.replace(CONFIG, **changes), COST)


def run(e: MockEngine) -> list[MockStepOutput]:
    outputs = []
    while e.has_unfinished():
        outputs += e.step()
    return outputs


def tokens_of(outputs: list[MockStepOutput], seq_id: int) -> list[int]:
    return [t for o in outputs if o.seq_id == seq_id for t in o.new_token_ids]


def test_prefill_then_decode_timing_follows_the_cost_model():
    e = engine()
    e.add_request(
        PROMPT, MockSamplingParams(max_new_tokens=3), num_cached_tokens=64, has_swa_snapshot=False
    )
    # Prefill: 36 computed, 64 loaded, min(128, 64) replayed; the first token comes with it.
    prefill_s = COST.prefill_s(100 - 64, 64, 64)
    assert e.next_step_duration_s() == pytest.approx(prefill_s)
    assert len(e.step()[0].new_token_ids) == 1
    assert e.last_step_duration_s == pytest.approx(prefill_s)
    # Decode steps read 101, then 102 tokens of context.
    decode_s = [COST.decode_step_s(1, 101), COST.decode_step_s(1, 102)]
    for expected in decode_s:
        assert e.next_step_duration_s() == pytest.approx(expected)
        e.step()
    assert not e.has_unfinished() and e.next_step_duration_s() == 0.0
    assert e.clock_s == pytest.approx(prefill_s + sum(decode_s))


def test_the_snapshot_saves_the_replay_and_chunks_share_the_step_budget():
    e = engine(max_num_batched_tokens=50)
    e.add_request(PROMPT, MockSamplingParams(max_new_tokens=2), num_cached_tokens=32)
    durations = []
    while e.has_unfinished():
        durations.append(e.next_step_duration_s())
        e.step()
    # 68 tokens to compute: 50 (with the load, no replay: the snapshot is there), then 18.
    assert durations == pytest.approx(
        [COST.prefill_s(50, 32, 0), COST.prefill_s(18), COST.decode_step_s(1, 101)]
    )


def test_a_batch_decodes_in_one_step_priced_by_batch_size_and_context():
    e = engine()
    e.add_request(PROMPT, MockSamplingParams(max_new_tokens=2))
    e.add_request(PROMPT[:40], MockSamplingParams(max_new_tokens=2))
    assert e.next_step_duration_s() == pytest.approx(COST.prefill_s(140))
    e.step()
    assert e.next_step_duration_s() == pytest.approx(COST.decode_step_s(2, 101 + 41))


def test_outputs_are_deterministic_per_prompt_and_seed():
    outs = {}
    for seed in (7, 7, 8):
        e = engine()
        seq_id = e.add_request(PROMPT, MockSamplingParams(max_new_tokens=20, seed=seed))
        outs.setdefault(seed, []).append(tokens_of(run(e), seq_id))
    assert outs[7][0] == outs[7][1] == fake_tokens(PROMPT, 20, 7, CONFIG.vocab_size)
    assert outs[8][0] != outs[7][0]
    e = engine(seed=7)  # the engine's seed serves requests without one
    seq_id = e.add_request(PROMPT, MockSamplingParams(max_new_tokens=20))
    assert tokens_of(run(e), seq_id) == outs[7][0]


@pytest.mark.parametrize(("num_cached_tokens", "salt"), [(0, ""), (48, ""), (32, "tenant-a")])
def test_block_hashes_continue_the_request_s_chain_over_every_computed_token(
    num_cached_tokens, salt
):
    e = engine()
    blocks = RequestBlocks.hash_prompt(PROMPT, model="m", block_size_tokens=16, cache_salt=salt)
    seq_id = e.add_request(
        PROMPT,
        MockSamplingParams(max_new_tokens=30),
        num_cached_tokens=num_cached_tokens,
        blocks=blocks,
    )
    outputs = run(e)
    output = tokens_of(outputs, seq_id)
    published = [h for o in outputs for h in o.new_block_hashes]
    # The last sampled token's KV is never computed; the cached blocks were already stored.
    hasher = BlockHasher("m", block_size_tokens=16, salt=salt)
    expected = hasher.hashes(PROMPT + output[:-1])
    assert len(expected) == (100 + 30 - 1) // 16
    assert published == expected[num_cached_tokens // 16 :]


def test_usage_adds_up_and_abort_bills_what_was_produced():
    e = engine()
    done = e.add_request(PROMPT, MockSamplingParams(max_new_tokens=5), num_cached_tokens=64)
    cut = e.add_request(PROMPT[:50], MockSamplingParams(max_new_tokens=50))
    e.step()
    e.step()  # cut has 2 tokens now
    assert e.abort(cut) and not e.abort(cut)
    outputs = run(e)
    usage = {o.seq_id: o.usage for o in outputs if o.finished}
    assert dataclasses.astuple(usage[done]) == (64, 36, 5)
    assert dataclasses.astuple(usage[cut]) == (0, 50, 2)
    reasons = {o.seq_id: o.finish_reason for o in outputs if o.finished}
    assert reasons == {done: FinishReason.LENGTH, cut: FinishReason.ABORT}
    assert e.num_kv_pages_free == CONFIG.num_kv_pages


def test_abort_before_admission_bills_nothing():
    e = engine()
    seq_id = e.add_request(PROMPT, num_cached_tokens=64)
    assert e.num_queued_tokens() == 36
    assert e.abort(seq_id)
    (out,) = e.step()
    assert (out.finish_reason, dataclasses.astuple(out.usage)) == (FinishReason.ABORT, (0, 0, 0))
    assert not e.abort(12345)


def test_stop_token_ends_with_it_and_max_tokens_zero_ends_at_once():
    expected = fake_tokens(PROMPT, 10, 0, CONFIG.vocab_size)
    stop = expected[3]
    first = expected.index(stop)
    e = engine()
    seq_id = e.add_request(PROMPT, MockSamplingParams(max_new_tokens=10, stop_token_ids=(stop,)))
    outputs = run(e)
    assert tokens_of(outputs, seq_id) == expected[: first + 1]
    assert outputs[-1].finish_reason == FinishReason.STOP
    e = engine(eos_token_ids=(expected[0],))
    e.add_request(PROMPT, MockSamplingParams(max_new_tokens=10))
    assert run(e)[-1].finish_reason == FinishReason.STOP
    e = engine()
    e.add_request(PROMPT, MockSamplingParams(max_new_tokens=0))
    (out,) = e.step()
    assert (out.finished, out.finish_reason, out.new_token_ids) == (True, FinishReason.LENGTH, ())


def test_requests_wait_for_pages_first_come_first_served():
    e = engine(num_kv_pages=10)  # each request below holds ceil((100 + 60) / 16) = 10 pages
    first = e.add_request(PROMPT, MockSamplingParams(max_new_tokens=60))
    second = e.add_request(PROMPT, MockSamplingParams(max_new_tokens=60))
    e.step()
    e.step()  # the first decodes: its queued tokens are done, the second's all wait
    assert (e.num_running(), e.num_kv_pages_free, e.num_queued_tokens()) == (1, 0, 100)
    outputs = run(e)
    finished = [o.seq_id for o in outputs if o.finished]
    assert finished == [first, second]


def test_reserved_pages_are_counted_once_and_come_back_however_the_request_ends():
    e = engine(num_kv_pages=25)
    needed = e.pages_needed(len(PROMPT), 60)
    assert needed == 10
    first, second = e.reserve_pages(needed), e.reserve_pages(needed)
    assert len(first) == len(second) == needed and not set(first) & set(second)
    assert e.num_kv_pages_free == 5 and e.reserve_pages(needed) is None  # nothing taken
    with pytest.raises(MockRequestError, match="9 pages reserved, the request holds 10"):
        e.add_request(PROMPT, MockSamplingParams(max_new_tokens=60), pages=first[:9])
    assert e.num_kv_pages_free == 5  # a refused request leaves the reservation the caller's
    done = e.add_request(PROMPT, MockSamplingParams(max_new_tokens=60), pages=first)
    cut = e.add_request(PROMPT, MockSamplingParams(max_new_tokens=60), pages=second)
    e.step()  # both admitted on their reservations: nothing more taken
    assert (e.num_running(), e.num_kv_pages_free) == (2, 5)
    assert e.abort(cut)
    assert e.num_kv_pages_free == 15
    run(e)
    assert e.num_kv_pages_free == 25  # the finished one's came back in its last step
    e.release_pages(e.reserve_pages(needed))  # a reservation that never reached the engine
    assert e.num_kv_pages_free == 25
    pages = e.reserve_pages(e.pages_needed(len(PROMPT), 0))
    e.add_request(PROMPT, MockSamplingParams(max_new_tokens=0), pages=pages)
    assert e.num_kv_pages_free == 25  # ended at once: its reservation is back
    assert {o.seq_id for o in run(e) if o.finished} == {done + 2}


@pytest.mark.parametrize(
    ("prompt", "kwargs", "match"),
    [
        ([], {}, "empty"),
        (PROMPT, {"num_cached_tokens": 20}, "whole 16-token blocks"),
        (PROMPT[:32], {"num_cached_tokens": 32}, "shorter than"),
        (PROMPT, {"params": MockSamplingParams(max_new_tokens=10**6)}, "KV pages"),
    ],
)
def test_requests_it_cannot_serve_raise_a_typed_error(prompt, kwargs, match):
    with pytest.raises(MockRequestError, match=match):
        engine(max_model_len=10**7).add_request(prompt, **kwargs)


def test_the_router_estimates_what_the_mock_sleeps():
    """One cost model: a request's own prefill in the router's estimate is the mock's time."""
    cost = CostModel()
    simulated = cost.prefill_s(100, 200, cost.num_replay_tokens(200, False))
    estimate = cost.prefill(
        num_queued_tokens=0, num_prompt_tokens=300, num_cached_tokens=200, has_swa_snapshot=False
    )
    assert simulated == pytest.approx(estimate.own_s)
    assert cost.num_replay_tokens(200, True) == 0 and cost.replay_s(200, True) == 0.0
    with pytest.raises(CostModelError):
        CostModel(load_tokens_per_s=0)
