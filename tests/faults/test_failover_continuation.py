"""Decode failover, at the engine: the blocks a decode worker wrote through while it ran, and
its window snapshot at their boundary, let a continuation (the prompt and the tokens already
delivered) go on with exactly the tokens the uninterrupted request gives. float32, greedy, the
production decode engine (speculative decoding and block-boundary windows on), on both real
models: tiny-coder (sliding layers: its continuation starts from the snapshot) and SmolLM2
(full attention only). The kill comes after the answer has filled at least one block, so the
continuation reads blocks that decode computed, not only prefill's.

In the fault suite (`make faults`) with the failovers it proves at the cluster's level: 40
answers on two real models, two minutes here, more than make check's budget allows.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
import torch

from shared.models import ModelError, model_path
from worker.engine import Engine, ModelRunner, SamplingParams, SchedulerConfig, load_model
from worker.engine.drafter import SpecDecodeConfig
from worker.engine.sampler import sample_one
from worker.engine.sequence import Sequence
from worker.engine.swa_restore import snapshot_from_bytes, snapshot_to_bytes

pytestmark = [pytest.mark.faults, pytest.mark.slow]

BLOCK = 64
SEEDS = range(20)
NUM_AFTER_KILL = 12  # tokens each continuation generates
NUM_PAGES = 24


@pytest.fixture(scope="module", params=["tiny-coder", "SmolLM2-135M-Instruct"])
def runner(request: pytest.FixtureRequest) -> ModelRunner:
    try:
        path = model_path(request.param)
    except ModelError as exc:  # `make check` fetches it: a missing file is a broken set-up
        pytest.fail(str(exc))
    return ModelRunner(
        load_model(path, torch.float32), num_blocks=NUM_PAGES, block_size_tokens=BLOCK
    )


def decode_engine(runner: ModelRunner) -> Engine:
    """The decode service's engine (services/decode/main.py), with no end-of-sequence."""
    return Engine(
        runner,
        SchedulerConfig(),
        eos_token_ids=(),
        spec_decode=SpecDecodeConfig(enabled=True, max_batch_size=4),
        track_block_boundaries=True,
    )


@dataclass
class WrittenThrough:
    """What decode's write-through had sent when the worker died: each full block's bytes,
    the window snapshot at the last boundary, and the tokens the client had received."""

    blocks: list[bytes] = field(default_factory=list)
    snapshot: bytes | None = None
    delivered: list[int] = field(default_factory=list)


def prefill(
    runner: ModelRunner, prompt: list[int], pages: list[int], window
) -> tuple[Sequence, int]:  # noqa: ANN001
    """Prefill's side: the prompt from its cached pages on, and the first token."""
    holder = Sequence(10_000 + len(prompt), prompt)
    if pages:
        runner.block_manager.attach_prefix(holder, pages, window, len(pages) * BLOCK)
    logits = runner.prefill([holder])[0]
    greedy = SamplingParams(temperature=0)
    return holder, sample_one(logits, greedy, None).token_id


def handed_to_decode(
    runner: ModelRunner,
    prompt: list[int],
    pages: list[int],
    window,
    max_tokens: int,  # noqa: ANN001
) -> tuple[Engine, int]:
    """Prefill of the prompt from its cached `pages` on, and a decode engine that holds the
    request from there (its pages, and the first token prefill sampled)."""
    holder, first = prefill(runner, prompt, pages, window)
    runner.allocator.free(pages)  # the holder owns them now
    engine = decode_engine(runner)
    params = SamplingParams(temperature=0, max_new_tokens=max_tokens, ignore_eos=True)
    seq_id = engine.add_request(
        prompt,
        params,
        prefix_block_ids=holder.block_table,
        prefix_window=holder.window,
        num_prefix_tokens=len(prompt),
        first_token_id=first,
    )
    runner.allocator.free(holder.block_table)
    return engine, seq_id


