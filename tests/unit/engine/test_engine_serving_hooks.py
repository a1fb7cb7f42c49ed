"""What the decode service asks of the engine beyond generate: a prefix that ends mid-block
(every prompt token but the last, computed elsewhere), a whole prompt computed elsewhere with
its first token sampled there, the window at each block boundary, a callback while a finished
sequence's pages still hold its K/V, and ignore_eos."""

from __future__ import annotations

import pytest
import torch

from tests.unit.engine.engine_helpers import random_tokens
from tests.unit.engine.test_engine_scheduler import BLOCK, make_engine, model, solo  # noqa: F401
from worker.engine import Engine, ModelRunner, SamplingParams, SchedulerConfig
from worker.engine.drafter import SpecDecodeConfig
from worker.engine.engine import FinishReason, RequestError
from worker.engine.errors import SequenceStateError
from worker.engine.sampler import generator_state, make_generator, sample_one
from worker.engine.sequence import Sequence

GREEDY = SamplingParams(temperature=0, max_new_tokens=20)


def _run(engine: Engine, seq_id: int) -> list[int]:
    out = []
    while engine.has_unfinished():
        out.extend(t for o in engine.step() if o.seq_id == seq_id for t in o.new_token_ids)
    return out


def test_prefix_ending_mid_block_resumes_exactly(model) -> None:  # noqa: F811
    engine = make_engine(model, num_blocks=32)
    prompt = random_tokens(41, seed=5)
    holder = Sequence(99, prompt)  # prefill's side: every token but the last
    engine.runner.prefill([holder], num_new_tokens=[len(prompt) - 1])
    assert holder.num_computed_tokens == 40 and len(holder.block_table) == 3
    seq_id = engine.add_request(
        prompt,
        GREEDY,
        prefix_block_ids=holder.block_table,
        prefix_window=holder.window,
        num_prefix_tokens=40,
    )
    engine.runner.allocator.free(holder.block_table)  # the sequence holds its own reference
    assert _run(engine, seq_id) == solo(model, prompt, GREEDY)
    assert engine.runner.allocator.num_free_blocks == 32


def _prefilled_with_first_token(engine: Engine, prompt: list[int], params: SamplingParams):
    """Prefill's side: the whole prompt computed, the first token sampled from its logits."""
    holder = Sequence(99, prompt)
    logits = engine.runner.prefill([holder])[0]
    generator = None if params.is_greedy else make_generator(params.seed)
    first = sample_one(logits, params, generator).token_id
    return holder, first, generator_state(generator)


@pytest.mark.parametrize(
    "params",
    [GREEDY, SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_new_tokens=20)],
    ids=["greedy", "seeded"],
)
def test_first_token_sampled_by_prefill_continues_exactly(model, params) -> None:  # noqa: F811
    engine = make_engine(model, num_blocks=32)
    prompt = random_tokens(48, seed=6)  # three whole blocks: the last one is prefill's
    holder, first, state = _prefilled_with_first_token(engine, prompt, params)
    assert bool(state) == (not params.is_greedy)
    seq_id = engine.add_request(
        prompt,
        params,
        prefix_block_ids=holder.block_table,
        prefix_window=holder.window,
        num_prefix_tokens=len(prompt),
        first_token_id=first,
        sampler_state=state,
    )
    engine.runner.allocator.free(holder.block_table)
    # The first token is out before any forward; the rest are the same request's, alone.
    pending = engine.take_pending()
    assert [(o.seq_id, o.new_token_ids, o.finished) for o in pending] == [(seq_id, (first,), False)]
    assert [first, *_run(engine, seq_id)] == solo(model, prompt, params)
    assert engine.runner.allocator.num_free_blocks == 32


def test_first_token_sampled_by_prefill_may_end_the_request(model) -> None:  # noqa: F811
    finished: list[tuple[int, int, list[int]]] = []
    runner = ModelRunner(model, num_blocks=16, block_size_tokens=BLOCK)
    prompt = random_tokens(40, seed=8)
    probe = Engine(runner, eos_token_ids=())
    holder, first, _ = _prefilled_with_first_token(probe, prompt, GREEDY)
    engine = Engine(
        runner,
        eos_token_ids=(first,),
        on_finish=lambda seq, reason: finished.append(
            (seq.num_computed_tokens, list(seq.token_ids[len(prompt) :]), list(seq.block_table))
        ),
    )
    seq_id = engine.add_request(
        prompt,
        GREEDY,
        prefix_block_ids=holder.block_table,
        prefix_window=holder.window,
        num_prefix_tokens=len(prompt),
        first_token_id=first,
    )
    # Ended inside add_request, its pages still held when the callback ran.
    assert finished == [(len(prompt), [first], holder.block_table)]
    (out,) = engine.take_pending()
    assert (out.seq_id, out.new_token_ids, out.finish_reason) == (
        seq_id,
        (first,),
        FinishReason.STOP,
    )
    assert not engine.has_unfinished()
    runner.allocator.free(holder.block_table)
    assert runner.allocator.num_free_blocks == 16


