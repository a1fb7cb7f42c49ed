from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from shared.config import ConfigError, EngineWorkerConfig
from worker.serving.fair_queue import FCFS, QUEUE_POLICIES

SWA_REPLAY_MODES = ("bounded", "exact")


@dataclass(frozen=True, kw_only=True)
class PrefillConfig(EngineWorkerConfig):
    """Environment prefix KVF_PREFILL_; model, KV pool and store fields are in
    EngineWorkerConfig."""

    env_prefix: ClassVar[str] = "KVF_PREFILL_"

    max_batch_tokens: int = 2048  # tokens of all jobs in one forward pass (chunked prefill)
    # Sliding-window state at the cached boundary: the node's swa-memcache first (exact),
    # else replay the last `swa_replay_tokens` tokens (0: one window W) -- or, with
    # swa_replay=exact, k x W tokens, which reproduces the state exactly.
    swa_use_memcache: bool = True
    # The replay without a snapshot: bounded (swa_replay_tokens) or exact (k x W tokens).
    swa_replay: str = "bounded"
    # Tokens a bounded replay recomputes (0: one window W); ignored with swa_replay=exact.
    swa_replay_tokens: int = 0
    handoff_timeout_s: float = 30.0  # decode's pull of the staged suffix
    # The order queued jobs are computed in: fcfs (arrival) or fair (the router's queue level,
    # then accounts in turn, the oldest job leading one pass in 4: worker/serving/fair_queue.py).
    queue_policy: str = FCFS

    def validate(self) -> None:
        super().validate()
        if self.max_batch_tokens <= 0:
            raise ConfigError("max_batch_tokens must be > 0")
        if self.swa_replay not in SWA_REPLAY_MODES:
            raise ConfigError(f"swa_replay must be one of {', '.join(SWA_REPLAY_MODES)}")
        if self.swa_replay_tokens < 0:
            raise ConfigError("swa_replay_tokens must be >= 0")
        if self.handoff_timeout_s <= 0:
            raise ConfigError("handoff_timeout_s must be > 0")
        if self.queue_policy not in QUEUE_POLICIES:
            raise ConfigError(f"queue_policy must be one of {', '.join(QUEUE_POLICIES)}")
