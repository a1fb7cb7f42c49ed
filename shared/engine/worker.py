"""Loading the model into a prefill or decode worker and describing it for discovery."""

from __future__ import annotations

import torch

from shared.config import EngineWorkerConfig
from shared.engine.config import FULL
from shared.engine.runner import ModelRunner
from shared.engine.weights import load_model


def build_runner(config: EngineWorkerConfig) -> ModelRunner:
    """Blocking (seconds): call it off the event loop."""
    torch.set_num_threads(config.num_threads)
    model = load_model(config.model_dir)
    return ModelRunner(
        model, num_blocks=config.num_kv_blocks, block_size_tokens=config.kv_block_size_tokens
    )


def describe(runner: ModelRunner, config: EngineWorkerConfig) -> dict[str, str]:
    """Discovery metadata: which model, and the KV block layout the SSD tier stores."""
    model_config = runner.config
    return {
        "model": config.model_dir.name,
        "num_params": str(sum(p.numel() for p in runner.model.parameters())),
        "kv_block_size_tokens": str(runner.layout.block_size_tokens),
        "kv_block_nbytes": str(runner.layout.block_nbytes),
        "layer_types": "".join("f" if t == FULL else "s" for t in model_config.layer_types),
        "sliding_window": str(model_config.sliding_window or 0),
    }