def test_first_token_needs_the_whole_prompt_computed(model) -> None:  # noqa: F811
    engine = make_engine(model, num_blocks=16)
    prompt = random_tokens(40, seed=2)
    holder = Sequence(1, prompt)
    engine.runner.prefill([holder], num_new_tokens=[len(prompt) - 1])
    with pytest.raises(RequestError, match="whole prompt"):
        engine.add_request(
            prompt,
            GREEDY,
            prefix_block_ids=holder.block_table,
            prefix_window=holder.window,
            num_prefix_tokens=len(prompt) - 1,
            first_token_id=5,
        )
    whole = Sequence(2, prompt)
    engine.runner.prefill([whole])
    with pytest.raises(RequestError, match="vocabulary"):
        engine.add_request(
            prompt,
            GREEDY,
            prefix_block_ids=whole.block_table,
            prefix_window=whole.window,
            num_prefix_tokens=len(prompt),
            first_token_id=model.config.vocab_size,
        )
    seeded = SamplingParams(temperature=1.0, seed=3)
    with pytest.raises(RequestError, match="sampler state"):
        engine.add_request(
            prompt,
            seeded,
            prefix_block_ids=whole.block_table,
            prefix_window=whole.window,
            num_prefix_tokens=len(prompt),
            first_token_id=5,
            sampler_state=b"\x01\x02",
        )


def test_prefix_blocks_must_just_cover_the_prefix(model) -> None:  # noqa: F811
    engine = make_engine(model, num_blocks=8)
    holder = Sequence(1, random_tokens(40, seed=1))
    engine.runner.prefill([holder])
    seq = Sequence(2, random_tokens(50, seed=1))
    with pytest.raises(SequenceStateError):  # 40 tokens need 3 blocks, not 2
        engine.runner.block_manager.attach_prefix(seq, holder.block_table[:2], holder.window, 40)


def test_boundary_windows_on_finish_and_drafts_that_stop_at_block_edges(model) -> None:  # noqa: F811
    finished: list[tuple[int, int, int | None, list[int]]] = []
    runner = ModelRunner(model, num_blocks=32, block_size_tokens=BLOCK)
    engine = Engine(
        runner,
        SchedulerConfig(),
        eos_token_ids=(),
        spec_decode=SpecDecodeConfig(enabled=True),
        track_block_boundaries=True,
        on_finish=lambda seq, reason: finished.append(
            (
                seq.seq_id,
                seq.num_computed_tokens,
                None if seq.boundary_window is None else seq.boundary_window.end_position,
                list(seq.block_table),
            )
        ),
    )
    # A repeating prompt: prompt lookup drafts long runs, which must not cross block edges.
    prompt = random_tokens(12, seed=3) * 4
    seq_id = engine.add_request(prompt, SamplingParams(temperature=0, max_new_tokens=40))
    out = _run(engine, seq_id)
    assert out == solo(model, prompt, SamplingParams(temperature=0, max_new_tokens=40))
    assert engine.spec_stats.num_accepted_tokens > 0  # drafting did happen
    [(sid, num_computed, boundary, pages)] = finished
    assert sid == seq_id and pages  # called before the pages were freed
    assert boundary == (num_computed // BLOCK) * BLOCK  # the last edge was seen exactly
    assert engine.runner.allocator.num_free_blocks == 32


def test_ignore_eos_generates_through_end_of_sequence(model) -> None:  # noqa: F811
    prompt = random_tokens(10, seed=4)
    first = solo(model, prompt, SamplingParams(temperature=0, max_new_tokens=8))
    # Pretend the first token that is new after position 0 ends the sequence.
    cut = next(i for i in range(1, len(first)) if first[i] not in first[:i])
    eos = first[cut]
    runner = ModelRunner(model, num_blocks=16, block_size_tokens=BLOCK)
    stops = Engine(runner, eos_token_ids=(eos,))
    params = SamplingParams(temperature=0, max_new_tokens=8)
    assert stops.generate([prompt], params)[0].completion_token_ids == first[: cut + 1]
    params = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
    assert stops.generate([prompt], params)[0].completion_token_ids == first


def test_prefill_keeps_the_window_at_the_last_block_boundary_it_crosses(model) -> None:  # noqa: F811
    runner = ModelRunner(model, num_blocks=16, block_size_tokens=BLOCK)
    tokens = random_tokens(3 * BLOCK + 5, seed=9)
    whole = Sequence(1, tokens)
    runner.prefill([whole], num_new_tokens=[len(tokens) - 1], keep_boundary_window=True)
    stopped = Sequence(2, tokens)  # the same prompt stopped exactly at the boundary
    runner.prefill([stopped], num_new_tokens=[3 * BLOCK])
    assert whole.boundary_window is not None
    assert whole.boundary_window.end_position == stopped.window.end_position == 3 * BLOCK
    torch.testing.assert_close(whole.boundary_window.kv, stopped.window.kv, rtol=0, atol=1e-6)
    short = Sequence(3, tokens[:10])  # crosses no boundary: nothing kept
    runner.prefill([short], keep_boundary_window=True)
    assert short.boundary_window is None
    # A whole prompt of whole blocks: the window kept is the one before its last token (where
    # a later turn's cache hit can end), not the one after it.
    exact = Sequence(4, tokens[: 3 * BLOCK])
    runner.prefill([exact], keep_boundary_window=True)
    assert exact.num_computed_tokens == 3 * BLOCK
    assert exact.boundary_window is not None and exact.boundary_window.end_position == 2 * BLOCK
