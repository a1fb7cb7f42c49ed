"""What serving a request costs in time, in one place: the router estimates a request's time
to first token with it, and the mock's simulated model sleeps what it says for each pass
(its store loads are real reads), so a router driven against mock workers is judged against
its own assumptions, not another model's.

    prefill = compute of the uncached tokens + load of the hit tokens (from the worker's own
              memory, or from the shared store) + replay of the window
    decode step = a fixed part + a part per sequence + a part per context token attended

The rates default to the reference deployment's per-GPU figures (docs/design.md, 'The
reference deployment'; below); `CostModel(...)` takes measured ones (no service's flags
set them one by one; the router's `cost_speedup` scales them all, as `sped_up` does).
The TTFT the router compares against its objective is Mooncake's Conductor form
(`T_queue + T_prefill(uncached) + T_transfer`), in seconds, rather than Dynamo's weighted
overlap score.

Queue wait counts queued tokens at the compute rate: a worker reports the tokens it still
has to *compute*; the router counts a job it sends as its compute, replay and loads in
compute-token equivalents (`queue_tokens_of`'s `load_s`: a worker loads a job's prefix before
computing it, and a saturated store can make the load the larger part).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

# One prefill GPU computes ~60K tokens/s without the cache and serves 1.5M tokens/s at 96%
# hit, i.e. it reads 0.96 x 1.5M = 1.44M hit tokens/s.
PREFILL_TOKENS_PER_S = 60_000.0
LOAD_TOKENS_PER_S = 1_440_000.0
# Bounded replay recomputes R = 128 tokens through the sliding layers (exact replay would be
# 20 layers x 128 = 2,560).
REPLAY_TOKENS = 128
# A decode GPU emits ~14K tokens/s. The batch it does that at is not published; assuming 256
# sequences, a step is 256 / 14K = 18.3 ms, split into a fixed 10 ms (weights, communication)
# and 32.5 us per sequence. An assumption, not a measurement.
DECODE_STEP_BASE_S = 0.010
DECODE_STEP_PER_SEQ_S = 0.0000325
# KV of the full-attention layers per token (`kvfabric plan`'s default): 9 GB/s per GPU of the
# store's 10 TiB/s is 1.46M tokens/s, the load rate above.
KV_BYTES_PER_TOKEN = 6_144
# A worker's own host-memory tier into its device: PCIe Gen5 x16 sustains ~25 GB/s of its
# 64 GB/s (an assumption, not a measurement); blocks in its device pool cost nothing.
HOST_LOAD_BYTES_PER_S = 25e9


class CostModelError(ValueError):
    """A rate is not positive, or a cost is negative."""


@dataclass(frozen=True)
class PrefillEstimate:
    """One worker's estimated time to first token for one request, by term."""

    queue_wait_s: float
    compute_s: float
    load_s: float  # from the shared store, waiting for its bandwidth included
    replay_s: float
    local_load_s: float = 0.0  # from the worker's own memory

    @property
    def ttft_s(self) -> float:
        return self.queue_wait_s + self.own_s

    @property
    def own_s(self) -> float:
        """The request's own prefill time, what an idle worker would take."""
        return self.compute_s + self.local_load_s + self.load_s + self.replay_s


