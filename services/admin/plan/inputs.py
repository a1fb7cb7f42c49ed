"""What a capacity plan starts from: the traffic, the per-GPU rates, the prices and the
shape of the hardware. The defaults are the reference deployment (docs/design.md, 'The
reference deployment': DeepSeek V4.1 Flash, one cluster, 155T tokens/day), so `PlanInputs()`
reproduces its published figures; every field carries its unit in its name.

Three defaults are derived rather than published, and say how:

- output tokens per request: the figures imply one, because CNY 260.64 per GPU-hour and the
  19.9 / 41.4 / 38.7 % mix are exactly one prefill GPU (1.5M input tokens/s at 96 % hit:
  CNY 0.0888/s) plus one decode GPU (14K output tokens/s: CNY 0.056/s) both busy, i.e. a
  P:D ratio of exactly 1:1. That holds when a request's output is its input times
  14K / 1.5M: 77,000 x 14,000 / 1,500,000 = 718.67 tokens.
- KV bytes per token: the published 10 TiB/s aggregate SSD read over the ~1.71B hit tokens/s
  the traffic implies is 6.4 KB per token; 6 KiB (a 64-token block is a 384 KiB slot) is the
  default. Cross-check against the other storage figure: the ~7.58T new tokens/day (misses
  plus outputs) at 6 KiB fill 100 PiB in 2.4 days, the "day-scale" retention of
  docs/design.md, 'KV tiers'; the default retention, 2 days, needs 83 PiB and leaves the
  rest to the eviction high-watermark.
- GPU cost: an assumption, not a quote. CNY 14 per GPU-hour is ~USD 2, the H800 rental
  price DeepSeek assumed in its own published inference-system cost analysis (Feb 2025).

The kv-index's memory is sized from a measured figure: bytes per indexed block is what
loadtest/bench_kv_index.py measures at 10M blocks (tracemalloc, the C row index), and the
index holds every block of the retention (what the SSD tier holds). The shard count is an
assumption; the plan also says how few shards the index's 32-bit row numbers allow.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

REFERENCE_INPUT_TOKENS_PER_REQUEST = 77_000.0
REFERENCE_PREFILL_TOKENS_PER_S_PER_GPU = 1_500_000.0
REFERENCE_DECODE_TOKENS_PER_S_PER_GPU = 14_000.0
REFERENCE_HIT_RATE = 0.96
# kv-index memory per indexed block, measured by loadtest/bench_kv_index.py at 10M blocks.
MEASURED_INDEX_BYTES_PER_BLOCK = 30.0
# The output per request at which prefill and decode GPUs balance 1:1 (module docstring).
REFERENCE_OUTPUT_TOKENS_PER_REQUEST = (
    REFERENCE_INPUT_TOKENS_PER_REQUEST
    * REFERENCE_DECODE_TOKENS_PER_S_PER_GPU
    / REFERENCE_PREFILL_TOKENS_PER_S_PER_GPU
)
MICRO = 1_000_000  # micro-CNY per CNY; also tokens per million tokens


class PlanError(ValueError):
    """An input out of its range; `field` names the PlanInputs field at fault."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True)
