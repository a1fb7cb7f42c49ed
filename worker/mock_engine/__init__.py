"""The GPU-free mock engine (`--engine mock`, Dynamo's "mocker"): the model engine's surface
with simulated timing (`worker.cost_model`), deterministic fake tokens and real KV
bookkeeping, plus the few facts of the served model the mock workers need. No torch.
Re-exports only."""

from worker.mock_engine.engine import MockEngine, MockEngineConfig
from worker.mock_engine.model import MockModel, sleep_simulated
from worker.mock_engine.requests import (
    FinishReason,
    MockRequestError,
    MockSamplingParams,
    MockStepOutput,
    MockUsage,
    fake_tokens,
)

__all__ = [
    "FinishReason",
    "MockEngine",
    "MockEngineConfig",
    "MockModel",
    "MockRequestError",
    "MockSamplingParams",
    "MockStepOutput",
    "MockUsage",
    "fake_tokens",
    "sleep_simulated",
]
