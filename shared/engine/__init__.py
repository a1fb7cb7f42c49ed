"""Model engine used by the prefill and decode services (plain torch).

Re-exports, resolved on first use: `import shared.engine` (or a torch-free submodule such as
`shared.engine.outputs`, `.config`, `.errors`, `.bundled`, `.checkpoint`, `.gguf`,
`.gguf_tokenizer`) does not import torch (2-10 s), so the mock workers, the CLI and every
other process that does not run the model stay light.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "BlockAllocator": "shared.engine.block_manager",
    "BlockManager": "shared.engine.block_manager",
    "CausalLM": "shared.engine.model",
    "ChatTemplate": "shared.engine.checkpoint",
    "ChatTemplateError": "shared.engine.checkpoint",
    "Checkpoint": "shared.engine.checkpoint",
    "CheckpointError": "shared.engine.errors",
    "DraftError": "shared.engine.errors",
    "DraftLength": "shared.engine.drafter",
    "DraftScore": "shared.engine.runner",
    "Engine": "shared.engine.engine",
    "EngineError": "shared.engine.errors",
    "FinishReason": "shared.engine.outputs",
    "GGUFFile": "shared.engine.gguf",
    "GGUFTensor": "shared.engine.gguf",
    "KVBlockLayout": "shared.engine.kv_cache",
    "KVLayoutError": "shared.engine.errors",
    "ModelConfig": "shared.engine.config",
    "ModelRunner": "shared.engine.runner",
    "OutOfBlocksError": "shared.engine.errors",
    "PagedKVPool": "shared.engine.kv_cache",
    "PromptLookup": "shared.engine.drafter",
    "RequestDrafter": "shared.engine.drafter",
    "RequestError": "shared.engine.engine",
    "RequestOutput": "shared.engine.engine",
    "SampleOutput": "shared.engine.sampler",
    "SamplingParams": "shared.engine.sampler",
    "SamplingParamsError": "shared.engine.errors",
    "ScheduledBatch": "shared.engine.scheduler",
    "Scheduler": "shared.engine.scheduler",
    "SchedulerConfig": "shared.engine.scheduler",
    "SchedulerConfigError": "shared.engine.scheduler",
    "Sequence": "shared.engine.sequence",
    "SequenceStateError": "shared.engine.errors",
    "SlidingWindowState": "shared.engine.kv_cache",
    "SpecDecodeConfig": "shared.engine.drafter",
    "SpecDecodeConfigError": "shared.engine.drafter",
    "SpecStats": "shared.engine.drafter",
    "StepOutput": "shared.engine.engine",
    "UnsupportedModelError": "shared.engine.errors",
    "config_from_gguf": "shared.engine.gguf",
    "load_gguf_weights": "shared.engine.weights",
    "load_model": "shared.engine.weights",
    "load_weights": "shared.engine.weights",
    "make_generator": "shared.engine.sampler",
    "read_gguf": "shared.engine.gguf",
    "sample": "shared.engine.sampler",
    "tokenizer_from_gguf": "shared.engine.gguf_tokenizer",
    "verify_draft": "shared.engine.speculative",
    "verify_greedy": "shared.engine.speculative",
    "verify_lookup_draft": "shared.engine.drafter",
    "verify_sampled": "shared.engine.speculative",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
