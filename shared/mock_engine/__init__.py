"""The GPU-free mock engine (`--engine mock`, Dynamo's "mocker"): the model engine's surface
with simulated timing (`shared.cost_model`), deterministic fake tokens and real KV
bookkeeping, plus the few facts of the served model the mock workers need. No torch.
Re-exports only."""

from shared.mock_engine.engine import MockEngine, MockEngineConfig
from shared.mock_engine.model import MockModel, open_mock_store, sleep_simulated
from shared.mock_engine.requests import (
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
    "open_mock_store",
    "sleep_simulated",
]
