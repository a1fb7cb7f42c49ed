"""Rotary position embedding with the scalings transformers calls default/linear/llama3/yarn.

The formulas mirror transformers' `modeling_rope_utils.py` so that logits agree to float32
round-off. "dynamic" NTK is refused in config.py: transformers recomputes its base from the
longest position in each forward call, so keys already in a KV cache were rotated with a
different base than the query; that is not a function of the token position alone, and a
paged, shared prefix cache needs exactly that property.
"""

from __future__ import annotations

import math

import torch

from worker.engine.config import ModelConfig


def _base_inv_freq(theta: float, dim: int) -> torch.Tensor:
    exponent = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim
    return 1.0 / (theta**exponent)


def _llama3(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    factor = params["factor"]
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    old_len = params["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn(theta: float, dim: int, params: dict, max_pos: int) -> tuple[torch.Tensor, float]:
    original = params["original_max_position_embeddings"]
    factor = params.get("factor") or max_pos / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention_factor = (
            mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
        )
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # the reference's guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).to(torch.float) / dim)
    extrapolation_weight = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_weight) + (
        1.0 / pos_freqs
    ) * extrapolation_weight
    return inv_freq, float(attention_factor)


class RotaryEmbedding(torch.nn.Module):
    """Computes cos/sin per absolute position; scaling is fixed at load time."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        dim, theta = config.head_dim, config.rope_theta
        params = config.rope_scaling or {"rope_type": "default"}
        rope_type = params["rope_type"]
        self.attention_scaling = 1.0
        if rope_type == "default":
            inv_freq = _base_inv_freq(theta, dim)
        elif rope_type == "linear":
            inv_freq = _base_inv_freq(theta, dim) / params["factor"]
        elif rope_type == "llama3":
            inv_freq = _llama3(_base_inv_freq(theta, dim), params)
        else:  # yarn; config.py already refused anything else
            inv_freq, self.attention_scaling = _yarn(
                theta, dim, params, config.max_position_embeddings
            )
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """positions: [num_tokens] int64 -> (cos, sin), each [num_tokens, head_dim]."""
        # float32 regardless of model dtype, as the reference does: bf16 positions lose
        # integer precision past 256.
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, num_heads, head_dim]; cos/sin: [num_tokens, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
