"""Loading the model into a prefill or decode worker and describing it for discovery."""

from __future__ import annotations

import torch

from shared.config import EngineWorkerConfig
from shared.engine import quant
from shared.engine.config import FULL
from shared.engine.kv_cache import KVBlockLayout
from shared.engine.runner import ModelRunner
from shared.engine.swa_restore import SNAPSHOT_HEADER_NBYTES
from shared.engine.weights import load_model
from shared.serving.staging import aligned


def build_runner(config: EngineWorkerConfig) -> ModelRunner:
    """Blocking (seconds): call it off the event loop."""
    torch.set_num_threads(config.torch_threads)
    model = load_model(config.model_path)
    dtype = model.model.embed_tokens.weight.dtype
    layout = KVBlockLayout.for_model(model.config, config.kv_block_size_tokens, dtype)
    return ModelRunner(
        model,
        num_blocks=config.pool_pages(layout.block_nbytes),
        block_size_tokens=config.kv_block_size_tokens,
    )


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
    return {
        "model": config.model_name,
        "model_path": str(config.model_path),
        "num_params": str(sum(p.numel() for p in runner.model.parameters())),
        "num_threads": str(torch.get_num_threads()),
        "max_model_len": str(max_model_len(runner, config)),
        "kv_block_size_tokens": str(runner.layout.block_size_tokens),
        "kv_block_nbytes": str(runner.layout.block_nbytes),
        "num_kv_pages": str(runner.allocator.num_blocks),
        "layer_types": "".join("f" if t == FULL else "s" for t in model_config.layer_types),
        # GGUF block formats decode multiplies by directly (quant.py); "-": float32 only.
        "weight_blocks": ",".join(quant.block_formats(runner.model)) or "-",
        "sliding_window": str(model_config.sliding_window or 0),
    }
