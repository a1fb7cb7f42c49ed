"""The engine's own dequantization of GGUF's Q8_0, Q4_0 and Q4_1 blocks (whole tensors in
one numpy pass) gives gguf's own result bit for bit: on seeded random blocks of every
format (extreme scales and minimums included), and on the tensors of SmolLM2's real file."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, quants

from shared.models import model_path
from worker.engine.gguf import Q, dequantize, dequantize_blocks, read_gguf

FORMATS = [Q.Q8_0, Q.Q4_0, Q.Q4_1]


def random_rows(ggml_type: Q, rows: int, blocks_per_row: int, seed: int) -> np.ndarray:
    """Rows of valid blocks: finite float16 scales (and minimums), random quants."""
    rng = np.random.default_rng(seed)
    _, block_bytes = GGML_QUANT_SIZES[ggml_type]
    blocks = rng.integers(0, 256, (rows * blocks_per_row, block_bytes), dtype=np.uint8)
    head = 4 if ggml_type == Q.Q4_1 else 2
    scales = rng.normal(0, 1, (len(blocks), head // 2)) * 10.0 ** rng.integers(
        -6, 4, (len(blocks), 1)
    )
    scales[:3] = [[6.0e4] * (head // 2), [-6.0e-8] * (head // 2), [0.0] * (head // 2)]
    blocks[:, :head] = scales.astype(np.float16).view(np.uint8).reshape(len(blocks), head)
    return blocks.reshape(rows, blocks_per_row * block_bytes)


@pytest.mark.parametrize("ggml_type", FORMATS, ids=lambda t: t.name)
def test_random_blocks_dequantize_to_gguf_bits(ggml_type: Q) -> None:
    rows = random_rows(ggml_type, rows=37, blocks_per_row=6, seed=int(ggml_type))
    ours = dequantize_blocks(rows, ggml_type)
    reference = quants.dequantize(rows, ggml_type)
    assert ours.dtype == np.float32 and ours.shape == (37, 6 * 32) == reference.shape
    assert np.isfinite(ours).all()
    np.testing.assert_array_equal(ours.view(np.uint32), reference.view(np.uint32))
    # a batch of three rows is three rows: the leading axes are kept
    stacked = dequantize_blocks(rows.reshape(1, 37, -1), ggml_type)
    assert stacked.shape == (1, 37, 6 * 32)


def test_every_quantized_tensor_of_smollm2_dequantizes_to_gguf_bits() -> None:
    gguf = read_gguf(model_path("SmolLM2-135M-Instruct"))
    seen = set()
    for tensor in gguf.tensors.values():
        if tensor.ggml_type not in FORMATS or tensor.ggml_type in seen:
            continue  # the first tensor of each format (gguf's own path takes seconds each)
        seen.add(tensor.ggml_type)
        block_size, block_bytes = GGML_QUANT_SIZES[tensor.ggml_type]
        raw = np.memmap(
            gguf.path, dtype=np.uint8, mode="r", offset=tensor.offset, shape=tensor.nbytes
        )
        rows = raw.reshape(*tensor.shape[:-1], tensor.shape[-1] // block_size * block_bytes)
        ours = dequantize(rows, tensor.ggml_type)
        np.testing.assert_array_equal(
            ours.view(np.uint32), quants.dequantize(rows, tensor.ggml_type).view(np.uint32)
        )
    assert seen == {Q.Q8_0, Q.Q4_1}, seen  # what this file holds
