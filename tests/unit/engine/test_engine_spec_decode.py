"""Speculative decoding in the engine: prompt-lookup drafts, adaptive length, verification.

The model is a tiny random qwen3 with sliding layers (as in test_engine_scheduler.py).
Random models with initializer_range 0.2 fall into short loops within a few dozen greedy
tokens, which prompt lookup then drafts in full: that is the "repetitive" case. Random
prompts of 97-token vocabulary without loops give no n-gram match: the "no draft" case.
Greedy outputs are compared token for token: scoring a draft only moves which attention
path computes the logits (packed prefill vs decode), a float32 round-off difference.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.unit.engine.engine_helpers import FAMILIES, SMALL, random_tokens
from worker.engine import (
    Engine,
    FinishReason,
    ModelRunner,
    SamplingParams,
    SchedulerConfig,
    Sequence,
    load_model,
    make_generator,
)
from worker.engine.drafter import (
    DraftLength,
    PromptLookup,
    SpecDecodeConfig,
    SpecDecodeConfigError,
    verify_lookup_draft,
)
from worker.engine.sampler import target_probs

# Every layer slides (window 8, 4 layers: a receptive field of 4 * 7 + 1 = 29 tokens) and
# RoPE is relative, so the next token depends only on the last 29 tokens, not on where they
# sit. Give it X + G + X where G is its own greedy continuation of X (|X| = 32) and it
# writes G again: a model that re-emits code it has seen, which prompt lookup drafts.
ALL_SLIDING = {
    "use_sliding_window": True,
    "sliding_window": 8,
    "layer_types": ["sliding_attention"] * 4,
}
OFF = SpecDecodeConfig(enabled=False)
# Always draft when there is a match (no cost): exercises verification as much as possible.
EAGER = SpecDecodeConfig(verify_overhead=0.0, draft_token_cost=0.0, prior_acceptance=0.9)
PERIOD = [5, 17, 42, 8, 2, 61]
GREEDY_40 = SamplingParams(temperature=0, max_new_tokens=40)


def build(tmp_path_factory, name: str, **overrides):
    config_cls, model_cls = FAMILIES["qwen3"]
    torch.manual_seed(0)
    hf = model_cls(config_cls(**{**SMALL, "head_dim": 8, **ALL_SLIDING, **overrides}))
    path = tmp_path_factory.mktemp(name)
    hf.save_pretrained(path)
    return load_model(path)


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models are all per-op overhead: on the shared 2-core box this file took 35 s with
    torch's default 2 threads and 4.6 s with 1."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build(tmp_path_factory, "qwen3-sliding")


def make_engine(model, spec: SpecDecodeConfig = EAGER, num_blocks: int = 64, **config):
    runner = ModelRunner(model, num_blocks=num_blocks, block_size_tokens=16)
    return Engine(runner, SchedulerConfig(**config), eos_token_ids=(), spec_decode=spec)


_COPIES: dict[tuple[int, int], tuple[list[int], list[int]]] = {}


def copy_prompt(model, seed: int) -> tuple[list[int], list[int]]:
    """(X + G + X, G): the model's greedy continuation of the prompt is G again."""
    key = (id(model), seed)
    if key not in _COPIES:
        context = random_tokens(32, seed=seed)
        again = make_engine(model, OFF).generate([context], GREEDY_40)[0].completion_token_ids
        _COPIES[key] = (context + again + context, again)
    prompt, again = _COPIES[key]
    return list(prompt), list(again)


def test_prompt_lookup_longest_most_recent_match_and_none_without() -> None:
    lookup = PromptLookup(min_ngram=2, max_ngram=4)
    #         0  1  2  3  4  5  6  7  8  9 10 11 12
    tokens = [1, 2, 3, 9, 7, 2, 3, 8, 4, 1, 2, 3]
    # Suffix [1, 2, 3] occurs at 0..2 (followed by 9); [2, 3] more recently at 5..6
    # (followed by 8): the longer match wins.
    assert lookup.propose(tokens, 3) == [9, 7, 2]
    tokens += [9, 5, 2, 3]  # now [2, 3] is the longest suffix match; most recent: 10..11
    assert lookup.propose(tokens, 2) == [9, 5]
    assert lookup.propose([10, 11, 12, 13], 4) == []  # fresh index, no repeat: no draft
    assert PromptLookup(2, 4).propose([6, 6, 6], 0) == []
    # A repeating pattern keeps copying past the end of the sequence.
    assert PromptLookup(2, 4).propose([1, 2, 3, 1, 2], 5) == [3, 1, 2, 3, 1]