class PlanInputs:
    """One deployment's assumptions. Money is integer micro-CNY; rates are per GPU."""

    tokens_per_day: int = 155 * 10**12  # input + output
    input_tokens_per_request: float = REFERENCE_INPUT_TOKENS_PER_REQUEST
    output_tokens_per_request: float = REFERENCE_OUTPUT_TOKENS_PER_REQUEST
    hit_rate: float = REFERENCE_HIT_RATE  # fraction of input tokens served from the KV store
    prefill_tokens_per_s_per_gpu: float = REFERENCE_PREFILL_TOKENS_PER_S_PER_GPU
    # The hit rate the prefill rate above was measured at. A prefill GPU is compute-bound on
    # its misses (1.5M at 96 % is 60K miss tokens/s, the no-cache rate; loading the
    # hits overlaps with compute, see worker/cost_model.py), so at another hit rate it serves
    # 60K / (1 - hit_rate) input tokens/s. Set it equal to hit_rate to take the rate as is.
    prefill_rate_hit_rate: float = REFERENCE_HIT_RATE
    decode_tokens_per_s_per_gpu: float = REFERENCE_DECODE_TOKENS_PER_S_PER_GPU
    hit_price_micro_cny_per_mtok: int = 20_000  # CNY 0.02 per 1M cache-hit input tokens
    miss_price_micro_cny_per_mtok: int = 1_000_000  # CNY 1
    output_price_micro_cny_per_mtok: int = 4_000_000  # CNY 4
    gpu_cost_micro_cny_per_hour: int = 14_000_000  # an assumption (module docstring)
    headroom_fraction: float = 0.0  # extra GPUs over the load; 0.01-0.27: "2,400-3,000"
    kv_bytes_per_token: int = 6_144  # full-attention layers only (module docstring)
    retention_days: float = 2.0
    # SSD reads per hit token: 1 matches the published 10 TiB/s. Decode loads the prefix as
    # well (docs/design.md, 'One request, end to end'); where host DRAM does not absorb that
    # read, it is 2.
    ssd_reads_per_hit_token: int = 1
    block_size_tokens: int = 64
    index_bytes_per_block: float = MEASURED_INDEX_BYTES_PER_BLOCK  # kv-index RAM per block
    num_index_shards: int = 64  # kv-index shards (hash-partitioned), each replica a full copy
    gpus_per_prefill_server: int = 8
    decode_super_node_gpus: tuple[int, ...] = (64, 128)
    usd_per_cny: float = 0.145  # ~6.9 CNY per USD: the rate at which CNY 260.64 is ~USD 38

    def __post_init__(self) -> None:
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise PlanError(name, f"must be an integer, got {value!r}")
        for name in _POSITIVE:
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise PlanError(name, f"must be > 0, got {value}")
        for name in _NON_NEGATIVE:
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise PlanError(name, f"must be >= 0, got {value}")
        for name in ("hit_rate", "prefill_rate_hit_rate"):
            if not 0 <= getattr(self, name) < 1:
                raise PlanError(name, f"must be in [0, 1), got {getattr(self, name)}")
        sizes = self.decode_super_node_gpus
        if not sizes or any(isinstance(s, bool) or not isinstance(s, int) or s <= 0 for s in sizes):
            raise PlanError("decode_super_node_gpus", f"must be positive integers, got {sizes}")

    @property
    def prefill_miss_tokens_per_s_per_gpu(self) -> float:
        """What one prefill GPU computes, the rate that does not depend on the hit rate."""
        return self.prefill_tokens_per_s_per_gpu * (1 - self.prefill_rate_hit_rate)

    @property
    def effective_prefill_tokens_per_s_per_gpu(self) -> float:
        """Input tokens/s one prefill GPU serves at `hit_rate`."""
        return self.prefill_miss_tokens_per_s_per_gpu / (1 - self.hit_rate)


_INT_FIELDS = tuple(f.name for f in fields(PlanInputs) if f.type == "int")
_POSITIVE = (
    "tokens_per_day",
    "input_tokens_per_request",
    "prefill_tokens_per_s_per_gpu",
    "decode_tokens_per_s_per_gpu",
    "kv_bytes_per_token",
    "retention_days",
    "ssd_reads_per_hit_token",
    "block_size_tokens",
    "index_bytes_per_block",
    "num_index_shards",
    "gpus_per_prefill_server",
    "usd_per_cny",
)
_NON_NEGATIVE = (
    "output_tokens_per_request",
    "hit_price_micro_cny_per_mtok",
    "miss_price_micro_cny_per_mtok",
    "output_price_micro_cny_per_mtok",
    "gpu_cost_micro_cny_per_hour",
    "headroom_fraction",
)
