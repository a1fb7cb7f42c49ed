"""Loading the model into a prefill or decode worker and describing it for discovery."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch

from shared.config import EngineWorkerConfig
from worker.engine import quant
from worker.engine.config import FULL
from worker.engine.kv_cache import KVBlockLayout
from worker.engine.model import LanguageModel
from worker.engine.runner import ModelRunner
from worker.engine.sequence import Sequence
from worker.engine.swa_restore import SNAPSHOT_HEADER_NBYTES
from worker.engine.weights import load_model
from worker.kvstore.backends import aligned
from worker.malloc import keep_freed_memory

T = TypeVar("T")


def build_runner(
    config: EngineWorkerConfig,
    simulate: Callable[[EngineWorkerConfig, torch.dtype], LanguageModel] | None = None,
) -> ModelRunner:
    """The runner over the checkpoint's model, or over `simulate`'s (`--engine mock`: its
    geometry, none of its weights). Blocking (seconds): call it in the thread that will run
    the model (`ModelThread`)."""
    keep_freed_memory()
    torch.set_num_threads(config.torch_threads)
    dtype = getattr(torch, config.dtype)
    if simulate is not None:
        model = simulate(config, dtype)
    else:
        model = load_model(config.model_path, dtype)
    layout = KVBlockLayout.for_model(model.config, config.kv_block_size_tokens, dtype)
    return ModelRunner(
        model,
        num_blocks=config.pool_pages(layout.block_nbytes),
        block_size_tokens=config.kv_block_size_tokens,
        kv_dtype=dtype,
        host_tier_bytes=config.host_tier_bytes,
    )


class ModelThread:
    """The one thread a worker loads and runs its model in, off the event loop.

    Every thread that runs a parallel torch op gets an OpenMP team of its own, and once a
    process holds more OpenMP threads than it has cores, libgomp stops spinning between
    parallel regions: each later op pays a futex wake-up, ~50 us, in every thread. Measured
    (SmolLM2, 257 tokens after 1,344 cached, 2 cores): loaded in one thread and run in another,
    235-248 ms in bfloat16 and 431-461 ms in float32; loaded and run in one thread, 147-161 ms
    and 355-381 ms. asyncio's default pool made it worse (whichever of its threads is idle).
    So the model is built here (`build_runner`), warmed up here (`warm_up`: a thread's first
    long forward also pays for its allocator arena), and every forward runs here; the event
    loop's own torch calls stay small (under ATen's parallel grain), so it never starts a team.
    """

    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")

    async def run(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args, **kwargs))

    async def close(self) -> None:
        """No new calls; one running finishes in its thread (safe to repeat)."""
        self._executor.shutdown(wait=False)


def warm_up(runner: ModelRunner, num_tokens: int) -> float:
    """Run every kind of forward a worker serves on `num_tokens` dummy tokens (half from
    scratch, half after that cached half, then one decode step), leaving the pool as it was;
    the seconds it took. Call it in the thread that will serve (`ModelThread.run`)."""
    started = time.perf_counter()
    block = runner.layout.block_size_tokens
    # What the pool holds and the model's positions reach (the decode step adds one token).
    num_tokens = min(
        num_tokens,
        runner.allocator.num_blocks * block - 1,
        runner.config.max_position_embeddings - 1,
    )
    if num_tokens < 2:
        return 0.0
    # Ids past the first ones (where the special tokens are), in no particular order.
    vocab = runner.config.vocab_size
    first = min(1000, vocab // 2)
    token_ids = [first + (i * 7919) % (vocab - first) for i in range(num_tokens + 1)]
    seq = Sequence(-1, token_ids)
    try:
        half = num_tokens // 2
        runner.prefill([seq], num_new_tokens=[half])
        runner.prefill([seq], num_new_tokens=[num_tokens - half])
        runner.decode([seq])
    finally:
        runner.release(seq)
    return time.perf_counter() - started


def max_model_len(runner: ModelRunner, config: EngineWorkerConfig) -> int:
    """The longest sequence served: the configured limit, else the model's own context."""
    return config.max_model_len or runner.config.max_position_embeddings


def handoff_staging_bytes(runner: ModelRunner, config: EngineWorkerConfig) -> int:
    """Room in the NIXL buffer for one prefill -> decode handoff of the longest prompt: its
    pages and the window snapshot (the configured size, when one is given)."""
    if config.handoff_staging_bytes:
        return config.handoff_staging_bytes
    num_pages = -(-max_model_len(runner, config) // runner.layout.block_size_tokens) + 1
    model = runner.config
    window_tokens = model.sliding_window or 0
    element = torch.empty((), dtype=runner.dtype).element_size()
    window = model.num_sliding_layers * 2 * window_tokens * model.num_kv_heads * model.head_dim
    return aligned(
        num_pages * runner.layout.block_nbytes + window * element + SNAPSHOT_HEADER_NBYTES
    )


def describe(runner: ModelRunner, config: EngineWorkerConfig) -> dict[str, str]:
    """Discovery metadata: which model, and the KV block layout the SSD tier stores."""
    model_config = runner.config
    weights = runner.model if isinstance(runner.model, torch.nn.Module) else None  # mock: none
    mock = {"mock_speedup": str(config.mock_speedup)} if weights is None else {}
    return mock | {
        "model": config.model_name,
        "model_path": str(config.model_path),
        "num_params": str(0 if weights is None else sum(p.numel() for p in weights.parameters())),
        "num_threads": str(torch.get_num_threads()),
        "dtype": str(runner.dtype).removeprefix("torch."),
        "max_model_len": str(max_model_len(runner, config)),
        "kv_block_size_tokens": str(runner.layout.block_size_tokens),
        "kv_block_nbytes": str(runner.layout.block_nbytes),
        "num_kv_pages": str(runner.allocator.num_blocks),
        "layer_types": "".join("f" if t == FULL else "s" for t in model_config.layer_types),
        # GGUF block formats decode multiplies by directly (quant.py); "-": float32 only.
        "weight_blocks": ",".join(quant.block_formats(weights) if weights else []) or "-",
        "sliding_window": str(model_config.sliding_window or 0),
    }