def test_prompt_lookup_index_is_incremental() -> None:
    lookup = PromptLookup(min_ngram=2, max_ngram=3)
    tokens = random_tokens(200, seed=5)
    for _ in range(50):
        lookup.propose(tokens, 4)
        tokens.append(tokens[-7])
    lookup.propose(tokens, 4)
    # Each token entered the index once per n, not once per step: O(T), not O(T^2).
    assert lookup._num_indexed == len(tokens) - 1
    assert len(lookup._next_index) <= 2 * len(tokens)


def test_draft_length_grows_on_acceptance_and_shrinks_on_rejection() -> None:
    policy = DraftLength(SpecDecodeConfig())
    lengths = []
    for _ in range(6):
        k = policy.next_length(16)
        lengths.append(k)
        policy.record(k, k)  # everything accepted
    assert lengths[-1] > lengths[0] >= 1 and lengths == sorted(lengths)
    assert policy.next_length(16) == 16 and policy.next_length(5) == 5  # capped
    for _ in range(6):
        k = policy.next_length(16)
        policy.record(max(k, 1), 0)  # everything rejected
    assert policy.best_length(16) == 0  # plain decode: no overhead once drafts keep failing
    probes = [policy.next_length(16) for _ in range(2 * SpecDecodeConfig().probe_interval_steps)]
    assert probes.count(1) == 2 and set(probes) == {0, 1}  # a one-token probe now and then
    with pytest.raises(SpecDecodeConfigError):
        SpecDecodeConfig(min_ngram=3, max_ngram=2)


def test_greedy_output_is_identical_with_and_without_speculation(model) -> None:
    copies = [copy_prompt(model, seed) for seed in (3, 4)]
    prompts = [
        copies[0][0],  # copying: long drafts, all accepted
        copies[1][0],
        PERIOD * 5,  # drafts proposed (the period) and mostly rejected: rollbacks
        random_tokens(33, seed=6),  # no n-gram repeats: no draft
    ]
    plain = make_engine(model, OFF).generate(prompts, GREEDY_40)
    engine = make_engine(model, max_num_seqs=4)
    spec = engine.generate(prompts, GREEDY_40)
    for a, b in zip(plain, spec, strict=True):
        assert a.completion_token_ids == b.completion_token_ids
        assert b.finish_reason == FinishReason.LENGTH
    assert [o.completion_token_ids for o in plain[:2]] == [g for _, g in copies]
    stats = [o.spec_stats for o in spec]
    for copied in stats[:2]:
        assert copied.num_accepted_tokens >= 30 and copied.tokens_per_forward > 3
    assert stats[2].num_draft_tokens > stats[2].num_accepted_tokens  # rejections happened
    total = engine.spec_stats
    assert total.num_accepted_tokens <= total.num_draft_tokens
    assert total.num_emitted_tokens == 4 * 40 and total.tokens_per_forward >= 1
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_forwards"):
        assert getattr(total, name) == sum(getattr(s, name) for s in stats)
    assert engine.runner.allocator.num_free_blocks == 64


def test_no_match_means_no_draft_and_plain_decode(model) -> None:
    prompt = random_tokens(30, seed=21)
    params = SamplingParams(temperature=0, max_new_tokens=3)
    out = make_engine(model, SpecDecodeConfig(min_ngram=4, max_ngram=4)).generate([prompt], params)
    assert out[0].spec_stats.num_drafts == 0 and out[0].spec_stats.tokens_per_forward == 1.0
    plain = make_engine(model, OFF).generate([prompt], params)
    assert out[0].completion_token_ids == plain[0].completion_token_ids


