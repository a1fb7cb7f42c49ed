"""The block kernel (shared/kernels/cpu/quant_matmul.c through worker/engine/quant.py): the
weights it expands are gguf.quants' bit for bit, its products are the float32 products within
float32 rounding and do not depend on the batch, it builds once per machine into its cache, and
no compiler means float32 weights, not a failure."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from shared.kernels import cpu as cpu_kernels
from worker.engine import quant
from worker.engine.layers import Linear
from worker.engine.quant import QuantWeight
from worker.engine.weights import load_model

Q = gguf.GGMLQuantizationType
FORMATS = {"Q4_0": Q.Q4_0, "Q4_1": Q.Q4_1, "Q8_0": Q.Q8_0}


def quantized(fmt: str, rows: int, cols: int, seed: int = 0) -> tuple[QuantWeight, torch.Tensor]:
    """Random weights through gguf.quants: (the kernel's blocks, gguf's dequantized float32)."""
    rng = np.random.default_rng(seed)
    values = rng.normal(0.0, 0.05, (rows, cols)).astype(np.float32)
    raw = gguf.quants.quantize(values, FORMATS[fmt])
    reference = gguf.quants.dequantize(raw, FORMATS[fmt]).astype(np.float32)
    return QuantWeight.from_blocks(fmt, raw), torch.from_numpy(reference.reshape(rows, cols))


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_expanded_weights_are_gguf_dequantized_bit_for_bit(fmt) -> None:
    blocks, reference = quantized(fmt, 40, 96)
    assert blocks.shape == (40, 96)
    assert torch.equal(blocks.dequantize(), reference)


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 16])
def test_product_is_the_float32_product(fmt, rows) -> None:
    blocks, weight = quantized(fmt, 72, 160, seed=rows)
    x = torch.randn(rows, 160, generator=torch.Generator().manual_seed(rows))
    ref = x @ weight.T
    out = blocks.matmul(x)
    assert out.shape == (rows, 72)
    # A few float32 ulps of the larger terms: the same sum in another order and grouping.
    assert float((out - ref).abs().max()) <= 1e-5 * float(ref.abs().max())


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_a_row_gives_the_same_bits_alone_and_in_any_batch(fmt) -> None:
    blocks, _ = quantized(fmt, 50, 128)
    x = torch.randn(11, 128, generator=torch.Generator().manual_seed(7))
    together = blocks.matmul(x)
    for i in range(11):
        assert torch.equal(blocks.matmul(x[i : i + 1])[0], together[i])
    assert torch.equal(blocks.matmul(x[3:9]), together[3:9])


def test_threads_split_rows_without_changing_the_result() -> None:
    blocks, _ = quantized("Q4_1", 200, 256)
    x = torch.randn(3, 256)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = blocks.matmul(x)
        torch.set_num_threads(2)
        split = blocks.matmul(x)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(alone, split)


def test_linear_sends_decode_rows_to_blocks_and_prefill_rows_to_float32() -> None:
    blocks, weight = quantized("Q4_1", 64, 96)
    layer = Linear(96, 64, bias=True)
    with torch.no_grad():
        layer.weight.copy_(weight)
        layer.bias.copy_(torch.randn(64))
    layer.quant = blocks
    small = torch.randn(quant.MAX_ROWS, 96)
    assert torch.equal(layer(small), blocks.matmul(small) + layer.bias)
    large = torch.randn(quant.MAX_ROWS + 1, 96)
    assert torch.equal(layer(large), torch.nn.functional.linear(large, weight, layer.bias))
    # bfloat16 rows (a bfloat16 model's decode) are widened, multiplied, rounded back.
    half = small.bfloat16()
    assert layer.bfloat16()(half).dtype == torch.bfloat16
    expected = (blocks.matmul(half.float()).bfloat16() + layer.bias).to(torch.bfloat16)
    assert torch.equal(layer(half), expected)
    # Other dtypes never reach the float32 kernel.
    assert not quant.use_kernel(blocks, small.double())
    assert not quant.use_kernel(blocks, small.half())


def test_shape_and_dtype_mismatches_are_refused() -> None:
    blocks, _ = quantized("Q8_0", 8, 64)
    with pytest.raises(ValueError, match="the weight is"):
        blocks.matmul(torch.randn(2, 32))
    with pytest.raises(ValueError, match="the weight is"):
        blocks.matmul(torch.randn(2, 64, dtype=torch.float64))


def test_build_is_cached_per_machine(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("KVF_KERNEL_CACHE", str(tmp_path))
    first = cpu_kernels.build()
    assert first.parent == tmp_path and first.name.startswith("kernels-")
    built_at = first.stat().st_mtime_ns
    assert cpu_kernels.build() == first
    assert first.stat().st_mtime_ns == built_at  # not compiled again
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temporary left


def test_no_compiler_is_kernel_unavailable_and_loading_falls_back(
    tmp_path, monkeypatch, caplog
) -> None:
    monkeypatch.setattr(cpu_kernels, "_library", None)
    monkeypatch.setattr(cpu_kernels, "_failure", None)
    monkeypatch.setenv("KVF_KERNEL_CACHE", str(tmp_path / "kernels"))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.raises(cpu_kernels.KernelUnavailable, match="no-such-cc"):
        cpu_kernels.library()
    assert not cpu_kernels.available()
    path = tmp_path / "tiny.gguf"
    _write_tiny_q8_gguf(path)
    with caplog.at_level("WARNING"):
        model = load_model(path)
    assert "block kernel unavailable" in caplog.text
    assert model.logits_quant is None
    assert all(m.quant is None for m in model.modules() if isinstance(m, Linear))


def test_smollm2_keeps_every_projection_as_blocks(smol_gguf_model) -> None:
    model = smol_gguf_model
    linears = {name: m for name, m in model.named_modules() if isinstance(m, Linear)}
    assert len(linears) == 30 * 7
    assert all(m.quant is not None and m.quant.fmt == "Q4_1" for m in linears.values())
    assert model.logits_quant is not None and model.logits_quant.fmt == "Q8_0"  # tied embedding
    # The blocks expand to the parameters themselves (q and k rows un-permuted alike).
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.7.self_attn.k_proj"):
        assert torch.equal(linears[name].quant.dequantize(), linears[name].weight)
    assert torch.equal(model.logits_quant.dequantize(), model.model.embed_tokens.weight)


@pytest.fixture(scope="module")
def smol_gguf_model():
    from shared.models import ModelError, model_path

    try:
        path = model_path("SmolLM2-135M-Instruct")
    except ModelError as exc:  # `make test` fetches it: a missing file is a broken set-up
        pytest.fail(str(exc))
    return load_model(path)


def _write_tiny_q8_gguf(path) -> None:
    """A 2-layer llama of width 64 with Q8_0 projections."""
    rng = np.random.default_rng(0)
    hidden, inter, vocab, layers = 64, 128, 96, 2
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(layers)
    writer.add_context_length(128)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_rope_dimension_count(16)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)

    def add(name, shape, quantize=True):
        values = rng.normal(0, 0.05, shape).astype(np.float32)
        if quantize:
            writer.add_tensor(name, gguf.quants.quantize(values, Q.Q8_0), raw_dtype=Q.Q8_0)
        else:
            writer.add_tensor(name, values)

    add("token_embd.weight", (vocab, hidden))
    add("output_norm.weight", (hidden,), quantize=False)
    for i in range(layers):
        add(f"blk.{i}.attn_norm.weight", (hidden,), quantize=False)
        add(f"blk.{i}.ffn_norm.weight", (hidden,), quantize=False)
        add(f"blk.{i}.attn_q.weight", (hidden, hidden))
        add(f"blk.{i}.attn_k.weight", (32, hidden))
        add(f"blk.{i}.attn_v.weight", (32, hidden))
        add(f"blk.{i}.attn_output.weight", (hidden, hidden))
        add(f"blk.{i}.ffn_gate.weight", (inter, hidden))
        add(f"blk.{i}.ffn_up.weight", (inter, hidden))
        add(f"blk.{i}.ffn_down.weight", (hidden, inter))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
