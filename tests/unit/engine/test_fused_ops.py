"""shared/kernels/cpu/fused_ops.c: a layer's elementwise steps in one pass each, against the
torch ops they replace (RMSNorm, rotate_half RoPE, SiLU * up), then the model with and without
them."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from shared.kernels import cpu as cpu_kernels
from worker.engine import ModelRunner, Sequence, fused_ops, load_model
from worker.engine.layers import SwiGLU
from worker.engine.model import Attention
from worker.engine.rope import apply_rotary

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="needs a C compiler")


def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@pytest.mark.parametrize("rows", [1, 3, 263])
@pytest.mark.parametrize("dim", [576, 40, 17])
@pytest.mark.parametrize("with_add", [True, False])
def test_add_rms_norm_adds_in_place_and_normalises(rows, dim, with_add) -> None:
    torch.manual_seed(rows * dim)
    x = torch.randn(rows, dim) * 3
    add = torch.randn(rows, dim) if with_add else None
    weight = torch.randn(dim)
    expected_x = x + add if with_add else x.clone()
    expected = reference_rms_norm(expected_x, weight, 1e-5)
    out = fused_ops.add_rms_norm(x, add, weight, 1e-5)
    assert torch.equal(x, expected_x)  # the residual stream, updated in place, exactly
    # The sum of squares goes in 16 lanes: an ulp or two from torch's order.
    torch.testing.assert_close(out, expected, rtol=4e-7, atol=1e-6)
    assert out.data_ptr() != x.data_ptr()


def test_add_rms_norm_refuses_rows_of_another_shape() -> None:
    with pytest.raises(ValueError, match="add is"):
        fused_ops.add_rms_norm(torch.zeros(4, 8), torch.zeros(4, 9), torch.ones(8), 1e-5)
    with pytest.raises(ValueError, match="contiguous"):
        fused_ops.add_rms_norm(torch.zeros(8, 4).t(), None, torch.ones(8), 1e-5)


def rope_tables(positions: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    freqs = positions.float()[:, None] * inv[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 4, 128), (2, 1, 8)])
@pytest.mark.parametrize("rows", [1, 70, 263])
def test_rope_matches_rotate_half_bit_for_bit_on_views_of_one_projection(
    heads, kv_heads, dim, rows
) -> None:
    torch.manual_seed(heads + rows)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim) * 4
    q, k, _ = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k = q.view(rows, heads, dim), k.view(rows, kv_heads, dim)
    cos, sin = rope_tables(torch.arange(1800, 1800 + rows), dim)
    for x in (q, k):
        assert rows == 1 or not x.is_contiguous()
        out = fused_ops.rope(x, cos, sin)
        assert out.is_contiguous()
        # The same products and sums, each rounded where torch rounds (no fused multiply-add).
        assert torch.equal(out, apply_rotary(x.contiguous(), cos, sin))


def test_rope_refuses_heads_that_are_not_packed() -> None:
    x = torch.zeros(4, 8, 3).transpose(1, 2)  # heads of 8, but not contiguous within a row
    cos, sin = rope_tables(torch.arange(4), 8)
    with pytest.raises(ValueError, match="packed heads"):
        fused_ops.rope(x, cos, sin)


@pytest.mark.parametrize("scale", [1.0, 8.0, 40.0])
def test_silu_mul_is_within_a_few_ulps_of_torch(scale) -> None:
    torch.manual_seed(int(scale))
    gate_up = torch.randn(263, 2 * 1536) * scale
    gate, up = gate_up.chunk(2, dim=-1)  # views: rows 3072 floats apart
    expected = F.silu(gate) * up
    out = fused_ops.silu_mul(gate, up)
    torch.testing.assert_close(out, expected, rtol=5e-7, atol=1e-30)
    assert (out == expected).float().mean() > 0.95  # most are the same float exactly


def test_silu_mul_at_the_ends_of_the_range() -> None:
    gate = torch.tensor([[-1e4, -200.0, -104.0, -88.0, -20.0, -0.0, 1e-30, 20.0, 88.0, 1e4]])
    up = torch.full_like(gate, 3.0)
    out = fused_ops.silu_mul(gate, up)
    torch.testing.assert_close(out, F.silu(gate) * up, rtol=5e-7, atol=1e-30)
    assert torch.isfinite(out).all()


def unfuse(model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same model through torch's elementwise ops and one product per projection."""
    monkeypatch.setattr(fused_ops, "serves", lambda *tensors: False)
    for module in model.modules():
        if isinstance(module, Attention):
            module.qkv_packed = None
        elif isinstance(module, SwiGLU):
            module.gate_up_packed = None


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_the_model_with_and_without_the_fused_steps(make_hf, family, monkeypatch) -> None:
    """A chunk after a cached prefix and a decode step, fused (one q/k/v product with qwen2's
    biases stacked, one gate/up product, the C elementwise steps) against the same model
    through torch's ops and a product per projection: logits to float round-off."""
    _, path = make_hf(family, seed=3)
    prompt = [(7 * i + 3) % 97 for i in range(150)]
    outputs = []
    for fused in (True, False):
        model = load_model(path)
        assert model.model.layers[0].self_attn.qkv_packed is not None
        assert model.model.layers[0].mlp.gate_up_packed is not None
        if not fused:
            unfuse(model, monkeypatch)
        runner = ModelRunner(model, num_blocks=8, block_size_tokens=64)
        seq = Sequence(0, prompt)
        first = runner.prefill([seq], num_new_tokens=[100])[0]
        second = runner.prefill([seq])[0]
        seq.append(int(second.argmax()))
        third = runner.decode([seq])[0]
        outputs.append(torch.stack((first, second, third)))
    torch.testing.assert_close(outputs[0], outputs[1], rtol=0, atol=1e-4)
    assert torch.equal(outputs[0].argmax(-1), outputs[1].argmax(-1))
