"""The reference deployment's per-GPU figures (DESIGN.md sections 5 and 6), in one place:
the router's cost model starts from them and the mock engine simulates with them."""

from __future__ import annotations

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
