"""shared/kernels/cpu/paged_attention.c: a prefill chunk's causal attention over the pool, in place.

Against the masked SDPA reference over the same keys gathered into one tensor, on pools whose
blocks are scattered, with stale NaN in every slot the chunk may not see; then the model end
to end, kernel against the SDPA path, on a float32 pool of 64-token blocks."""

from __future__ import annotations

import pytest
import torch

from shared.kernels import cpu as cpu_kernels
from worker.engine import ModelRunner, Sequence, load_model
from worker.engine.attention import (
    attend,
    paged_attention,
    paged_attention_scratch,
    paged_attention_serves,
    visible,
)
from worker.engine.kv_cache import KVBlockLayout, PagedKVPool

pytestmark = pytest.mark.skipif(
    not (cpu_kernels.available() and cpu_kernels.attention_simd()),
    reason="the paged attention kernel needs a C compiler and AVX-512F",
)
BLOCK = 64


def scattered_pool(num_layers, num_kv_heads, dim, num_keys, seed):
    """A pool whose blocks for num_keys keys sit at shuffled ids, every other slot NaN."""
    torch.manual_seed(seed)
    num_blocks = -(-num_keys // BLOCK)
    pool = PagedKVPool(
        KVBlockLayout(num_layers, BLOCK, num_kv_heads, dim, torch.float32), num_blocks + 3
    )
    pool.kv.fill_(float("nan"))
    table = torch.randperm(num_blocks + 3)[:num_blocks]
    keys = torch.randn(num_layers, num_keys, num_kv_heads, dim) * 2
    values = torch.randn(num_layers, num_keys, num_kv_heads, dim)
    positions = torch.arange(num_keys)
    for layer in range(num_layers):
        pool.write(
            layer, (table[positions // BLOCK], positions % BLOCK), keys[layer], values[layer]
        )
    return pool, table, keys, values


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "dim"), [(9, 3, 64), (4, 2, 64), (2, 2, 128), (8, 1, 64)]
)
@pytest.mark.parametrize(
    ("start", "num_new"), [(0, 1), (0, 70), (5, 1), (64, 3), (100, 29), (1600, 256), (127, 130)]
)
def test_kernel_equals_the_masked_reference(num_heads, num_kv_heads, dim, start, num_new) -> None:
    num_keys = start + num_new
    pool, table, keys, values = scattered_pool(2, num_kv_heads, dim, num_keys, seed=start + dim)
    q = torch.randn(num_new, num_heads, dim) * 2  # peaked: a key seen wrongly moves the output
    positions = torch.arange(num_keys)
    scratch = paged_attention_scratch(pool, num_keys)
    for layer in range(2):
        expected = attend(
            q, keys[layer], values[layer], visible(positions[start:], positions, None)
        )
        got = paged_attention(pool, layer, table, start, q, scratch)
        # Float32 summed in another order: ~1e-6; one key too many or too few moves an
        # output by O(0.1); a stale NaN read anywhere makes it NaN.
        torch.testing.assert_close(got, expected, rtol=0, atol=2e-5)


@pytest.mark.parametrize(("start", "num_new"), [(0, 70), (1600, 40)])
def test_scores_far_apart_stay_finite(start, num_new) -> None:
    """Scores hundreds apart (in base 2): every row's softmax must subtract its true running
    maximum, or exp2 of the difference overflows and the output turns inf or NaN."""
    num_keys = start + num_new
    pool, table, keys, values = scattered_pool(1, 3, 64, num_keys, seed=7)
    q = torch.randn(num_new, 9, 64) * 100  # q.k / 8 spans thousands
    positions = torch.arange(num_keys)
    expected = attend(q, keys[0], values[0], visible(positions[start:], positions, None))
    got = paged_attention(pool, 0, table, start, q, paged_attention_scratch(pool, num_keys))
    assert torch.isfinite(got).all()
    # Scores in the thousands carry float32 round-off of ~1e-4 into the exponent.
    torch.testing.assert_close(got, expected, rtol=0, atol=2e-3)


def test_bad_block_table_or_scratch_is_refused() -> None:
    pool, table, _, _ = scattered_pool(1, 2, 64, 130, seed=0)
    q = torch.randn(2, 4, 64)
    scratch = paged_attention_scratch(pool, 130)
    with pytest.raises(ValueError, match="block table"):
        paged_attention(pool, 0, table[:2], 128, q, scratch)
    with pytest.raises(ValueError, match="scratch"):
        paged_attention(pool, 0, table, 128, q, paged_attention_scratch(pool, 64))


def test_serves_float32_pools_of_64_token_blocks_only() -> None:
    def pool(block: int, dim: int, dtype: torch.dtype) -> PagedKVPool:
        return PagedKVPool(KVBlockLayout(1, block, 2, dim, dtype), 1)

    assert paged_attention_serves(pool(64, 64, torch.float32))
    assert not paged_attention_serves(pool(64, 64, torch.bfloat16))
    assert not paged_attention_serves(pool(16, 64, torch.float32))
    assert not paged_attention_serves(pool(64, 32, torch.float32))


def test_model_through_the_kernel_matches_the_sdpa_path(make_hf) -> None:
    """A llama of head_dim 64 and grouped heads: a prompt, then a chunk after it and a decode
    step, with and without the kernel."""
    _, path = make_hf(
        "llama", head_dim=64, hidden_size=128, num_attention_heads=2, num_key_value_heads=1
    )
    model = load_model(path)
    prompt = [(7 * i + 3) % 97 for i in range(200)]
    outputs = []
    for paged_kernel in (True, False):
        runner = ModelRunner(
            model, num_blocks=8, block_size_tokens=BLOCK, paged_kernel=paged_kernel
        )
        assert (runner.pool.kv.dtype == torch.float32) and paged_attention_serves(runner.pool)
        seq = Sequence(0, prompt)
        first = runner.prefill([seq], num_new_tokens=[130])[0]
        second = runner.prefill([seq], num_new_tokens=[70])[0]
        seq.append(int(second.argmax()))
        third = runner.decode([seq])[0]
        outputs.append(torch.stack((first, second, third)))
    torch.testing.assert_close(outputs[0], outputs[1], rtol=0, atol=1e-4)
