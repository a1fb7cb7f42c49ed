"""Model engine used by the prefill and decode services (plain torch)."""

from __future__ import annotations

from shared.engine.block_manager import BlockAllocator, BlockManager
from shared.engine.config import ModelConfig
from shared.engine.drafter import (
    DraftLength,
    PromptLookup,
    RequestDrafter,
    SpecDecodeConfig,
    SpecDecodeConfigError,
    SpecStats,
    verify_lookup_draft,
)
from shared.engine.engine import Engine, FinishReason, RequestError, RequestOutput, StepOutput
from shared.engine.errors import (
    CheckpointError,
    DraftError,
    EngineError,
    KVLayoutError,
    OutOfBlocksError,
    SamplingParamsError,
    SequenceStateError,
    UnsupportedModelError,
)
from shared.engine.kv_cache import KVBlockLayout, PagedKVPool, SlidingWindowState
from shared.engine.model import CausalLM
from shared.engine.runner import DraftScore, ModelRunner
from shared.engine.sampler import SampleOutput, SamplingParams, make_generator, sample
from shared.engine.scheduler import (
    ScheduledBatch,
    Scheduler,
    SchedulerConfig,
    SchedulerConfigError,
)
from shared.engine.sequence import Sequence
from shared.engine.speculative import verify_draft, verify_greedy, verify_sampled
from shared.engine.weights import load_model, load_weights

__all__ = [
    "BlockAllocator",
    "BlockManager",
    "CausalLM",
    "CheckpointError",
    "DraftError",
    "DraftLength",
    "DraftScore",
    "Engine",
    "EngineError",
    "FinishReason",
    "KVBlockLayout",
    "KVLayoutError",
    "ModelConfig",
    "ModelRunner",
    "OutOfBlocksError",
    "PagedKVPool",
    "PromptLookup",
    "RequestDrafter",
    "RequestError",
    "RequestOutput",
    "SampleOutput",
    "SamplingParams",
    "SamplingParamsError",
    "ScheduledBatch",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerConfigError",
    "Sequence",
    "SequenceStateError",
    "SlidingWindowState",
    "SpecDecodeConfig",
    "SpecDecodeConfigError",
    "SpecStats",
    "StepOutput",
    "UnsupportedModelError",
    "load_model",
    "load_weights",
    "make_generator",
    "sample",
    "verify_draft",
    "verify_greedy",
    "verify_lookup_draft",
    "verify_sampled",
]
