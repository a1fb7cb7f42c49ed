"""The block-format kernel (shared/kernels/cpu/quant_matmul.c) against torch's float32 GEMM on the
same weights, side by side: one decode step's projections of SmolLM2-135M (30 layers x q, k,
v, o, gate, up, down, as Q4_1), cycled so that neither side finds its weights in cache.

    python -m loadtest.bench_quant_matmul [--rows 1,2,4,8,16,32] [--threads 1] [--repeats 5]

Prints, per number of rows M, the milliseconds per step of each side and their ratio; the
crossover is where worker/engine/quant.py's MAX_ROWS sends work to the float32 GEMM instead.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from shared.kernels import cpu as cpu_kernels
from worker.engine.quant import QuantWeight

HIDDEN, INTERMEDIATE, KV, LAYERS = 576, 1536, 192, 30


def random_q4_1(rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """GGUF Q4_1 rows: per 32 weights an f16 scale, an f16 min and 16 bytes of codes."""
    blocks = cols // 32
    out = np.empty((rows, blocks, 20), dtype=np.uint8)
    out[:, :, 0:2] = (rng.uniform(0.001, 0.02, (rows, blocks, 1)).astype("<f2")).view(np.uint8)
    out[:, :, 2:4] = (rng.uniform(-0.15, 0.0, (rows, blocks, 1)).astype("<f2")).view(np.uint8)
    out[:, :, 4:] = rng.integers(0, 256, (rows, blocks, 16), dtype=np.uint8)
    return out.reshape(rows, blocks * 20)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,2,4,8,16,32")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cpu_kernels.library()
    print(f"kernel: {'AVX2+FMA' if cpu_kernels.simd() else 'scalar'}; torch threads {args.threads}")
    rng = np.random.default_rng(0)
    shapes = [(HIDDEN, HIDDEN), (KV, HIDDEN), (KV, HIDDEN), (HIDDEN, HIDDEN)]
    shapes += [(INTERMEDIATE, HIDDEN), (INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)]
    quants = [QuantWeight.from_blocks("Q4_1", random_q4_1(n, k, rng)) for n, k in shapes * LAYERS]
    dense = [q.dequantize() for q in quants]
    quant_mb = sum(q.nbytes for q in quants) / 1e6
    dense_mb = sum(w.numel() * 4 for w in dense) / 1e6
    print(f"weights: {quant_mb:.0f} MB as Q4_1 blocks, {dense_mb:.0f} MB as float32")
    print(f"{'rows':>4} {'float32 ms':>11} {'blocks ms':>10} {'ratio':>6} {'max rel diff':>13}")
    for rows in (int(r) for r in args.rows.split(",")):
        inputs = [torch.randn(rows, w.shape[1]) for w in dense]
        worst = 0.0
        for x, w, q in zip(inputs[:7], dense[:7], quants[:7], strict=True):
            ref = x @ w.T
            worst = max(worst, ((q.matmul(x) - ref).abs().max() / ref.abs().max()).item())

        def run_dense(inputs=inputs) -> None:
            for x, w in zip(inputs, dense, strict=True):
                torch.nn.functional.linear(x, w)

        def run_blocks(inputs=inputs) -> None:
            for x, q in zip(inputs, quants, strict=True):
                q.matmul(x)

        timings = {"dense": [], "blocks": []}
        for _ in range(args.repeats):  # interleaved, so drift hits both sides alike
            for name, fn in (("dense", run_dense), ("blocks", run_blocks)):
                start = time.perf_counter()
                fn()
                timings[name].append(time.perf_counter() - start)
        dense_ms = float(np.median(timings["dense"])) * 1e3
        blocks_ms = float(np.median(timings["blocks"])) * 1e3
        print(
            f"{rows:>4} {dense_ms:>11.1f} {blocks_ms:>10.1f} {dense_ms / blocks_ms:>5.2f}x "
            f"{worst:>13.1e}",
            flush=True,
        )


if __name__ == "__main__":
    main()
