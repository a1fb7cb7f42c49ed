"""Sampling: seeds, greedy, filters, logprobs, stop ids."""

from __future__ import annotations

import math

import pytest
import torch

from worker.engine import SamplingParams, SamplingParamsError, make_generator, sample
from worker.engine.sampler import is_stop, sample_one, target_probs

LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])


def draw(params: SamplingParams, n: int, logits: torch.Tensor = LOGITS) -> list[int]:
    generator = make_generator(params.seed)
    return [sample_one(logits, params, generator).token_id for _ in range(n)]


def test_same_seed_same_tokens_other_seed_other_tokens() -> None:
    params = SamplingParams(temperature=1.0, seed=1234)
    assert draw(params, 200) == draw(params, 200)
    assert draw(params, 200) != draw(SamplingParams(temperature=1.0, seed=4321), 200)


def test_seeded_rows_do_not_depend_on_batch_neighbours() -> None:
    seeded = SamplingParams(temperature=0.8, seed=7)
    alone = [sample(LOGITS[None], [seeded], [make_generator(7)])[0].token_id]
    gen_a, gen_b = make_generator(7), make_generator(99)
    batch = sample(
        torch.stack([LOGITS.flip(0), LOGITS]),
        [SamplingParams(temperature=1.3, seed=99), seeded],
        [gen_b, gen_a],
    )
    assert batch[1].token_id == alone[0]


def test_greedy_is_argmax_regardless_of_seed() -> None:
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0.0, seed=s) for s in range(5)]
    out = sample(logits, params, [make_generator(p.seed) for p in params])
    assert [o.token_id for o in out] == logits.argmax(-1).tolist()


def test_top_k_restricts_support_to_k_most_likely() -> None:
    support = set(draw(SamplingParams(temperature=2.0, top_k=3, seed=0), 2000))
    assert support == {0, 1, 2}


def test_top_p_keeps_smallest_head_reaching_p() -> None:
    probs = torch.softmax(LOGITS, -1)
    # Mass of the first two tokens is ~0.65, of the first three ~0.80: keep exactly three.
    top_p = float(probs[:2].sum()) + 0.05
    support = set(draw(SamplingParams(temperature=1.0, top_p=top_p, seed=0), 3000))
    assert support == {0, 1, 2}
    filtered = target_probs(LOGITS, SamplingParams(top_p=top_p))
    assert torch.allclose(filtered[:3], probs[:3] / probs[:3].sum())
    assert float(filtered[3:].sum()) == 0.0


@pytest.mark.parametrize("top_p", [1e-3, 1e-30, 5.98e-52, 5e-324])
def test_a_top_p_below_float32s_range_keeps_the_most_likely_token(top_p: float) -> None:
    """Found by fuzzing the HTTP API: a top_p that float32 reads as 0 once removed every
    token (NaN probabilities, a failed forward pass for the whole batch)."""
    filtered = target_probs(LOGITS, SamplingParams(temperature=1.0, top_p=top_p))
    assert filtered.tolist() == [1.0] + [0.0] * (len(LOGITS) - 1)
    assert set(draw(SamplingParams(temperature=1.0, top_p=top_p, seed=0), 50)) == {0}


@pytest.mark.parametrize("temperature", [1.7e-304, 1e-9, 9e-6])
def test_a_vanishing_temperature_is_greedy(temperature: float) -> None:
    """Found by fuzzing the HTTP API: logits divided by 1.7e-304 overflowed to infinities
    (NaN probabilities, a failed forward pass for the whole batch)."""
    params = SamplingParams(temperature=temperature, seed=3)
    assert params.is_greedy
    assert draw(params, 20) == [0] * 20
    assert target_probs(LOGITS, params).tolist() == [1.0] + [0.0] * (len(LOGITS) - 1)


def test_any_integer_seeds_a_generator_the_same_way_each_time() -> None:
    for seed in (-1, 2**63, 2**64, 2**70, -(2**70)):
        params = SamplingParams(temperature=1.0, seed=seed)
        assert draw(params, 30) == draw(params, 30)


def test_temperature_sampling_follows_softmax() -> None:
    draws = torch.tensor(draw(SamplingParams(temperature=0.7, seed=3), 20000))
    freq = torch.bincount(draws, minlength=8).float() / len(draws)
    tv = 0.5 * float((freq - torch.softmax(LOGITS / 0.7, -1)).abs().sum())
    assert tv < 0.02  # 8 outcomes x 20k draws: expected TV ~0.006


def test_logprobs_are_of_the_raw_distribution() -> None:
    out = sample_one(LOGITS, SamplingParams(temperature=0.0, num_logprobs=2), None)
    expected = torch.log_softmax(LOGITS, -1)
    assert out.token_id == 0
    assert math.isclose(out.logprob, float(expected[0]), rel_tol=1e-6)
    assert [t for t, _ in out.top_logprobs] == [0, 1]
    assert sample_one(LOGITS, SamplingParams(temperature=0.0), None).logprob is None


def test_stop_ids_and_parameter_validation() -> None:
    params = SamplingParams(stop_token_ids=(5,))
    assert is_stop(5, params) and is_stop(2, params, eos_token_ids=(2,))
    assert not is_stop(3, params, eos_token_ids=(2,))
    for bad in ({"temperature": -1.0}, {"top_p": 0.0}, {"top_k": -2}, {"num_logprobs": -1}):
        with pytest.raises(SamplingParamsError):
            SamplingParams(**bad)
