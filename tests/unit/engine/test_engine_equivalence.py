"""Our engine against transformers (eager attention), float32, tolerance in engine_helpers."""

from __future__ import annotations

import pytest
import torch

from tests.unit.engine.engine_helpers import assert_logits_close, hf_logits, random_tokens
from worker.engine import ModelRunner, Sequence, load_model

SLIDING_QWEN3 = {  # the reference shape: the first layers slide, the rest are full
    "use_sliding_window": True,
    "sliding_window": 8,
    "layer_types": ["sliding_attention", "sliding_attention", "full_attention", "full_attention"],
}
CASES = {
    "llama": ("llama", {}),
    "llama-tied-bias": (
        "llama",
        {"tie_word_embeddings": True, "attention_bias": True, "mlp_bias": True},
    ),
    "llama-rope-linear": (
        "llama",
        {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0}},
    ),
    "llama-rope-llama3": (
        "llama",
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
                "rope_theta": 10000.0,
            }
        },
    ),
    "qwen2-rope-yarn": (
        "qwen2",
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 32,
                "rope_theta": 10000.0,
            }
        },
    ),
    "qwen2-swa-last-layers": (
        "qwen2",
        {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 2},
    ),
    "qwen3": ("qwen3", {"tie_word_embeddings": True}),
    "qwen3-swa-first-layers": ("qwen3", SLIDING_QWEN3),
    "mistral-swa": ("mistral", {"sliding_window": 8}),
    "mistral-full": ("mistral", {"sliding_window": None}),
}
BLOCK = 16


@pytest.mark.parametrize("case", list(CASES))
def test_prefill_resume_and_decode_match_transformers(make_hf, case: str) -> None:
    family, overrides = CASES[case]
    hf, path = make_hf(family, **overrides)
    tokens = random_tokens(40, seed=1)
    ref = hf_logits(hf, tokens)
    runner = ModelRunner(load_model(path), num_blocks=8, block_size_tokens=BLOCK)

    assert_logits_close(runner.forward_dense([tokens])[0], ref)
    cold = Sequence(0, tokens)
    assert_logits_close(runner.prefill([cold], return_all_logits=True)[0], ref)

    # 17 then 12 more tokens: both chunk edges fall inside a block, the second chunk
    # crosses a block edge and starts 9 tokens past the 8-token window.
    seq = Sequence(1, tokens[:17])
    runner.prefill([seq])
    seq.token_ids.extend(tokens[17:29])
    assert_logits_close(runner.prefill([seq], return_all_logits=True)[0], ref[17:29])
    for pos in range(29, 40):
        seq.append(tokens[pos])
        assert_logits_close(runner.decode([seq])[0], ref[pos])
    assert seq.window.num_tokens <= max(runner.config.sliding_window or 0, 0)


@pytest.mark.parametrize("case", ["qwen3-swa-first-layers", "mistral-swa", "llama"])
def test_batched_variable_length_prefill_and_decode(make_hf, case: str) -> None:
    family, overrides = CASES[case]
    hf, path = make_hf(family, **overrides)
    prompts = [random_tokens(n, seed=n) for n in (30, 13, 5)]
    full = [p + random_tokens(6, seed=100 + i) for i, p in enumerate(prompts)]
    refs = [hf_logits(hf, t) for t in full]
    runner = ModelRunner(load_model(path), num_blocks=12, block_size_tokens=BLOCK)

    seqs = [Sequence(i, p) for i, p in enumerate(prompts)]
    for seq, logits, ref in zip(seqs, runner.prefill(seqs), refs, strict=True):
        assert_logits_close(logits, ref[seq.num_tokens - 1])
    for step in range(6):
        for seq, tokens in zip(seqs, full, strict=True):
            seq.append(tokens[seq.num_tokens])
        logits = runner.decode(seqs)
        for i, ref in enumerate(refs):
            assert_logits_close(logits[i], ref[len(prompts[i]) + step])


def test_sliding_window_changes_the_reference(make_hf) -> None:
    """Guards the tests above: with 40 tokens and W=8 the window must matter."""
    hf_swa, _ = make_hf("qwen3", seed=3, **SLIDING_QWEN3)
    hf_full, _ = make_hf("qwen3", seed=3, layer_types=["full_attention"] * 4)
    tokens = random_tokens(40, seed=2)
    swa, full = hf_logits(hf_swa, tokens), hf_logits(hf_full, tokens)
    assert torch.equal(swa[:8], full[:8])  # inside the window the layers agree exactly
    assert float((swa[-1] - full[-1]).abs().max()) > 1e-2 * float(full.abs().max())
