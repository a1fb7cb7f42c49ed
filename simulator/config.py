"""Every size of a simulated cluster, its engines and its workload, in one frozen value.

The defaults are the reference deployment (docs/design.md, 'The reference deployment'):
~150 prefill servers of 8 GPUs and ~19 decode super-nodes of 64 GPUs, a 100 PiB store read at
10 TiB/s, and the published per-GPU rates. `SimConfig.small()` is a cluster that simulates a
minute in seconds on one CPU.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from worker.cost_model import KV_BYTES_PER_TOKEN, LOAD_TOKENS_PER_S, PREFILL_TOKENS_PER_S

TIB = 1 << 40
PIB = 1 << 50
# A prefill GPU serves 1.5M prompt tokens/s at the reference's 96% hit: the rate the
# reference request rate per prefill GPU is derived from (`SimConfig.reference_rate_per_s`).
PREFILL_SERVED_TOKENS_PER_S = 1_500_000.0
REFERENCE_PREFILL_GPUS = 1_200  # 150 servers x 8: the store's bandwidth is shared by them


@dataclass(frozen=True)
class WorkloadConfig:
    """Agent sessions: their shape only. No hit rate here: it comes from the store."""

    num_system_prompts: int = 16  # agent products: sessions of one share its system prompt
    system_prompt_tokens: int = 8_000
    first_context_tokens_mean: float = 20_000.0  # the session's own first message (repo, task)
    steps_mean: float = 17.0  # requests per session, geometric
    output_tokens_mean: float = 720.0  # coding answers (the plan's 718.67)
    tool_tokens_mean: float = 2_300.0  # a tool's result appended before the next step
    think_time_mean_s: float = 4.0  # the tool's run between an answer and the next step
    sigma: float = 1.0  # lognormal spread of each length and time
    max_output_tokens: int = 8_192
    max_tool_tokens: int = 32_768
    max_context_tokens: int = 200_000  # a session that would pass it ends
    vocab_size: int = 1 << 17  # synthetic token ids are drawn below this


@dataclass(frozen=True)
class SimConfig:
    # -- the cluster's shape
    num_prefill_servers: int = 150
    gpus_per_prefill_server: int = 8
    num_decode_nodes: int = 19
    gpus_per_decode_node: int = 64
    host_tier_bytes_per_node: int = TIB  # each prefill server's DRAM tier
    store_bytes: int = 100 * PIB
    store_read_bytes_per_s: float = 10.0 * TIB
    decode_kv_bytes_per_gpu: int = 40 << 30  # HBM left for KV pages
    # -- engine timing (per GPU)
    prefill_tokens_per_s: float = PREFILL_TOKENS_PER_S  # recomputed tokens
    load_tokens_per_s: float = LOAD_TOKENS_PER_S  # hit tokens read into one GPU
    host_load_bytes_per_s: float = 25e9  # a node's DRAM into one GPU
    decode_tokens_per_s: float = 14_000.0  # a decode GPU's whole batch
    user_tokens_per_s: float = 300.0  # one sequence, while its GPU has room
    kv_bytes_per_token: int = KV_BYTES_PER_TOKEN
    block_size_tokens: int = 64
    replay_tokens: int = 128  # bounded replay without the window's snapshot
    swa_ttl_s: float = 180.0  # swa-memcache keeps a window this long
    # -- the router, as configured in production (services/router/config.py's defaults)
    ttft_objective_s: float | None = 2.0
    max_queued_tokens: int = 240_000
    heartbeat_s: float = 1.0
    client_wait_s: float = 30.0  # shared.client waits out OVERLOADED this long in all
    # A retry's own round trip (ingress, router): the least a retry-after costs. Without it a
    # retry-after of microseconds (a queue just over its bound) retries thousands of times
    # against the same table between two heartbeats.
    client_min_retry_s: float = 0.05
    evict_interval_s: float = 10.0  # how often kv-index's eviction sweep runs
    # The router's placement (services.router.policy.PLACEMENTS): kv | least-loaded |
    # round-robin; the last two ignore the cache (the what-if `round-robin`).
    placement: str = "kv"
    # -- the run
    load: float = 0.7  # offered requests / the reference rate of this many prefill GPUs
    duration_s: float = 60.0  # arrivals stop here; what is in flight then runs to its end
    # Windows before this are the cold start (the cluster begins empty, its sessions new):
    # shown, but left out of the steady-state figures.
    warmup_s: float = 0.0
    # Start with the sessions a steady flow has live (in progress, their caches cold), so
    # the rate and prompt lengths are steady from the start; False: only new sessions.
    start_in_progress: bool = True
    window_s: float = 10.0
    seed: int = 0
    model: str = "deepseek-v4.1-flash"
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)

    def __post_init__(self) -> None:
        for name in (
            "num_prefill_servers",
            "gpus_per_prefill_server",
            "num_decode_nodes",
            "gpus_per_decode_node",
            "block_size_tokens",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("load", "duration_s", "window_s", "heartbeat_s", "store_read_bytes_per_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")

    @classmethod
    def scaled(
        cls,
        num_prefill_servers: int,
        num_decode_nodes: int,
        gpus_per_decode_node: int,
        **overrides: object,
    ) -> SimConfig:
        """A cluster of this shape whose store is the reference's, shrunk with its prefill
        GPUs (the same bandwidth and capacity per GPU)."""
        shape = cls(
            num_prefill_servers=num_prefill_servers,
            num_decode_nodes=num_decode_nodes,
            gpus_per_decode_node=gpus_per_decode_node,
            **overrides,  # type: ignore[arg-type]
        )
        share = shape.num_prefill_gpus / REFERENCE_PREFILL_GPUS
        store = {
            "store_read_bytes_per_s": cls.store_read_bytes_per_s * share,
            "store_bytes": int(cls.store_bytes * share),
        }
        return shape.replace(**{**store, **overrides})

    @classmethod
    def small(cls, **overrides: object) -> SimConfig:
        """One prefill server and one 8-GPU decode node: minutes simulated in seconds."""
        return cls.scaled(1, 1, 8, **overrides)

    def replace(self, **changes: object) -> SimConfig:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    @property
    def num_prefill_gpus(self) -> int:
        return self.num_prefill_servers * self.gpus_per_prefill_server

    @property
    def num_decode_gpus(self) -> int:
        return self.num_decode_nodes * self.gpus_per_decode_node

    @property
    def block_bytes(self) -> int:
        return self.kv_bytes_per_token * self.block_size_tokens

    @property
    def decode_pages_per_gpu(self) -> int:
        return self.decode_kv_bytes_per_gpu // self.block_bytes

    @property
    def seqs_at_full_speed(self) -> float:
        """Sequences a decode GPU runs at `user_tokens_per_s` each; more share its rate."""
        return self.decode_tokens_per_s / self.user_tokens_per_s

    def reference_rate_per_s(self, mean_input_tokens: float) -> float:
        """Requests/s the reference figures give this many prefill GPUs (1.5M prompt
        tokens/s each at 96% hit): the plan's flat rate at full utilization."""
        return self.num_prefill_gpus * PREFILL_SERVED_TOKENS_PER_S / mean_input_tokens
