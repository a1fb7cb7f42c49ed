"""The engine in bfloat16 (`EngineWorkerConfig.dtype`): pages, cached prefill and decode.

Bound, max |ours - transformers' float32| over a logits tensor: 8e-2 * max|ref|. bfloat16
keeps 8 bits of mantissa (eps 3.9e-3); through these 4-layer random models, whose
initializer_range of 0.2 keeps every softmax peaked, the measured error is 1.9e-2 (llama) and
3.3e-2 (qwen3 with sliding layers). Logits one position off differ by ~1.1 relative: the
bound tells a token's logits from its neighbour's, and the float32 tests (same code, 2e-5)
pin the masks and positions exactly.
"""

from __future__ import annotations

import pytest
import torch

from shared.config import ConfigError, EngineWorkerConfig
from tests.unit.engine.engine_helpers import SLIDING, hf_logits, random_tokens
from worker.engine import ModelRunner, Sequence, load_model
from worker.engine.attention import attend, attend_after_prefix, visible

BF16_REL_TOL = 8e-2


@pytest.mark.parametrize(("family", "overrides"), [("llama", {}), ("qwen3", SLIDING)])
def test_bfloat16_runner_tracks_float32_reference(make_hf, family: str, overrides: dict) -> None:
    model, path = make_hf(family, **overrides)
    tokens = random_tokens(40, seed=1)
    ref = hf_logits(model, tokens)
    runner = ModelRunner(load_model(path, torch.bfloat16), num_blocks=16, block_size_tokens=4)
    fp32_pages = ModelRunner(load_model(path), num_blocks=1, block_size_tokens=4).layout
    assert runner.pool.kv.dtype == torch.bfloat16
    assert runner.layout.block_nbytes * 2 == fp32_pages.block_nbytes

    seq = Sequence(0, tokens[:37])
    runner.prefill([seq], num_new_tokens=[13])  # a chunk from position 0
    outs = [runner.prefill([seq], return_all_logits=True)[0]]  # the chunk after 13 cached
    for token in tokens[37:]:
        seq.append(token)
        outs.append(runner.decode([seq])[0][None])
    got = torch.cat(outs)
    assert got.dtype == torch.float32  # what the sampler gets, whatever the model's dtype
    scale = float(ref.abs().max())
    err = float((got - ref[13:]).abs().max())
    assert err <= BF16_REL_TOL * scale, f"max |diff| {err:.3g} > {BF16_REL_TOL * scale:.3g}"
    neighbour = float((got[1:] - ref[13:-1]).abs().max())
    assert neighbour > 4 * BF16_REL_TOL * scale  # the bound does tell positions apart


def test_after_prefix_merges_bfloat16_halves_in_float32() -> None:
    torch.manual_seed(0)
    q = (torch.randn(17, 9, 16) * 3).bfloat16()
    k = (torch.randn(81, 3, 16) * 3).bfloat16()
    v = torch.randn(81, 3, 16).bfloat16()
    positions = torch.arange(81)
    expected = attend(q.float(), k.float(), v.float(), visible(positions[64:], positions, None))
    got = attend_after_prefix(q, k[:64], v[:64], k[64:], v[64:])
    assert got.dtype == torch.bfloat16
    # bfloat16 inputs and outputs: ~1e-2 of values that are O(1); a misweighted merge is O(0.1).
    torch.testing.assert_close(got.float(), expected, rtol=0, atol=3e-2)


def test_worker_dtype_is_checked() -> None:
    assert EngineWorkerConfig(dtype="bfloat16").dtype == "bfloat16"
    with pytest.raises(ConfigError, match="dtype must be one of float32, bfloat16"):
        EngineWorkerConfig(dtype="float16").validate()


def test_bfloat16_smollm2_decodes_through_its_gguf_blocks() -> None:
    """The real model in bfloat16: prefill through its bfloat16 weights, decode rows through
    the GGUF's own Q4_1/Q8_0 blocks (widened to float32), both tracking the float32 model
    (measured: 3.3e-2 of the logits' scale; the top token leads the next by 0.8-1.2)."""
    from shared.models import model_path
    from worker.engine import quant

    path = model_path("SmolLM2-135M-Instruct")
    prompt = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 30, 2, 198] * 4
    logits = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = load_model(path, dtype)
        assert quant.block_formats(model) == ["Q4_1", "Q8_0"]
        runner = ModelRunner(model, num_blocks=4, block_size_tokens=64)
        seq = Sequence(0, prompt)
        first = runner.prefill([seq])[0]
        seq.append(int(first.argmax()))
        logits[dtype] = torch.stack([first, runner.decode([seq])[0]])
    ref, got = logits[torch.float32], logits[torch.bfloat16]
    scale = float(ref.abs().max())
    assert float((got - ref).abs().max()) <= BF16_REL_TOL * scale
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