def decode(
    runner: ModelRunner, prompt: list[int], max_tokens: int, kill_at: int | None = None
) -> tuple[list[int], WrittenThrough]:
    """Prefill then decode, `max_tokens` greedy tokens; with `kill_at`, what write-through
    had sent once `kill_at` tokens were delivered (and the rest is still generated)."""
    engine, seq_id = handed_to_decode(runner, prompt, [], None, max_tokens)
    written = WrittenThrough()
    tokens: list[int] = []
    outputs = engine.take_pending()
    while True:
        for out in outputs:
            tokens.extend(out.new_token_ids)
        seq = engine.sequence(seq_id)
        if seq is None:
            return tokens, written
        if kill_at is not None and len(written.delivered) < kill_at:
            # Between steps, as the decode worker's _write_through: every block now full.
            # Killed here once `kill_at` tokens are out, or at the last step before the end
            # (a step of accepted drafts may go past `kill_at` and finish).
            end = seq.num_computed_tokens // BLOCK
            for i in range(len(written.blocks), end):
                written.blocks.append(runner.pool.block_to_bytes(seq.block_table[i]))
            window = seq.boundary_window
            at_boundary = window is not None and window.end_position == end * BLOCK
            if at_boundary and runner.config.sliding_layer_ids:
                written.snapshot = snapshot_to_bytes(window)
            written.delivered = list(tokens)
        outputs = engine.step()


def resume(
    runner: ModelRunner, prompt: list[int], written: WrittenThrough, max_tokens: int
) -> list[int]:
    """The continuation on a fresh worker: the written blocks loaded into pages of its own,
    the window from the snapshot, prefill of the rest, decode of what is left."""
    continuation = prompt + written.delivered
    pages = runner.allocator.allocate(len(written.blocks))
    for page, data in zip(pages, written.blocks, strict=True):
        runner.pool.block_from_bytes(page, data)
    boundary = len(pages) * BLOCK
    if runner.config.sliding_layer_ids:
        assert written.snapshot is not None
        window = snapshot_from_bytes(runner.config, written.snapshot)
        assert window.end_position == boundary
    else:
        window = runner.empty_window(boundary)
    engine, _ = handed_to_decode(runner, continuation, pages, window, max_tokens)
    return _drain(engine)


def _drain(engine: Engine) -> list[int]:
    tokens = [t for out in engine.take_pending() for t in out.new_token_ids]
    while engine.has_unfinished():
        tokens.extend(t for out in engine.step() for t in out.new_token_ids)
    return tokens


def top2_gap(runner: ModelRunner, tokens: list[int], position: int) -> float:
    """The margin between the two most likely next tokens at `position` (cold, dense)."""
    logits = runner.forward_dense([tokens[:position]])[0][-1]
    top = torch.topk(logits.float(), 2).values
    return float(top[0] - top[1])


@pytest.mark.parametrize("seed", SEEDS)
def test_continuation_after_a_failover_is_the_uninterrupted_answer(runner, seed: int) -> None:  # noqa: ANN001
    rng = random.Random(seed)
    vocab = runner.config.vocab_size
    # Prompts of one or two blocks that end a little before a boundary, killed once the
    # answer has filled at least one block of its own.
    num_prompt = rng.choice((1, 2)) * BLOCK - rng.randrange(1, 20)
    prompt = [rng.randrange(vocab) for _ in range(num_prompt)]
    first_full = (num_prompt // BLOCK + 1) * BLOCK - num_prompt + 1
    kill_at = first_full + rng.randrange(1, 16)
    num_tokens = kill_at + NUM_AFTER_KILL

    reference, written = decode(runner, prompt, num_tokens, kill_at)
    assert len(reference) == num_tokens
    assert len(written.blocks) * BLOCK > len(prompt), "no block of the answer was written"
    assert written.delivered == reference[: len(written.delivered)]
    rest = resume(runner, prompt, written, num_tokens - len(written.delivered))
    assert runner.allocator.num_free_blocks == NUM_PAGES

    ours = written.delivered + rest
    if ours != reference:
        at = next(i for i, (a, b) in enumerate(zip(ours, reference, strict=True)) if a != b)
        gap = top2_gap(runner, prompt + reference, len(prompt) + at)
        pytest.fail(
            f"token {at} differs after the failover ({ours[at]} != {reference[at]}): "
            f"top-2 logit gap there {gap:.2e}"
        )
