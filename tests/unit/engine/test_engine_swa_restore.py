"""Sliding-window state at a cached boundary: snapshot, exact replay, bounded replay."""

from __future__ import annotations

import pytest
import torch

from tests.unit.engine.engine_helpers import assert_logits_close, random_tokens
from worker.engine import ModelRunner, Sequence, load_model
from worker.engine.errors import SequenceStateError
from worker.engine.swa_restore import (
    exact_replay_tokens,
    replay_window,
    snapshot_from_bytes,
    snapshot_to_bytes,
)

BLOCK = 16
W = 8
SLIDING_FIRST = {
    "use_sliding_window": True,
    "sliding_window": W,
    "layer_types": ["sliding_attention", "sliding_attention", "full_attention", "full_attention"],
}
# A full layer between two sliding ones: replay must read that full layer's keys from the pages.
INTERLEAVED = {
    "use_sliding_window": True,
    "sliding_window": W,
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
}


def _cached(runner: ModelRunner, tokens: list[int], boundary: int) -> Sequence:
    """Prefill `tokens[:boundary]` cold; its pages are the 'loaded prefix'."""
    seq = Sequence(1, tokens[:boundary])
    runner.prefill([seq])
    return seq


def _resume(
    runner: ModelRunner, seq_id: int, tokens: list[int], prefix: Sequence, window
) -> torch.Tensor:  # noqa: ANN001
    boundary = prefix.num_tokens
    warm = Sequence(seq_id, tokens)
    runner.block_manager.attach_prefix(warm, prefix.block_table[: boundary // BLOCK], window)
    return runner.prefill([warm], return_all_logits=True)[0]


@pytest.mark.parametrize(
    "layout", [SLIDING_FIRST, INTERLEAVED], ids=["sliding-first", "interleaved"]
)
def test_exact_replay_equals_the_snapshot(make_hf, layout: dict) -> None:  # noqa: ANN001
    _, path = make_hf("qwen3", seed=11, **layout)
    runner = ModelRunner(load_model(path), num_blocks=32, block_size_tokens=BLOCK)
    tokens = random_tokens(80, seed=3)
    boundary = 48
    prefix = _cached(runner, tokens, boundary)
    assert exact_replay_tokens(runner.config) == 2 * W

    replayed = replay_window(runner.model, runner.pool, prefix.block_table, tokens, boundary, 2 * W)
    assert replayed.end_position == boundary and replayed.num_tokens == W
    assert torch.allclose(replayed.kv, prefix.window.kv, atol=1e-5, rtol=1e-5)

    cold = runner.prefill([Sequence(9, tokens)], return_all_logits=True)[0][boundary:]
    assert_logits_close(_resume(runner, 2, tokens, prefix, replayed), cold)


def test_bounded_replay_is_approximate_and_converges(make_hf) -> None:  # noqa: ANN001
    _, path = make_hf("qwen3", seed=12, **SLIDING_FIRST)
    runner = ModelRunner(load_model(path), num_blocks=64, block_size_tokens=BLOCK)
    tokens = random_tokens(96, seed=4)
    boundary = 64
    prefix = _cached(runner, tokens, boundary)
    errors = {}
    for num_replay in (W // 2, W, 2 * W):
        window = replay_window(
            runner.model, runner.pool, prefix.block_table, tokens, boundary, num_replay
        )
        n = window.num_tokens  # W/2 replayed tokens leave half the window empty
        errors[num_replay] = float((window.kv - prefix.window.kv[:, :, -n:]).abs().max())
        # Layer 0's K/V depends on its own token only: exact whatever R is.
        assert torch.allclose(window.kv[0], prefix.window.kv[0, :, -n:], atol=1e-5)
    # Layer 1 saw truncated inputs under W/2 and W; k x W = 2W is exact.
    assert errors[W // 2] > 1e-2
    assert errors[W] > 1e-3
    assert errors[2 * W] < 1e-5
    # Bounded replay never touches the pages: the loaded prefix is still exact.
    cold = runner.prefill([Sequence(9, tokens)], return_all_logits=True)[0][boundary:]
    assert_logits_close(_resume(runner, 3, tokens, prefix, prefix.window), cold)


def test_snapshot_bytes_round_trip(make_hf) -> None:  # noqa: ANN001
    _, path = make_hf("qwen3", seed=13, **SLIDING_FIRST)
    runner = ModelRunner(load_model(path), num_blocks=8, block_size_tokens=BLOCK)
    prefix = _cached(runner, random_tokens(32, seed=5), 32)
    data = snapshot_to_bytes(prefix.window)
    restored = snapshot_from_bytes(runner.config, data)
    assert restored.end_position == 32 and torch.equal(restored.kv, prefix.window.kv)
    with pytest.raises(SequenceStateError):
        snapshot_from_bytes(runner.config, data[:-4])  # truncated
    with pytest.raises(SequenceStateError):
        snapshot_from_bytes(runner.config, b"garbage" + data)


def test_replay_refuses_a_prefix_that_is_not_loaded(make_hf) -> None:  # noqa: ANN001
    _, path = make_hf("qwen3", seed=14, **SLIDING_FIRST)
    runner = ModelRunner(load_model(path), num_blocks=8, block_size_tokens=BLOCK)
    prefix = _cached(runner, random_tokens(32, seed=6), 16)
    with pytest.raises(SequenceStateError, match="block table covers 16 tokens"):
        replay_window(runner.model, runner.pool, prefix.block_table, random_tokens(32, 6), 32, 16)
