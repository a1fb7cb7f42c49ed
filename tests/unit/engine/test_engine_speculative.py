"""Speculative verification: greedy prefix acceptance, exact rejection sampling, rollback."""

from __future__ import annotations

import torch

from tests.unit.engine.engine_helpers import assert_logits_close, random_tokens
from worker.engine import ModelRunner, SamplingParams, Sequence, load_model, make_generator
from worker.engine.speculative import verify_draft, verify_greedy, verify_sampled

P = torch.tensor(
    [
        [0.30, 0.25, 0.20, 0.15, 0.07, 0.03],
        [0.05, 0.10, 0.40, 0.05, 0.30, 0.10],
        [0.50, 0.10, 0.10, 0.10, 0.10, 0.10],
    ]
)
Q = torch.tensor([[0.10, 0.40, 0.10, 0.10, 0.10, 0.20], [0.30, 0.10, 0.20, 0.20, 0.10, 0.10]])
NUM_TRIALS = 20000
# 6 outcomes, >= ~8k samples per checked marginal: expected TV ~0.01, 0.02 is > 4 sigma.
TV_BOUND = 0.02


def tv(samples: list[int], p: torch.Tensor) -> float:
    freq = torch.bincount(torch.tensor(samples), minlength=p.numel()).float() / len(samples)
    return 0.5 * float((freq - p).abs().sum())


def test_greedy_accepts_longest_agreeing_prefix_plus_one() -> None:
    logits = torch.full((4, 10), -5.0)
    for row, best in enumerate([3, 7, 1, 9]):
        logits[row, best] = 5.0
    assert verify_greedy([3, 7, 2], logits) == [3, 7, 1]  # third disagrees: take target's 1
    assert verify_greedy([3, 7, 1], logits) == [3, 7, 1, 9]  # all agree: bonus token 9
    assert verify_greedy([4, 7, 1], logits) == [3]  # first disagrees
    params = SamplingParams(temperature=0.0)
    assert verify_draft([3, 7, 2], logits, params, None) == [3, 7, 1]


def test_rejection_sampling_preserves_target_distribution() -> None:
    generator = make_generator(0)
    draft_gen = make_generator(1)
    first, second = [], []
    for _ in range(NUM_TRIALS):
        draft = [int(torch.multinomial(Q[i], 1, generator=draft_gen)) for i in range(2)]
        out = verify_sampled(draft, P, generator, Q)
        first.append(out[0])
        if len(out) > 1:  # draft[0] accepted; out[1] is the next token
            second.append(out[1])
    assert tv(first, P[0]) < TV_BOUND
    assert len(second) > 8000 and tv(second, P[1]) < TV_BOUND
    assert tv(first, Q[0]) > 0.2  # the draft's own distribution is far away


def test_rejection_sampling_with_one_hot_draft() -> None:
    """Prompt-lookup drafts are deterministic: q is one-hot on the proposed token."""
    generator = make_generator(2)
    first = [verify_sampled([1, 4], P, generator)[0] for _ in range(NUM_TRIALS)]
    assert tv(first, P[0]) < TV_BOUND


def test_speculative_greedy_decode_matches_plain_decode(make_hf) -> None:
    _, path = make_hf(
        "qwen3",
        use_sliding_window=True,
        sliding_window=8,
        layer_types=["sliding_attention"] * 2 + ["full_attention"] * 2,
    )
    model = load_model(path)
    prompt = random_tokens(12, seed=4)
    plain_runner = ModelRunner(model, num_blocks=8, block_size_tokens=16)
    plain = Sequence(0, prompt)
    logits = plain_runner.prefill([plain])[0]
    for _ in range(30):
        plain.append(int(logits.argmax()))
        logits = plain_runner.decode([plain])[0]
    expected = plain.completion_token_ids

    runner = ModelRunner(model, num_blocks=8, block_size_tokens=16)
    seq = Sequence(1, prompt)
    seq.append(int(runner.prefill([seq])[0].argmax()))
    rollback_lengths = set()
    step = 0
    while len(seq.completion_token_ids) < 26:
        done = len(seq.completion_token_ids)
        truth = expected[done : done + 4]
        # Right for 0..3 tokens, then wrong: exercises every rollback length.
        num_right = step % 4
        step += 1
        draft = truth[:num_right] + [(t + 1) % 97 for t in truth[num_right:]]
        score = runner.score_drafts([seq], [draft])[0]
        accepted = verify_greedy(draft, score.logits)
        assert accepted == truth[: num_right + 1]
        rollback_lengths.add(len(draft) - num_right)
        runner.accept_draft(seq, score, accepted)
    assert seq.completion_token_ids == expected[: len(seq.completion_token_ids)]
    assert rollback_lengths == {1, 2, 3, 4}
    # After all the rollbacks the cache still gives the exact next-token logits.
    final = runner.decode([seq])[0]
    assert_logits_close(final, runner.forward_dense([seq.token_ids])[0][-1])
