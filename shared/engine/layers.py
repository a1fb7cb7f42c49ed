"""Building blocks without KV state: Linear, RMSNorm and the SwiGLU MLP.

Parameter names match the HF checkpoints (`weight`, `gate_proj`, ...) so that weights.py can
load a state dict by name with no renaming table.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from shared.engine import quant


class Linear(nn.Linear):
    """nn.Linear that may also hold its weight as GGUF blocks (`quant`, set by weights.py):
    decode-sized inputs then go through the block kernel (quant.py; float32 products, in the
    input's dtype), others through the expanded weight, which stays the parameter."""

    quant: quant.QuantWeight | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if quant.use_kernel(self.quant, x):
            out = self.quant.matmul(x.float()).to(x.dtype)
            return out if self.bias is None else out + self.bias
        return F.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 and cast back before the weight, exactly like the reference,
        # so bf16 models round at the same place.
        input_dtype = x.dtype
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(input_dtype)


class SwiGLU(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
