"""What the mock prefill and decode workers (`--engine mock`) share.

The served model's few facts come from its metadata (config.json or the GGUF header), not
from loading its weights: vocabulary
(fake tokens are drawn from it), end-of-sequence ids and context length -- the same limits a
real worker enforces, so requests that fail on the model fail on the mock. The store is the
real one, written through aiofiles (no NIXL to import or register), with `mock_block_nbytes`
of placeholder bytes per block (`worker.serving.kv_io.open_mock_store`): kv-index, eviction
and the next turn's hits all see real slots. Simulated time is divided by `mock_speedup`
before it is slept, so every duration a mock worker reports is in the cluster's (scaled)
wall-clock time, comparable with the queue and transfer times it measures.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from shared.config import EngineWorkerConfig
from worker.engine.checkpoint import Checkpoint


@dataclass(frozen=True)
class MockModel:
    name: str  # the model directory's name: what requests must ask for
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    max_model_len: int

    @classmethod
    def from_config(cls, config: EngineWorkerConfig) -> MockModel:
        checkpoint = Checkpoint(config.model_path)  # metadata only: no weights are read
        model = checkpoint.config()
        return cls(
            name=config.model_name,
            vocab_size=model.vocab_size,
            eos_token_ids=checkpoint.eos_token_ids(),
            max_model_len=config.max_model_len or model.max_position_embeddings,
        )

    def describe(self, config: EngineWorkerConfig) -> dict[str, str]:
        """Discovery metadata, the keys of `worker.engine.worker.describe` that apply."""
        return {
            "model": self.name,
            "model_path": str(config.model_path),  # ingress reads its tokenizer from it
            "engine": "mock",
            "mock_speedup": str(config.mock_speedup),
            "kv_block_size_tokens": str(config.kv_block_size_tokens),
            "kv_block_nbytes": str(config.mock_block_nbytes),
            "max_model_len": str(self.max_model_len),
        }


async def sleep_simulated(duration_s: float, speedup: float) -> float:
    """Sleep `duration_s` of simulated time; returns the wall-clock seconds slept."""
    wall_s = duration_s / speedup
    await asyncio.sleep(wall_s)
    return wall_s
