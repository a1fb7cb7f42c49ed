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
    input's dtype). Others go through oneDNN with the weight reordered into its blocked
    layout once (`packed`, set by `pack_linears`), or else through F.linear (MKL here); the
    expanded weight stays the parameter either way."""

    quant: quant.QuantWeight | None = None
    packed: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if quant.use_kernel(self.quant, x):
            out = self.quant.matmul(x.float()).to(x.dtype)
            return out if self.bias is None else out + self.bias
        if self.packed is not None and x.dtype == self.packed.dtype:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


# The rows oneDNN's weight layout is chosen for: a prefill chunk's size. Any row count works.
PACK_FOR_ROWS = 256


def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether this torch and CPU run oneDNN's packed linear in `dtype` (bfloat16 needs
    AVX-512 BF16 or AMX; elsewhere oneDNN would emulate it)."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def pack_linears(model: nn.Module) -> int:
    """Give every Linear of `model` a oneDNN-packed copy of its weight; how many it packed
    (0 where `can_pack` says no).

    Why: on this AMD EPYC (2 cores, AVX-512), F.linear goes to MKL, which runs float32 at
    114-155 GFLOP/s on SmolLM2's prefill shapes (256 rows); oneDNN with the weight reordered
    once runs them at 176-203, 1.3-1.56x faster (bfloat16: 1.06-1.24x);
    docs/engine-benchmarks.md. The copy costs the weights' bytes again (SmolLM2 in float32:
    +0.42 GB), so a worker holds both; outputs agree with F.linear to float round-off.
    """
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    if not linears or not can_pack(linears[0].weight.dtype, linears[0].weight.device):
        return 0
    with torch.no_grad():
        for module in linears:
            module.packed = torch.ops.mkldnn._reorder_linear_weight(
                module.weight.detach(), PACK_FOR_ROWS
            )
    return len(linears)


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
