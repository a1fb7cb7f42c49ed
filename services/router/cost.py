"""The router's cost model: estimated time to first token of a request on a prefill worker.

    ttft = queue wait + compute of the uncached tokens + load of the hit tokens + replay

Pure arithmetic over a few rates, the explicit TTFT form of Mooncake's Conductor
(`T_queue + T_prefill(uncached) + T_transfer`) rather than Dynamo's weighted overlap score, so
the objective it is compared against is in seconds. The defaults are DESIGN.md section 6's
per-GPU figures; a deployment sets measured rates through the router config.

Queue wait counts queued tokens at the compute rate: a worker reports (and the router counts
in flight) the tokens it still has to *compute*. Loading a queued job's hit tokens is left
out of the wait because at the reference mix it overlaps with compute (1.5M tokens/s at 96%
hit is exactly 60K miss tokens/s of compute, so the loads cannot be on the critical path).
"""

from __future__ import annotations

from dataclasses import dataclass

from shared import reference_costs as reference


class CostModelError(ValueError):
    """A cost model rate is not positive (or a count is negative)."""


@dataclass(frozen=True)
class PrefillEstimate:
    """One worker's estimated time to first token for one request, by term."""

    queue_wait_s: float
    compute_s: float
    load_s: float
    replay_s: float

    @property
    def ttft_s(self) -> float:
        return self.queue_wait_s + self.compute_s + self.load_s + self.replay_s

    @property
    def own_s(self) -> float:
        """The request's own prefill time, what an idle worker would take."""
        return self.compute_s + self.load_s + self.replay_s


@dataclass(frozen=True)
class CostModel:
    prefill_tokens_per_s: float = reference.PREFILL_TOKENS_PER_S
    load_tokens_per_s: float = reference.LOAD_TOKENS_PER_S
    replay_tokens: int = reference.REPLAY_TOKENS
    # A replayed token runs only the sliding layers, so it is cheaper than a full token; the
    # default charges it as a full one (an upper bound) until the ratio is measured.
    replay_tokens_per_s: float = reference.PREFILL_TOKENS_PER_S
    decode_step_base_s: float = reference.DECODE_STEP_BASE_S
    decode_step_per_seq_s: float = reference.DECODE_STEP_PER_SEQ_S

    def __post_init__(self) -> None:
        for name in ("prefill_tokens_per_s", "load_tokens_per_s", "replay_tokens_per_s"):
            if not getattr(self, name) > 0:
                raise CostModelError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("replay_tokens", "decode_step_base_s", "decode_step_per_seq_s"):
            if getattr(self, name) < 0:
                raise CostModelError(f"{name} must be >= 0, got {getattr(self, name)}")

    def queue_wait_s(self, num_queued_tokens: int) -> float:
        return max(num_queued_tokens, 0) / self.prefill_tokens_per_s

    def replay_s(self, num_cached_tokens: int, has_swa_snapshot: bool) -> float:
        """Bounded replay of the window before the boundary; nothing to restore without a hit."""
        if has_swa_snapshot or num_cached_tokens <= 0:
            return 0.0
        return min(self.replay_tokens, num_cached_tokens) / self.replay_tokens_per_s

    def prefill(
        self,
        *,
        num_queued_tokens: int,
        num_prompt_tokens: int,
        num_cached_tokens: int,
        has_swa_snapshot: bool,
    ) -> PrefillEstimate:
        return PrefillEstimate(
            queue_wait_s=self.queue_wait_s(num_queued_tokens),
            compute_s=(num_prompt_tokens - num_cached_tokens) / self.prefill_tokens_per_s,
            load_s=num_cached_tokens / self.load_tokens_per_s,
            replay_s=self.replay_s(num_cached_tokens, has_swa_snapshot),
        )

    def decode_step_s(self, num_seqs: int) -> float:
        return self.decode_step_base_s + self.decode_step_per_seq_s * num_seqs

    def queue_tokens_of(
        self, num_prompt_tokens: int, num_cached_tokens: int, has_swa_snapshot: bool
    ) -> int:
        """Tokens a job adds to its prefill worker's queue: what it has to compute, with a
        replay counted in compute-token equivalents."""
        replay_s = self.replay_s(num_cached_tokens, has_swa_snapshot)
        return num_prompt_tokens - num_cached_tokens + round(replay_s * self.prefill_tokens_per_s)
