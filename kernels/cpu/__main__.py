"""`python -m kernels.cpu`: build the C kernels for this machine now (else the first model
load does), and say where they are. Exit status 1, with the compiler's message, when they
cannot be built; the engine then decodes from float32 weights."""

from __future__ import annotations

import sys

from kernels import cpu


def main() -> int:
    try:
        path = cpu.build()
        simd = cpu.simd()
    except cpu.KernelUnavailable as exc:
        print(f"kernels.cpu: {exc}", file=sys.stderr)
        return 1
    print(f"kernels.cpu: {path} ({'AVX2+FMA' if simd else 'scalar'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
