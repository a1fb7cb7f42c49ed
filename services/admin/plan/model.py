"""The capacity and economics model: from `PlanInputs` to the GPUs, servers, revenue, storage
and control-plane load of a deployment, as one pure function (`plan`).

The cluster is sized on steady daily traffic: a day's tokens split into requests of the
average shape, GPUs sized so each role runs at exactly its per-GPU rate, then rounded up
(whole GPUs, whole servers, whole super-nodes) with the headroom on top. Money is integer
micro-CNY throughout; the only floats are rates, GPU loads and display ratios.

What "busy" means: `*_gpus_busy` is the load in GPUs (fractional, every GPU at its rate);
`num_*_gpus` is what is deployed. Revenue per GPU-hour is given over both: over busy GPUs it
is the published CNY 260.64, a figure of the rates and prices alone; over deployed GPUs it
is what the fleet paid for earns, lower by the rounding and the headroom.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from services.admin.plan.inputs import MICRO, PlanInputs

SECONDS_PER_DAY = 86_400
HOURS_PER_DAY = 24


@dataclass(frozen=True)
class Traffic:
    requests_per_day: float
    requests_per_s: float
    input_tokens_per_day: int
    output_tokens_per_day: int
    hit_tokens_per_day: int
    miss_tokens_per_day: int
    input_tokens_per_s: float
    output_tokens_per_s: float
    hit_tokens_per_s: float
    miss_tokens_per_s: float


@dataclass(frozen=True)
class Fleet:
    prefill_tokens_per_s_per_gpu: float  # at the plan's hit rate
    prefill_gpus_busy: float
    decode_gpus_busy: float
    num_prefill_gpus: int  # deployed: busy x (1 + headroom), rounded up
    num_decode_gpus: int
    num_pairs: int  # 1:1 prefill+decode pairs that carry the load: the larger side
    num_gpus: int
    prefill_to_decode_ratio: float | None  # deployed GPUs; None without decode GPUs
    num_prefill_servers: int
    num_decode_super_nodes: dict[int, int]  # super-node size in GPUs -> how many


@dataclass(frozen=True)
class Money:
    hit_revenue_micro_cny_per_day: int
    miss_revenue_micro_cny_per_day: int
    output_revenue_micro_cny_per_day: int
    revenue_micro_cny_per_day: int
    hit_revenue_share: float
    miss_revenue_share: float
    output_revenue_share: float
    revenue_per_busy_gpu_hour_micro_cny: int
    revenue_per_busy_gpu_hour_micro_usd: int
    revenue_per_gpu_hour_micro_cny: int  # over deployed GPUs
    revenue_per_gpu_hour_micro_usd: int
    gpu_cost_micro_cny_per_day: int
    gross_profit_micro_cny_per_day: int
    gross_margin: float | None  # profit / revenue; None without revenue


@dataclass(frozen=True)
class Storage:
    new_kv_tokens_per_day: int  # misses and outputs: the tokens whose KV is written
    ssd_capacity_bytes: int  # the new KV of `retention_days` days
    ssd_write_bytes_per_s: int
    ssd_read_bytes_per_s: int  # hit tokens/s x KV bytes per token x reads per hit token
    ssd_read_bytes_per_s_per_prefill_gpu: int  # a prefill GPU's own loads, at its rate


# A kv-index tier table numbers its rows in 32 bits (services/kv_index/table.py).
MAX_INDEX_ROWS_PER_SHARD = (1 << 32) - 3


@dataclass(frozen=True)
class ControlPlane:
    requests_per_s: float
    blocks_stored_per_s: float  # new KV tokens/s / block size
    blocks_removed_per_s: float  # at steady state every stored block is evicted in time
    kv_events_per_s: float  # block entries in BlocksStored + BlocksRemoved
    # kv-index: every block of the retention, at the index's bytes per block.
    index_blocks_per_day: float  # new KV blocks a day (misses and outputs)
    index_blocks: float  # held over the retention
    index_bytes_per_day_of_retention: int
    index_bytes: int  # all shards, one replica each
    index_blocks_per_shard: float
    index_bytes_per_shard: int  # what each replica of a shard holds
    index_min_shards: int  # the fewest shards whose blocks fit a table's 32-bit row numbers


@dataclass(frozen=True)
class Plan:
    inputs: PlanInputs
    traffic: Traffic
    fleet: Fleet
    money: Money
    storage: Storage
    control_plane: ControlPlane

    def to_dict(self) -> dict[str, Any]:
        """Plain, JSON-ready data: one key per group, the inputs included."""
        return dataclasses.asdict(self)


def plan(inputs: PlanInputs = PlanInputs()) -> Plan:  # noqa: B008 (frozen, so shared safely)
    """The plan of one deployment; the same inputs always give the same plan."""
    traffic = _traffic(inputs)
    fleet = _fleet(inputs, traffic)
    return Plan(
        inputs=inputs,
        traffic=traffic,
        fleet=fleet,
        money=_money(inputs, traffic, fleet),
        storage=_storage(inputs, traffic, fleet),
        control_plane=_control_plane(inputs, traffic),
    )


def _traffic(inputs: PlanInputs) -> Traffic:
    tokens_per_request = inputs.input_tokens_per_request + inputs.output_tokens_per_request
    requests_per_day = inputs.tokens_per_day / tokens_per_request
    input_share = inputs.input_tokens_per_request / tokens_per_request
    input_per_day = round(inputs.tokens_per_day * input_share)
    hit_per_day = round(input_per_day * inputs.hit_rate)
    output_per_day = inputs.tokens_per_day - input_per_day
    miss_per_day = input_per_day - hit_per_day
    return Traffic(
        requests_per_day=requests_per_day,
        requests_per_s=requests_per_day / SECONDS_PER_DAY,
        input_tokens_per_day=input_per_day,
        output_tokens_per_day=output_per_day,
        hit_tokens_per_day=hit_per_day,
        miss_tokens_per_day=miss_per_day,
        input_tokens_per_s=input_per_day / SECONDS_PER_DAY,
        output_tokens_per_s=output_per_day / SECONDS_PER_DAY,
        hit_tokens_per_s=hit_per_day / SECONDS_PER_DAY,
        miss_tokens_per_s=miss_per_day / SECONDS_PER_DAY,
    )


def _fleet(inputs: PlanInputs, traffic: Traffic) -> Fleet:
    prefill_rate = inputs.effective_prefill_tokens_per_s_per_gpu
    prefill_busy = traffic.input_tokens_per_s / prefill_rate
    decode_busy = traffic.output_tokens_per_s / inputs.decode_tokens_per_s_per_gpu
    scale = 1 + inputs.headroom_fraction
    num_prefill = _ceil(prefill_busy * scale)
    num_decode = _ceil(decode_busy * scale)
    return Fleet(
        prefill_tokens_per_s_per_gpu=prefill_rate,
        prefill_gpus_busy=prefill_busy,
        decode_gpus_busy=decode_busy,
        num_prefill_gpus=num_prefill,
        num_decode_gpus=num_decode,
        num_pairs=max(num_prefill, num_decode),
        num_gpus=num_prefill + num_decode,
        prefill_to_decode_ratio=num_prefill / num_decode if num_decode else None,
        num_prefill_servers=-(-num_prefill // inputs.gpus_per_prefill_server),
        num_decode_super_nodes={
            size: -(-num_decode // size) for size in inputs.decode_super_node_gpus
        },
    )


def _money(inputs: PlanInputs, traffic: Traffic, fleet: Fleet) -> Money:
    hit = _div_round(traffic.hit_tokens_per_day * inputs.hit_price_micro_cny_per_mtok, MICRO)
    miss = _div_round(traffic.miss_tokens_per_day * inputs.miss_price_micro_cny_per_mtok, MICRO)
    output = _div_round(
        traffic.output_tokens_per_day * inputs.output_price_micro_cny_per_mtok, MICRO
    )
    total = hit + miss + output
    busy_gpu_hours = (fleet.prefill_gpus_busy + fleet.decode_gpus_busy) * HOURS_PER_DAY
    per_busy_gpu_hour = round(total / busy_gpu_hours)
    per_gpu_hour = _div_round(total, fleet.num_gpus * HOURS_PER_DAY)
    cost = fleet.num_gpus * HOURS_PER_DAY * inputs.gpu_cost_micro_cny_per_hour
    return Money(
        hit_revenue_micro_cny_per_day=hit,
        miss_revenue_micro_cny_per_day=miss,
        output_revenue_micro_cny_per_day=output,
        revenue_micro_cny_per_day=total,
        hit_revenue_share=hit / total if total else 0.0,
        miss_revenue_share=miss / total if total else 0.0,
        output_revenue_share=output / total if total else 0.0,
        revenue_per_busy_gpu_hour_micro_cny=per_busy_gpu_hour,
        revenue_per_busy_gpu_hour_micro_usd=round(per_busy_gpu_hour * inputs.usd_per_cny),
        revenue_per_gpu_hour_micro_cny=per_gpu_hour,
        revenue_per_gpu_hour_micro_usd=round(per_gpu_hour * inputs.usd_per_cny),
        gpu_cost_micro_cny_per_day=cost,
        gross_profit_micro_cny_per_day=total - cost,
        gross_margin=(total - cost) / total if total else None,
    )


def _storage(inputs: PlanInputs, traffic: Traffic, fleet: Fleet) -> Storage:
    kv_bytes = inputs.kv_bytes_per_token
    new_per_day = traffic.miss_tokens_per_day + traffic.output_tokens_per_day
    prefill_reads = traffic.hit_tokens_per_s * kv_bytes
    return Storage(
        new_kv_tokens_per_day=new_per_day,
        ssd_capacity_bytes=round(new_per_day * inputs.retention_days) * kv_bytes,
        ssd_write_bytes_per_s=round(new_per_day * kv_bytes / SECONDS_PER_DAY),
        ssd_read_bytes_per_s=round(prefill_reads * inputs.ssd_reads_per_hit_token),
        ssd_read_bytes_per_s_per_prefill_gpu=round(prefill_reads / fleet.prefill_gpus_busy),
    )


def _control_plane(inputs: PlanInputs, traffic: Traffic) -> ControlPlane:
    new_tokens_per_s = traffic.miss_tokens_per_s + traffic.output_tokens_per_s
    stored = new_tokens_per_s / inputs.block_size_tokens
    new_tokens_per_day = traffic.miss_tokens_per_day + traffic.output_tokens_per_day
    blocks_per_day = new_tokens_per_day / inputs.block_size_tokens
    blocks = blocks_per_day * inputs.retention_days
    index_bytes = math.ceil(blocks * inputs.index_bytes_per_block)
    return ControlPlane(
        requests_per_s=traffic.requests_per_s,
        blocks_stored_per_s=stored,
        blocks_removed_per_s=stored,
        kv_events_per_s=2 * stored,
        index_blocks_per_day=blocks_per_day,
        index_blocks=blocks,
        index_bytes_per_day_of_retention=math.ceil(blocks_per_day * inputs.index_bytes_per_block),
        index_bytes=index_bytes,
        index_blocks_per_shard=blocks / inputs.num_index_shards,
        index_bytes_per_shard=-(-index_bytes // inputs.num_index_shards),
        index_min_shards=max(1, math.ceil(blocks / MAX_INDEX_ROWS_PER_SHARD)),
    )


def _ceil(gpus: float) -> int:
    """Whole GPUs for a load, ignoring float noise: an exact 1,185-GPU load computed as
    1185.0000000000002 must not buy a 1,186th GPU."""
    return math.ceil(gpus * (1 - 1e-12))


def _div_round(numerator: int, denominator: int) -> int:
    """Integer division rounded half up, for non-negative money."""
    return (2 * numerator + denominator) // (2 * denominator)
