"""Weights kept in their GGUF block format beside their float32 expansion, for decode.

A decode step multiplies a few rows by every weight of the model, so on a CPU it costs what
streaming the weights from memory costs: SmolLM2-135M's float32 weights are 540 MB, 47 ms of
a 66 ms step at batch 1 on this 2-core VM. The GGUF file holds them as Q4_1 (and the
embedding as Q8_0); `shared/kernels/cpu/quant_matmul.c` multiplies by those blocks directly,
expanding each weight in registers to exactly the float32 value dequantizing gives. A batch
of up to `MAX_ROWS` rows (decode, draft scoring, logits) goes through it; a larger one
(prefill) through the float32 GEMM, where the weights are reused across rows and the bytes
matter less than the FLOPs. The expanded weights stay the model's parameters (in its dtype:
state dicts and prefill use them). A bfloat16 model's decode-sized rows go through the kernel
too, widened to float32 and the product rounded back: SmolLM2's step at 1.8K tokens took
40-47 ms through its bfloat16 weights (270 MB) against 32-39 ms through the blocks in float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from shared.kernels import cpu as cpu_kernels

# Rows at or below which the block kernel beats the float32 GEMM. `python -m
# loadtest.bench_quant_matmul` (SmolLM2's 210 projections as Q4_1, one thread, this 2-core
# VM): 2.2x at 1 row, 2.0x at 4, 1.5x at 8, 1.05x at 16, 0.7x at 32.
MAX_ROWS = 16
# Bytes of codes per 32-weight block.
CODE_BYTES = {"Q4_0": 16, "Q4_1": 16, "Q8_0": 32}
_F16 = np.dtype("<f2")


@dataclass(frozen=True)
class QuantWeight:
    """A [N, K] weight as GGUF blocks of 32 along K: codes, scales (d) and, for Q4_1, mins."""

    fmt: str
    codes: torch.Tensor  # uint8 [N, K / 32 * CODE_BYTES[fmt]], contiguous
    scale: torch.Tensor  # float32 [N, K / 32]
    offset: torch.Tensor | None  # float32 [N, K / 32]: Q4_1's m, Q4_0's -8 d, Q8_0: None

    @property
    def shape(self) -> tuple[int, int]:
        rows, blocks = self.scale.shape
        return rows, blocks * cpu_kernels.BLOCK

    @classmethod
    def from_blocks(cls, fmt: str, raw: np.ndarray) -> QuantWeight:
        """`raw`: uint8 [N, K / 32 * block bytes], a GGUF tensor's rows as stored."""
        code_bytes = CODE_BYTES[fmt]
        header = 4 if fmt == "Q4_1" else 2
        rows = raw.shape[0]
        blocks = np.ascontiguousarray(raw).reshape(rows, -1, header + code_bytes)
        scale = blocks[:, :, 0:2].copy().view(_F16)[..., 0].astype(np.float32)
        if fmt == "Q4_1":
            offset = blocks[:, :, 2:4].copy().view(_F16)[..., 0].astype(np.float32)
        elif fmt == "Q4_0":
            offset = scale * np.float32(-8.0)  # exact: a power of two
        else:
            offset = None
        codes = np.ascontiguousarray(blocks[:, :, header:])
        if fmt != "Q8_0":
            # GGUF: byte j holds elements j (low nibble) and j + 16; the kernel wants elements
            # 2j and 2j + 1 there, so that a 32-bit word is 8 consecutive elements.
            elements = np.concatenate([codes & 0x0F, codes >> 4], axis=-1)
            codes = elements[..., 0::2] | (elements[..., 1::2] << 4)
        codes = np.ascontiguousarray(codes).reshape(rows, -1)
        return cls(
            fmt=fmt,
            codes=torch.from_numpy(codes),
            scale=torch.from_numpy(np.ascontiguousarray(scale)),
            offset=None if offset is None else torch.from_numpy(np.ascontiguousarray(offset)),
        )

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x: float32 [M, K] -> x @ W.T, float32 [M, N]."""
        lib = cpu_kernels.library()
        x = x.contiguous()
        rows, k = x.shape
        n = self.shape[0]
        if k != self.shape[1] or x.dtype != torch.float32:
            raise ValueError(f"x is {x.dtype} {list(x.shape)}; the weight is {[n, self.shape[1]]}")
        out = torch.empty((rows, n), dtype=torch.float32)
        xsum = torch.empty((rows, k // cpu_kernels.BLOCK), dtype=torch.float32)
        lib.kvf_quant_matmul(
            cpu_kernels.FORMATS[self.fmt],
            x.data_ptr(),
            rows,
            k,
            self.codes.data_ptr(),
            self.scale.data_ptr(),
            0 if self.offset is None else self.offset.data_ptr(),
            n,
            out.data_ptr(),
            xsum.data_ptr(),
            torch.get_num_threads(),
        )
        return out

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K], by the kernel's own expansion."""
        n, k = self.shape
        out = torch.empty((n, k), dtype=torch.float32)
        cpu_kernels.library().kvf_quant_dequantize(
            cpu_kernels.FORMATS[self.fmt],
            n,
            k,
            self.codes.data_ptr(),
            self.scale.data_ptr(),
            0 if self.offset is None else self.offset.data_ptr(),
            out.data_ptr(),
        )
        return out

    @property
    def nbytes(self) -> int:
        tensors = (self.codes, self.scale) + (() if self.offset is None else (self.offset,))
        return sum(t.numel() * t.element_size() for t in tensors)


KERNEL_INPUT_DTYPES = (torch.float32, torch.bfloat16)  # bfloat16 rows are widened first


def use_kernel(quant: QuantWeight | None, x: torch.Tensor) -> bool:
    return (
        quant is not None
        and x.dim() == 2
        and x.shape[0] <= MAX_ROWS
        and x.dtype in KERNEL_INPUT_DTYPES
    )


def block_formats(model: torch.nn.Module) -> list[str]:
    """The block formats a model's layers and logits multiply by ([] : dense weights only)."""
    held = [getattr(m, "quant", None) for m in model.modules()]
    held.append(getattr(model, "logits_quant", None))
    return sorted({q.fmt for q in held if q is not None})
