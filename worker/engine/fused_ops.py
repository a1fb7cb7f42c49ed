"""A decoder layer's elementwise steps through shared/kernels/cpu/fused_ops.c, one pass each.

As torch ops, a SmolLM2 layer's RMSNorms, RoPE, SiLU gate and residual adds are ~20 ops, each
a pass over [tokens, width] into a fresh tensor: ~70 ms of a 263-token prefill chunk on two
cores. The kernels do each step in one pass (docs/engine-benchmarks.md, "Fused elementwise
steps"). They serve float32 CPU tensors when the C kernels are built (`serves`); otherwise,
and for every other dtype, callers run the torch ops, which compute the same values.
"""

from __future__ import annotations

import torch

import shared.kernels.cpu as cpu_kernels

MAX_HEAD_DIM = 512  # the RoPE kernel keeps half a head on its stack


def _library():
    try:
        return cpu_kernels.library()
    except cpu_kernels.KernelUnavailable:
        return None


def serves(*tensors: torch.Tensor) -> bool:
    """Whether the kernels take these tensors: float32, on the CPU, kernels built."""
    return (
        all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors)
        and _library() is not None
    )


def add_rms_norm(
    x: torch.Tensor, add: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """x += add in place (the residual stream; skipped when add is None), then RMSNorm of x:
    weight * x * rsqrt(mean(x^2) + eps), a new tensor. x, add: contiguous [rows, dim]."""
    dim = x.shape[-1]
    if add is not None and (add.shape != x.shape or not add.is_contiguous()):
        raise ValueError(f"add_rms_norm: add is {list(add.shape)}, x {list(x.shape)}")
    if not x.is_contiguous():
        raise ValueError(f"add_rms_norm needs contiguous rows of one shape, got {list(x.shape)}")
    out = torch.empty_like(x)
    _library().kvf_add_rms_norm(
        x.data_ptr(),
        0 if add is None else add.data_ptr(),
        weight.contiguous().data_ptr(),
        out.data_ptr(),
        x.numel() // dim,
        dim,
        eps,
        torch.get_num_threads(),
    )
    return out


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [rows, heads, head_dim] rotated (transformers' rotate_half) into a new packed tensor.
    x may be a view into a wider row (q, k of one fused projection): heads contiguous within
    a row, rows any stride apart. cos, sin: [rows, head_dim]."""
    rows, heads, dim = x.shape
    if x.stride(2) != 1 or x.stride(1) != dim or dim % 2 or dim > MAX_HEAD_DIM:
        raise ValueError(f"rope needs packed heads of even size <= {MAX_HEAD_DIM}: {x.stride()}")
    cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty((rows, heads, dim), dtype=x.dtype)
    _library().kvf_rope(
        x.data_ptr(),
        x.stride(0),
        out.data_ptr(),
        heads * dim,
        rows,
        heads,
        dim,
        cos.data_ptr(),
        sin.data_ptr(),
        torch.get_num_threads(),
    )
    return out


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, a new packed [rows, n]; gate and up may be the halves of one
    [rows, 2n] product (rows any stride apart, each row's elements contiguous)."""
    rows, n = gate.shape
    if up.shape != gate.shape or gate.stride(1) != 1 or up.stride(1) != 1:
        raise ValueError(f"silu_mul needs rows of contiguous elements: {list(gate.shape)}")
    out = torch.empty((rows, n), dtype=gate.dtype)
    _library().kvf_silu_mul(
        gate.data_ptr(),
        gate.stride(0),
        up.data_ptr(),
        up.stride(0),
        out.data_ptr(),
        rows,
        n,
        torch.get_num_threads(),
    )
    return out