def test_stop_ids_and_max_tokens_inside_accepted_runs(model) -> None:
    prompt, reference = copy_prompt(model, seed=3)
    stop_at = next(i for i in range(6, 40) if reference[i] not in reference[:i])
    stop_id = reference[stop_at]
    engine = make_engine(model)
    params = SamplingParams(temperature=0, max_new_tokens=40, stop_token_ids=(stop_id,))
    seq_id = engine.add_request(prompt, params)
    steps = []
    while engine.has_unfinished():
        steps.extend(o for o in engine.step() if o.seq_id == seq_id)
    tokens = [t for o in steps for t in o.new_token_ids]
    assert tokens == reference[: stop_at + 1] and steps[-1].finish_reason == FinishReason.STOP
    assert len(steps[-1].new_token_ids) > 1  # the stop id ended an accepted run
    assert engine.runner.allocator.num_free_blocks == 64
    for num_new in (1, 5, 13):
        out = make_engine(model).generate(
            [prompt], SamplingParams(temperature=0, max_new_tokens=num_new)
        )[0]
        assert out.completion_token_ids == reference[:num_new]
        assert out.finish_reason == FinishReason.LENGTH
        assert out.spec_stats.num_forwards <= max(num_new // 2, 1)  # runs, capped to fit


def test_seeded_sampling_is_the_same_with_and_without_speculation(model) -> None:
    """Verification draws from each request's generator exactly what plain decode draws."""
    prompts = [copy_prompt(model, seed)[0] for seed in (3, 4)]
    params = [
        SamplingParams(temperature=t, top_k=k, seed=s, max_new_tokens=30)
        for t, k, s in ((0.1, 0, 1), (0.2, 20, 2))
    ]
    plain = make_engine(model, OFF).generate(prompts, params)
    engine = make_engine(model, max_num_batched_tokens=12)  # the budget caps some drafts
    spec = engine.generate(prompts, params)
    assert [o.completion_token_ids for o in spec] == [o.completion_token_ids for o in plain]
    assert engine.spec_stats.num_accepted_tokens >= 5
    assert engine.spec_stats.num_accepted_tokens < engine.spec_stats.num_draft_tokens


def tv(samples: list[int], p: torch.Tensor) -> float:
    freq = torch.bincount(torch.tensor(samples), minlength=p.numel()).float() / len(samples)
    return 0.5 * float((freq - p).abs().sum())


def tv_bound(num_samples: int, vocab_size: int) -> float:
    """E[TV] of an empirical distribution is <= 0.5 * sqrt(2 V / (pi n)); TV moves by at most
    1/n per sample, so it exceeds that by sqrt(ln(1000) / (2 n)) with probability <= 0.1%
    (McDiarmid). The draws are seeded, so a pass is a fixed outcome anyway."""
    n, v = num_samples, vocab_size
    return 0.5 * math.sqrt(2 * v / (math.pi * n)) + math.sqrt(math.log(1000) / (2 * n))


def test_sampled_verification_follows_the_target_distribution(tmp_path_factory) -> None:
    """The engine's verifier on real scored drafts: 20000 trials on a 12-token vocabulary.

    Exactness of the chain needs: the 1st emitted token ~ p0; given the 1st draft token was
    accepted, the 2nd ~ p1; given two were, the 3rd ~ p2 (later tokens come from later
    steps, which start from the same state). Each marginal is compared with the target's
    probabilities (scored logits, temperature 0.8) within `tv_bound`: 0.023 for the first
    (n = 20000), ~0.06 for the third (n >= 3000).
    """
    vocab_size, num_trials = 12, 20000
    model = build(tmp_path_factory, "qwen3-v12", vocab_size=vocab_size)
    runner = ModelRunner(model, num_blocks=4, block_size_tokens=16)
    params = SamplingParams(temperature=0.8, seed=0)
    seq = Sequence(0, random_tokens(10, seed=9, vocab_size=vocab_size))
    seq.append(int(runner.prefill([seq])[0].argmax()))
    draft: list[int] = []
    for _ in range(3):  # the target's most likely tokens: drafts it accepts often
        draft.append(int(runner.forward_dense([seq.token_ids + draft])[0][-1].argmax()))
    score = runner.score_drafts([seq], [draft])[0]
    probs = target_probs(score.logits, params)

    generator = make_generator(0)
    outs = [
        verify_lookup_draft(draft, score.logits, params, generator, max_tokens=8)
        for _ in range(num_trials)
    ]
    firsts = [o[0].token_id for o in outs]
    assert tv(firsts, probs[0]) < tv_bound(num_trials, vocab_size)
    for i in (1, 2):
        accepted = [o[i].token_id for o in outs if len(o) > i]
        assert all([s.token_id for s in o[:i]] == draft[:i] for o in outs if len(o) > i)
        assert len(accepted) >= 3000
        assert tv(accepted, probs[i]) < tv_bound(len(accepted), vocab_size)
    # Accepting every draft token would be far outside the bound.
    assert 1 - float(probs[0][draft[0]]) > 10 * tv_bound(num_trials, vocab_size)
