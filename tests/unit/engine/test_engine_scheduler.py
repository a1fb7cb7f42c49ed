"""Continuous batching: Engine + Scheduler over a tiny random qwen3 with sliding layers.

Greedy outputs are compared token for token: batching, chunking, preemption and a cached
prefix only move where K/V comes from, so logits agree to float32 round-off (engine_helpers)
and the argmax of a random model with initializer_range 0.2 is far from any tie.
"""

from __future__ import annotations

import pytest
import torch

from tests.unit.engine.engine_helpers import assert_logits_close, random_tokens
from worker.engine import (
    Engine,
    FinishReason,
    ModelRunner,
    RequestError,
    SamplingParams,
    SchedulerConfig,
    SchedulerConfigError,
    Sequence,
    load_model,
)

QWEN3_SWA = {
    "use_sliding_window": True,
    "sliding_window": 8,
    "layer_types": ["sliding_attention", "sliding_attention", "full_attention", "full_attention"],
}
BLOCK = 16
GREEDY = SamplingParams(temperature=0, max_new_tokens=12)
PROMPT_LENGTHS = (30, 13, 5, 41, 22)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from tests.unit.engine.engine_helpers import FAMILIES, SMALL

    config_cls, model_cls = FAMILIES["qwen3"]
    torch.manual_seed(0)
    hf = model_cls(config_cls(**{**SMALL, "head_dim": 8, **QWEN3_SWA}))
    path = tmp_path_factory.mktemp("qwen3-swa")
    hf.save_pretrained(path)
    return load_model(path)


def make_engine(model, num_blocks: int = 64, block_size: int = BLOCK, **config) -> Engine:
    runner = ModelRunner(model, num_blocks=num_blocks, block_size_tokens=block_size)
    return Engine(runner, SchedulerConfig(**config), eos_token_ids=())


def prompts() -> list[list[int]]:
    return [random_tokens(n, seed=n) for n in PROMPT_LENGTHS]


_SOLO: dict[tuple, list[int]] = {}


def solo(model, prompt: list[int], params: SamplingParams = GREEDY) -> list[int]:
    """The request alone in a fresh engine (memoised: several tests compare against it)."""
    key = (id(model), tuple(prompt), params)
    if key not in _SOLO:
        _SOLO[key] = make_engine(model).generate([prompt], params)[0].completion_token_ids
    return list(_SOLO[key])


def record_batches(engine: Engine) -> list[tuple[int, list[int]]]:
    """(decode batch size, prefill chunk sizes) of every step the engine runs from now on."""
    batches: list[tuple[int, list[int]]] = []
    schedule = engine.scheduler.schedule

    def recording():
        batch = schedule()
        batches.append((len(batch.decode_seqs), list(batch.prefill_num_tokens)))
        return batch

    engine.scheduler.schedule = recording
    return batches


def test_continuous_batching_equals_each_sequence_alone(model) -> None:
    engine = make_engine(model, max_num_batched_tokens=32, max_num_seqs=4)
    batches = record_batches(engine)
    outputs = engine.generate(prompts(), GREEDY)
    for out, prompt in zip(outputs, prompts(), strict=True):
        assert out.completion_token_ids == solo(model, prompt)
        assert out.finish_reason == FinishReason.LENGTH and len(out.completion_token_ids) == 12
    assert max(decode for decode, _ in batches) == 4  # max_num_seqs decoding together
    assert any(decode and chunks for decode, chunks in batches)  # prefill beside decode
    assert engine.runner.allocator.num_free_blocks == 64


def test_request_added_mid_flight_joins_the_running_batch(model) -> None:
    engine = make_engine(model)
    first = [engine.add_request(p, GREEDY) for p in prompts()[:2]]
    tokens: dict[int, list[int]] = {i: [] for i in first}
    for _ in range(4):
        for out in engine.step():
            tokens[out.seq_id].extend(out.new_token_ids)
    late = engine.add_request(prompts()[2], GREEDY)
    tokens[late] = []
    joined = False
    while engine.has_unfinished():
        outs = engine.step()
        joined |= {o.seq_id for o in outs} == {*first, late}
        for out in outs:
            tokens[out.seq_id].extend(out.new_token_ids)
    assert joined  # one step advanced the early requests and the late one together
    for seq_id, prompt in zip([*first, late], prompts()[:3], strict=True):
        assert tokens[seq_id] == solo(model, prompt)


def test_chunked_prefill_equals_unchunked(model) -> None:
    runner = ModelRunner(model, num_blocks=16, block_size_tokens=BLOCK)
    tokens = random_tokens(41, seed=3)
    whole = runner.prefill([Sequence(0, tokens)], return_all_logits=True)[0]
    chunked = Sequence(1, tokens)
    for lo in range(0, 41, 7):  # chunk edges inside blocks and past the 8-token window
        n = min(7, 41 - lo)
        logits = runner.prefill([chunked], return_all_logits=True, num_new_tokens=[n])[0]
        assert_logits_close(logits, whole[lo : lo + n])
    assert chunked.num_computed_tokens == 41

    engine = make_engine(model, max_num_batched_tokens=7)
    batches = record_batches(engine)
    outputs = engine.generate(prompts(), GREEDY)
    assert max(d + sum(c) for d, c in batches) <= 7  # the budget held in every step
    assert [o.completion_token_ids for o in outputs] == [solo(model, p) for p in prompts()]