@dataclass(frozen=True)
class CostModel:
    prefill_tokens_per_s: float = PREFILL_TOKENS_PER_S
    load_tokens_per_s: float = LOAD_TOKENS_PER_S
    replay_tokens: int = REPLAY_TOKENS
    # A replayed token runs only the sliding layers, so it is cheaper than a full token; the
    # default charges it as a full one (an upper bound) until the ratio is measured.
    replay_tokens_per_s: float = PREFILL_TOKENS_PER_S
    decode_step_base_s: float = DECODE_STEP_BASE_S
    decode_step_per_seq_s: float = DECODE_STEP_PER_SEQ_S
    # Attention reads every context token's KV each step. No published figure to derive it
    # from, so off by default; tests and load generators set it.
    decode_step_per_context_token_s: float = 0.0
    kv_bytes_per_token: int = KV_BYTES_PER_TOKEN
    host_load_bytes_per_s: float = HOST_LOAD_BYTES_PER_S

    def __post_init__(self) -> None:
        for name in (
            "prefill_tokens_per_s",
            "load_tokens_per_s",
            "replay_tokens_per_s",
            "kv_bytes_per_token",
            "host_load_bytes_per_s",
        ):
            if not getattr(self, name) > 0:
                raise CostModelError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in (
            "replay_tokens",
            "decode_step_base_s",
            "decode_step_per_seq_s",
            "decode_step_per_context_token_s",
        ):
            if getattr(self, name) < 0:
                raise CostModelError(f"{name} must be >= 0, got {getattr(self, name)}")

    def sped_up(self, factor: float) -> CostModel:
        """This model on hardware `factor` x as fast (a mock engine's `mock_speedup`)."""
        if not factor > 0:
            raise CostModelError(f"factor must be > 0, got {factor}")
        if factor == 1:
            return self
        return dataclasses.replace(
            self,
            prefill_tokens_per_s=self.prefill_tokens_per_s * factor,
            load_tokens_per_s=self.load_tokens_per_s * factor,
            replay_tokens_per_s=self.replay_tokens_per_s * factor,
            host_load_bytes_per_s=self.host_load_bytes_per_s * factor,
            decode_step_base_s=self.decode_step_base_s / factor,
            decode_step_per_seq_s=self.decode_step_per_seq_s / factor,
            decode_step_per_context_token_s=self.decode_step_per_context_token_s / factor,
        )

    # -- prefill -------------------------------------------------------------------------
    def num_replay_tokens(self, num_cached_tokens: int, has_swa_snapshot: bool) -> int:
        """Tokens replayed through the sliding layers to rebuild the window at the boundary
        (bounded replay); none with the snapshot, nothing to restore without a hit."""
        if has_swa_snapshot or num_cached_tokens <= 0:
            return 0
        return min(self.replay_tokens, num_cached_tokens)

    def prefill_s(
        self,
        num_computed_tokens: int,
        num_loaded_tokens: int = 0,
        num_replayed_tokens: int = 0,
        num_local_tokens: int = 0,
    ) -> float:
        """Serial time of computing, loading (from the store; `num_local_tokens` from the
        worker's own memory) and replaying that many tokens."""
        return (
            num_computed_tokens / self.prefill_tokens_per_s
            + num_loaded_tokens / self.load_tokens_per_s
            + self.local_load_s(num_local_tokens)
            + num_replayed_tokens / self.replay_tokens_per_s
        )

    def local_load_s(self, num_tokens: int) -> float:
        """Loading from the worker's own host memory into its device."""
        return num_tokens * self.kv_bytes_per_token / self.host_load_bytes_per_s

    def store_load_s(self, num_tokens: int) -> float:
        """Reading from the shared store at one GPU's rate, the store not saturated."""
        return num_tokens / self.load_tokens_per_s

    def kv_bytes(self, num_tokens: int) -> int:
        return num_tokens * self.kv_bytes_per_token

    def queue_wait_s(self, num_queued_tokens: int) -> float:
        return max(num_queued_tokens, 0) / self.prefill_tokens_per_s

    def replay_s(self, num_cached_tokens: int, has_swa_snapshot: bool) -> float:
        replayed = self.num_replay_tokens(num_cached_tokens, has_swa_snapshot)
        return replayed / self.replay_tokens_per_s

    def prefill(
        self,
        *,
        num_queued_tokens: int,
        num_prompt_tokens: int,
        num_cached_tokens: int,
        has_swa_snapshot: bool,
        num_local_tokens: int = 0,
        store_load_s: float | None = None,
    ) -> PrefillEstimate:
        """The router's estimate for one request on one worker: of the cached tokens, the
        first `num_local_tokens` are in the worker's own memory, the rest are read from the
        store in `store_load_s` (default: at one GPU's rate, the store not saturated)."""
        num_store_tokens = num_cached_tokens - num_local_tokens
        if store_load_s is None:
            store_load_s = self.store_load_s(num_store_tokens)
        return PrefillEstimate(
            queue_wait_s=self.queue_wait_s(num_queued_tokens),
            compute_s=(num_prompt_tokens - num_cached_tokens) / self.prefill_tokens_per_s,
            load_s=store_load_s,
            replay_s=self.replay_s(num_cached_tokens, has_swa_snapshot),
            local_load_s=self.local_load_s(num_local_tokens),
        )

    def queue_tokens_of(
        self,
        num_prompt_tokens: int,
        num_cached_tokens: int,
        has_swa_snapshot: bool,
        load_s: float = 0.0,
    ) -> int:
        """Tokens a job adds to its prefill worker's queue: what it has to compute, with a
        replay and `load_s` of loads counted in compute-token equivalents."""
        replay_s = self.replay_s(num_cached_tokens, has_swa_snapshot)
        extra_s = replay_s + load_s
        return num_prompt_tokens - num_cached_tokens + round(extra_s * self.prefill_tokens_per_s)

    # -- decode --------------------------------------------------------------------------
    def decode_step_s(self, num_seqs: int, num_context_tokens: int = 0) -> float:
        """One step over `num_seqs` sequences attending `num_context_tokens` in all."""
        if num_seqs == 0:
            return 0.0
        return (
            self.decode_step_base_s
            + self.decode_step_per_seq_s * num_seqs
            + self.decode_step_per_context_token_s * num_context_tokens
        )
