"""Simulated timing of the mock engine (`shared.testing.mock_engine`).

Prefill of a request = load of its cached tokens + bounded replay when its node lacks the
sliding-window snapshot + compute of its uncached tokens, all serial (the same sum the
router's `CostModel` estimates, so a router driven against mock engines is judged against
its own assumptions, not a different model). A decode step costs a fixed part, a part per
sequence in the batch and a part per context token the batch's attention reads.

Defaults are DESIGN.md's per-GPU figures from `shared.reference_costs`, the same ones
`services.router.cost` starts from.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared import reference_costs as reference


class MockCostModelError(ValueError):
    """A rate is not positive or a cost is negative."""


@dataclass(frozen=True)
class MockCostModel:
    prefill_tokens_per_s: float = reference.PREFILL_TOKENS_PER_S
    load_tokens_per_s: float = reference.LOAD_TOKENS_PER_S
    replay_tokens: int = reference.REPLAY_TOKENS
    # A replayed token runs only the sliding layers; charged as a full token until measured.
    replay_tokens_per_s: float = reference.PREFILL_TOKENS_PER_S
    decode_step_base_s: float = reference.DECODE_STEP_BASE_S
    decode_step_per_seq_s: float = reference.DECODE_STEP_PER_SEQ_S
    # Attention reads every context token's KV each step. No published figure to derive it
    # from, so off by default; tests and load generators set it.
    decode_step_per_context_token_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("prefill_tokens_per_s", "load_tokens_per_s", "replay_tokens_per_s"):
            if not getattr(self, name) > 0:
                raise MockCostModelError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in (
            "replay_tokens",
            "decode_step_base_s",
            "decode_step_per_seq_s",
            "decode_step_per_context_token_s",
        ):
            if getattr(self, name) < 0:
                raise MockCostModelError(f"{name} must be >= 0, got {getattr(self, name)}")

    def num_replay_tokens(self, num_cached_tokens: int, has_swa_snapshot: bool) -> int:
        """Tokens replayed through the sliding layers to rebuild the window at the boundary."""
        if has_swa_snapshot:
            return 0
        return min(self.replay_tokens, num_cached_tokens)

    def prefill_s(
        self, num_computed_tokens: int, num_loaded_tokens: int = 0, num_replayed_tokens: int = 0
    ) -> float:
        return (
            num_computed_tokens / self.prefill_tokens_per_s
            + num_loaded_tokens / self.load_tokens_per_s
            + num_replayed_tokens / self.replay_tokens_per_s
        )

    def decode_step_s(self, num_seqs: int, num_context_tokens: int = 0) -> float:
        if num_seqs == 0:
            return 0.0
        return (
            self.decode_step_base_s
            + self.decode_step_per_seq_s * num_seqs
            + self.decode_step_per_context_token_s * num_context_tokens
        )