def test_preemption_under_a_tiny_pool_completes_every_request(model) -> None:
    # 5 requests of up to 41 + 12 tokens in blocks of 4: together they need 57 blocks.
    engine = make_engine(model, num_blocks=16, block_size=4)
    outputs = engine.generate(prompts(), GREEDY)
    assert engine.num_preemptions > 0
    assert [o.completion_token_ids for o in outputs] == [solo(model, p) for p in prompts()]
    assert engine.runner.allocator.num_free_blocks == 16


def test_abort_frees_blocks_and_reports(model) -> None:
    engine = make_engine(model, num_blocks=32)
    keep, drop = (engine.add_request(p, GREEDY) for p in prompts()[:2])
    engine.step()
    engine.step()
    free_before = engine.runner.allocator.num_free_blocks
    assert engine.abort(drop)
    assert engine.runner.allocator.num_free_blocks == free_before + 1  # 13 tokens: 1 block
    assert not engine.abort(drop) and not engine.abort(12345)
    outs = engine.step()
    aborted = [o for o in outs if o.seq_id == drop]
    assert len(aborted) == 1 and aborted[0].finish_reason == FinishReason.ABORT
    while engine.has_unfinished():
        assert all(o.seq_id == keep for o in engine.step())
    assert engine.runner.allocator.num_free_blocks == 32


def test_stop_ids_eos_and_max_tokens(model) -> None:
    prompt = prompts()[0]
    reference = solo(model, prompt)
    stop_at = next(i for i in range(3, 12) if reference[i] not in reference[:i])
    stop_id = reference[stop_at]

    with_stop = SamplingParams(temperature=0, max_new_tokens=12, stop_token_ids=(stop_id,))
    out = make_engine(model).generate([prompt], with_stop)[0]
    assert out.completion_token_ids == reference[: stop_at + 1]
    assert out.finish_reason == FinishReason.STOP

    runner = ModelRunner(model, num_blocks=16, block_size_tokens=BLOCK)
    out = Engine(runner, eos_token_ids=[stop_id]).generate([prompt], GREEDY)[0]
    assert out.completion_token_ids == reference[: stop_at + 1]
    assert out.finish_reason == FinishReason.STOP

    out = make_engine(model).generate([prompt], SamplingParams(temperature=0, max_new_tokens=3))
    assert out[0].completion_token_ids == reference[:3]
    assert out[0].finish_reason == FinishReason.LENGTH
    none = make_engine(model).generate([prompt], SamplingParams(max_new_tokens=0))[0]
    assert none.completion_token_ids == [] and none.finish_reason == FinishReason.LENGTH


def test_seeded_sampling_does_not_depend_on_batch_neighbours(model) -> None:
    params = SamplingParams(temperature=0.9, top_k=20, seed=7, max_new_tokens=12)
    alone = make_engine(model).generate([prompts()[0]], params)[0].completion_token_ids
    neighbours = [SamplingParams(temperature=1.0, seed=s, max_new_tokens=9) for s in (1, 2, 3)]
    crowd = make_engine(model, max_num_batched_tokens=16).generate(
        [prompts()[1], prompts()[0], *prompts()[2:4]], [neighbours[0], params, *neighbours[1:]]
    )
    assert crowd[1].completion_token_ids == alone
    other_seed = SamplingParams(temperature=0.9, top_k=20, seed=8, max_new_tokens=12)
    assert make_engine(model).generate([prompts()[0]], other_seed)[0].completion_token_ids != alone


def test_prefix_cached_start_equals_cold_start(model) -> None:
    engine = make_engine(model, num_blocks=16)
    prompt = random_tokens(32, seed=11) + random_tokens(9, seed=12)
    holder = Sequence(99, prompt[:32])  # what a prefix cache hit hands over
    engine.runner.prefill([holder])
    blocks = holder.block_table[:2]
    batches = record_batches(engine)
    seq_id = engine.add_request(
        prompt, GREEDY, prefix_block_ids=blocks, prefix_window=holder.window
    )
    assert engine.runner.allocator.ref_count(blocks[0]) == 2
    warm = []
    while engine.has_unfinished():
        warm.extend(t for o in engine.step() if o.seq_id == seq_id for t in o.new_token_ids)
    assert sum(sum(chunks) for _, chunks in batches) == 9  # only the suffix was prefilled
    assert warm == solo(model, prompt)
    assert engine.runner.allocator.ref_count(blocks[0]) == 1  # the holder's reference only


def test_bad_requests_and_limits_raise_typed_errors(model) -> None:
    engine = make_engine(model, num_blocks=4)  # 64 tokens of pool: max_model_len 64
    with pytest.raises(RequestError):
        engine.add_request([], GREEDY)
    with pytest.raises(RequestError):
        engine.add_request(random_tokens(64, seed=1), GREEDY)
    with pytest.raises(RequestError):
        engine.add_request([1, 2], GREEDY, prefix_block_ids=[0])
    with pytest.raises(SchedulerConfigError):
        SchedulerConfig(max_num_batched_tokens=0)
    long_run = SamplingParams(temperature=0, max_new_tokens=100)
    out = engine.generate([random_tokens(60, seed=2)], long_run)[0]
    assert len(out.completion_token_ids) == 4 and out.finish_reason == FinishReason.LENGTH
