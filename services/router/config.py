from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from services.router.policy import PLACEMENTS, PolicyConfig
from shared.config import ConfigError, ServiceConfig


@dataclass(frozen=True, kw_only=True)
class RouterConfig(ServiceConfig):
    """Environment prefix KVF_ROUTER_; the fields every service has are in ServiceConfig."""

    env_prefix: ClassVar[str] = "KVF_ROUTER_"

    # kv-index shards a match asks (all of them): must equal kv-index's num_shards.
    kv_index_shards: int = 1
    match_timeout_s: float = 0.5  # kv-index match; past it the request is routed cold
    ttft_objective_s: float = 2.0  # reject (OVERLOADED) past this estimated TTFT; 0 = off
    max_queued_tokens: int = 240_000  # per prefill worker, see PolicyConfig
    # Seconds OVERLOADED's Retry-After says when no decode worker has the free KV pages.
    decode_retry_after_s: float = 5.0
    decode_page_size_tokens: int = 64  # the decode workers' KV page (kv_block_size_tokens)
    max_attempts: int = 2  # prefill tries per request: the first and one retry
    accept_timeout_s: float = 5.0  # DecodeJob -> JobAccepted
    prefill_timeout_s: float = 600.0  # PrefillJob -> PrefillDone when the request has no deadline
    # Prefill placement: kv (the least estimated time to first token, from where the prefix
    # is cached and each worker's load), least-loaded or round-robin (these two ignore the
    # cache: baselines to measure kv against).
    placement: str = "kv"
    # The shared store's aggregate read bandwidth in bytes/s (0: unlimited); the router
    # queues the store reads it sends behind each other in its estimates.
    store_read_bytes_per_s: float = 0.0
    # The workers' speed against the cost model's reference rates (a mock engine's
    # --mock-speedup): estimates, and the retry-afters drawn from them, scale by it.
    cost_speedup: float = 1.0
    # Agent sessions whose work the router remembers for fair queueing (sessions.py).
    max_sessions: int = 65_536

    def validate(self) -> None:
        super().validate()
        for name in (
            "kv_index_shards",
            "match_timeout_s",
            "max_queued_tokens",
            "decode_retry_after_s",
            "decode_page_size_tokens",
            "max_attempts",
            "accept_timeout_s",
            "prefill_timeout_s",
            "cost_speedup",
            "max_sessions",
        ):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.placement not in PLACEMENTS:
            raise ConfigError(
                f"placement must be one of {', '.join(PLACEMENTS)}, got {self.placement!r}"
            )
        if self.store_read_bytes_per_s < 0:
            raise ConfigError(
                f"store_read_bytes_per_s must be >= 0 (0: unlimited), "
                f"got {self.store_read_bytes_per_s}"
            )
        if self.ttft_objective_s < 0:
            raise ConfigError(
                f"ttft_objective_s must be >= 0 (0 turns it off), got {self.ttft_objective_s}"
            )

    def policy_config(self) -> PolicyConfig:
        return PolicyConfig(
            ttft_objective_s=self.ttft_objective_s or None,
            max_queued_tokens=self.max_queued_tokens,
            decode_page_size_tokens=self.decode_page_size_tokens,
            decode_retry_after_s=self.decode_retry_after_s,
            max_attempts=self.max_attempts,
            placement=self.placement,
            store_read_bytes_per_s=self.store_read_bytes_per_s or None,
        )
