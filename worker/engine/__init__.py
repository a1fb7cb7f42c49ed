"""Model engine used by the prefill and decode services (plain torch).

Re-exports, resolved on first use: `import worker.engine` (or a torch-free submodule such as
`worker.engine.outputs`, `.config`, `.errors`, `.checkpoint`, `.gguf`,
`.gguf_tokenizer`) does not import torch (2-10 s), so the CLI and every other process that
does not run the model stay light.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "BlockAllocator": "worker.engine.block_allocator",
    "BlockManager": "worker.engine.block_manager",
    "CausalLM": "worker.engine.model",
    "ChatTemplate": "worker.engine.checkpoint",
    "ChatTemplateError": "worker.engine.checkpoint",
    "Checkpoint": "worker.engine.checkpoint",
    "CheckpointError": "worker.engine.errors",
    "DraftError": "worker.engine.errors",
    "DraftLength": "worker.engine.drafter",
    "DraftScore": "worker.engine.runner",
    "Engine": "worker.engine.engine",
    "EngineError": "worker.engine.errors",
    "FinishReason": "worker.engine.outputs",
    "GGUFFile": "worker.engine.gguf",
    "GGUFTensor": "worker.engine.gguf",
    "KVBlockLayout": "worker.engine.kv_cache",
    "KVLayoutError": "worker.engine.errors",
    "ModelConfig": "worker.engine.config",
    "ModelRunner": "worker.engine.runner",
    "OutOfBlocksError": "worker.engine.errors",
    "PagedKVPool": "worker.engine.kv_cache",
    "PromptLookup": "worker.engine.drafter",
    "RequestDrafter": "worker.engine.drafter",
    "RequestError": "worker.engine.engine",
    "RequestOutput": "worker.engine.engine",
    "SampleOutput": "worker.engine.sampler",
    "SamplingParams": "worker.engine.sampler",
    "SamplingParamsError": "worker.engine.errors",
    "ScheduledBatch": "worker.engine.scheduler",
    "Scheduler": "worker.engine.scheduler",
    "SchedulerConfig": "worker.engine.scheduler",
    "SchedulerConfigError": "worker.engine.scheduler",
    "Sequence": "worker.engine.sequence",
    "SequenceStateError": "worker.engine.errors",
    "SlidingWindowState": "worker.engine.kv_cache",
    "SpecDecodeConfig": "worker.engine.drafter",
    "SpecDecodeConfigError": "worker.engine.drafter",
    "SpecStats": "worker.engine.drafter",
    "StepOutput": "worker.engine.engine",
    "UnsupportedModelError": "worker.engine.errors",
    "config_from_gguf": "worker.engine.gguf",
    "load_gguf_weights": "worker.engine.weights",
    "load_model": "worker.engine.weights",
    "load_weights": "worker.engine.weights",
    "make_generator": "worker.engine.sampler",
    "read_gguf": "worker.engine.gguf",
    "sample": "worker.engine.sampler",
    "tokenizer_from_gguf": "worker.engine.gguf_tokenizer",
    "verify_draft": "worker.engine.speculative",
    "verify_greedy": "worker.engine.speculative",
    "verify_lookup_draft": "worker.engine.drafter",
    "verify_sampled": "worker.engine.speculative",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
