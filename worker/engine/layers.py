"""Building blocks without KV state: Linear, RMSNorm and the SwiGLU MLP.

Parameter names match the HF checkpoints (`weight`, `gate_proj`, ...) so that weights.py can
load a state dict by name with no renaming table.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from torch import nn
from torch.nn import functional as F

from worker.engine import fused_ops, quant

_UNINITIALIZED = ContextVar("uninitialized_weights", default=False)


@contextmanager
def uninitialized_weights() -> Iterator[None]:
    """Linear and Embedding layers built inside keep torch.empty's memory, not a random init:
    for a model whose every parameter is loaded next (weights.load_model checks that each
    one is). SmolLM2's random init took 2.4 s of its 7.7 s load on a 2-core AVX2 VM."""
    token = _UNINITIALIZED.set(True)
    try:
        yield
    finally:
        _UNINITIALIZED.reset(token)


class _LoadedNext(nn.Module):
    """A layer whose random init is skipped inside `uninitialized_weights`."""

    def reset_parameters(self) -> None:
        if not _UNINITIALIZED.get():
            super().reset_parameters()  # type: ignore[misc]


class Embedding(_LoadedNext, nn.Embedding):
    pass


class Linear(_LoadedNext, nn.Linear):
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
            return packed_linear(x, self.packed, self.bias)
        return F.linear(x, self.weight, self.bias)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W.T (+ bias) by oneDNN, W in its blocked layout (`pack_weight`)."""
    return torch.ops.mkldnn._linear_pointwise(x.to(packed.dtype), packed, bias, "none", [], "")


def pack_weight(*weights: torch.Tensor) -> torch.Tensor:
    """The weights [N_i, K], stacked along N, in oneDNN's blocked layout."""
    weight = weights[0] if len(weights) == 1 else torch.cat(weights)
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_FOR_ROWS)


def project(
    x: torch.Tensor,
    parts: tuple[Linear, ...],
    packed: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> list[torch.Tensor]:
    """Each of `parts` (linears of the same input) applied to x: as one oneDNN product of
    their stacked weights (`packed`, `bias`, from pack_linears), split back into the parts'
    outputs, unless that is missing or the block kernel takes these rows."""
    if packed is not None and not quant.use_kernel(parts[0].quant, x):
        return list(packed_linear(x, packed, bias).split([m.out_features for m in parts], -1))
    return [m(x) for m in parts]


def _stacked_bias(*linears: Linear) -> torch.Tensor | None:
    if all(m.bias is None for m in linears):
        return None
    return torch.cat(
        [
            m.bias.detach() if m.bias is not None else m.weight.new_zeros(m.out_features)
            for m in linears
        ]
    )


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
    """Give `model`'s linear layers oneDNN-packed copies of their weights; how many layers it
    packed (0 where `can_pack` says no). q/k/v of an attention layer are packed as one
    product (`qkv_packed`), as are an MLP's gate and up (`gate_up_packed`): one larger GEMM
    runs faster than three or two small ones, and their activations are then fused
    (fused_ops). Other layers get `Linear.packed`.

    Why: on this AMD EPYC (2 cores, AVX-512), F.linear goes to MKL, which runs float32 at
    114-155 GFLOP/s on SmolLM2's prefill shapes (256 rows); oneDNN with the weight reordered
    once runs them at 176-203, 1.3-1.56x faster (bfloat16: 1.06-1.24x);
    docs/engine-benchmarks.md. The copy costs the weights' bytes again (SmolLM2 in float32:
    +0.42 GB), so a worker holds both; outputs agree with F.linear to float round-off.
    """
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    if not linears or not can_pack(linears[0].weight.dtype, linears[0].weight.device):
        return 0
    fused: set[int] = set()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, SwiGLU):
                parts = (module.gate_proj, module.up_proj)
                module.gate_up_packed = pack_weight(*(m.weight for m in parts))
                module.gate_up_bias = _stacked_bias(*parts)
            elif all(hasattr(module, name) for name in ("q_proj", "k_proj", "v_proj")):
                parts = (module.q_proj, module.k_proj, module.v_proj)
                module.qkv_packed = pack_weight(*(m.weight for m in parts))
                module.qkv_bias = _stacked_bias(*parts)
            else:
                continue
            fused.update(id(m) for m in parts)
        for module in linears:
            if id(module) not in fused:
                module.packed = pack_weight(module.weight)
    return len(linears)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def add_and_norm(
        self, x: torch.Tensor, add: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + add, its RMSNorm); x + add is computed in place (into x) where the fused
        kernel serves (float32 rows), else as a new tensor. add None: x as it is."""
        if (
            fused_ops.serves(x, self.weight)
            and x.is_contiguous()
            and (add is None or (add.dtype == x.dtype and add.is_contiguous()))
        ):
            return x, fused_ops.add_rms_norm(x, add, self.weight, self.eps)
        if add is not None:
            x = x + add
        return x, self(x)

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
        # gate and up as one oneDNN product (pack_linears), for rows the block kernel does
        # not take.
        self.gate_up_packed: torch.Tensor | None = None
        self.gate_up_bias: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = project(
            x, (self.gate_proj, self.up_proj), self.gate_up_packed, self.gate_up_bias
        )
        if fused_ops.serves(gate, up) and gate.dim() == 2:
            return self.down_proj(fused_ops.silu_mul(gate, up))
        return self.down_proj(F.silu(gate) * up)
