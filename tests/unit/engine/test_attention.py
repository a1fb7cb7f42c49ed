"""The split attention of a chunk after a cached prefix, the model thread and the warm-up."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from tests.unit.engine.engine_helpers import SLIDING
from worker.engine import ModelRunner, Sequence, load_model
from worker.engine.attention import attend, attend_after_prefix, visible
from worker.engine.worker import ModelThread, warm_up


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 2), (9, 3), (2, 2)])
@pytest.mark.parametrize("num_prefix", [1, 5, 64, 70])
@pytest.mark.parametrize("num_new", [1, 3, 17])
def test_after_prefix_equals_one_masked_call(
    num_heads: int, num_kv_heads: int, num_prefix: int, num_new: int
) -> None:
    torch.manual_seed(num_heads * 1000 + num_prefix * 10 + num_new)
    dim = 16
    # Scaled up so the softmax is peaked: a merge weighting the two halves wrongly shows.
    q = torch.randn(num_new, num_heads, dim) * 3
    k = torch.randn(num_prefix + num_new, num_kv_heads, dim) * 3
    v = torch.randn(num_prefix + num_new, num_kv_heads, dim)
    positions = torch.arange(num_prefix + num_new)
    expected = attend(q, k, v, visible(positions[num_prefix:], positions, None))
    got = attend_after_prefix(q, k[:num_prefix], v[:num_prefix], k[num_prefix:], v[num_prefix:])
    # Float32 summed in another order: ~1e-7; a query seeing one key too many or too few
    # moves its output by O(0.1).
    torch.testing.assert_close(got, expected, rtol=0, atol=2e-5)


def test_model_thread_runs_every_call_in_one_thread_of_its_own() -> None:
    async def main() -> tuple[int, int, int]:
        thread = ModelThread()
        try:
            first = await thread.run(threading.get_ident)
            second = await thread.run(lambda: threading.get_ident())
            return first, second, threading.get_ident()
        finally:
            await thread.close()

    first, second, loop_thread = asyncio.run(main())
    assert first == second
    assert first != loop_thread


@pytest.mark.parametrize(("family", "overrides"), [("llama", {}), ("qwen3", SLIDING)])
def test_warm_up_leaves_the_runner_as_it_was(make_hf, family: str, overrides: dict) -> None:
    _, path = make_hf(family, **overrides)
    runner = ModelRunner(load_model(path), num_blocks=8, block_size_tokens=4)
    prompt = [5, 9, 2, 7, 11, 3, 8, 1, 4]

    def logits() -> torch.Tensor:
        seq = Sequence(0, prompt)
        out = runner.prefill([seq])[0]
        runner.release(seq)
        return out

    before = logits()
    assert warm_up(runner, 20) > 0
    assert runner.allocator.num_free_blocks == 8
    torch.testing.assert_close(logits(), before, rtol=0, atol=0)
    # More tokens than the pool holds: it warms up on what fits.
    assert warm_up(runner, 10_000) > 0
    assert runner.allocator.num_free_blocks == 8
