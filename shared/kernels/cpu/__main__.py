"""`python -m shared.kernels.cpu`: build the C kernels for this machine now (else the first model
load does), and say where they are. Exit status 1, with the compiler's message, when they
cannot be built; the engine then decodes from float32 weights and attends through SDPA."""

from __future__ import annotations

import sys

from shared.kernels import cpu


def main() -> int:
    try:
        path = cpu.build()
        simd = cpu.simd()
        attention = cpu.attention_simd()
    except cpu.KernelUnavailable as exc:
        print(f"shared.kernels.cpu: {exc}", file=sys.stderr)
        return 1
    print(
        f"shared.kernels.cpu: {path} (block matmul: {'AVX2+FMA' if simd else 'scalar'}; paged "
        f"attention: {'AVX-512' if attention else 'not built, SDPA serves'})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
