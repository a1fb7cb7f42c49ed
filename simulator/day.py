"""A simulated day (`kvfabric simulate --day`): calibrate the fluid model on windows of a
simulated slice, run the day on the plan's fleet, and set it beside `kvfabric plan` (the
reproduction table), the measured limits (limits.py) and the what-ifs.

The fleet is the plan's (its prefill and decode GPUs) and the traffic its mean requests/s
(flat, or the daily curve); the slice is `SimConfig.scaled` at the plan's 1:1 ratio, whose
per-GPU behaviour the fluid model scales up.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from services.admin.plan import Plan, PlanInputs, plan
from simulator.config import SimConfig
from simulator.fluid import (
    CalibrationPoint,
    Day,
    FluidModel,
    calibrate,
    day_plan,
    simulate_day,
    traffic_curve,
)

Progress = Callable[[str], None]


@dataclass(frozen=True)
class DaySettings:
    # The slice: one prefill server of 8 GPUs and 8 decode GPUs (the plan's 1:1).
    num_prefill_servers: int = 1
    num_decode_nodes: int = 1
    decode_node_gpus: int = 8
    # Offered loads of the calibration runs (SimConfig.load); the highest should pass the
    # plan's requests per prefill GPU, or the day holds the served rate there.
    loads: tuple[float, ...] = (0.5, 0.7, 0.9)
    duration_s: float = 40.0
    warmup_s: float = 10.0
    window_s: float = 10.0
    seed: int = 0
    curve: str = "flat"
    step_s: float = 60.0
    overrides: dict = field(default_factory=dict)  # SimConfig fields of the slice

    def slice_config(self, **changes: object) -> SimConfig:
        return SimConfig.scaled(
            self.num_prefill_servers,
            self.num_decode_nodes,
            self.decode_node_gpus,
            duration_s=self.duration_s,
            warmup_s=self.warmup_s,
            window_s=self.window_s,
            seed=self.seed,
            **{**self.overrides, **changes},
        )


def run_fluid_day(
    points: Sequence[CalibrationPoint], the_plan: Plan, curve: str, step_s: float
) -> Day:
    fleet = the_plan.fleet
    rates = traffic_curve(the_plan.traffic.requests_per_s, curve, step_s)
    return simulate_day(
        FluidModel(points),
        rates,
        fleet.num_prefill_gpus,
        fleet.num_decode_gpus,
        the_plan.inputs,
        step_s,
    )


def reproduction(day: Day, the_plan: Plan) -> list[dict]:
    """The plan's figures against the day's, the % difference and why they differ."""
    totals, t, money, fleet = day.totals(), the_plan.traffic, the_plan.money, the_plan.fleet
    ours = day_plan(day, the_plan.inputs)  # the plan's arithmetic on the day's tokens
    seconds = totals["seconds"]
    served_share = totals["served_requests"] / totals["requests"] if totals["requests"] else 0
    revenue = ours.money.revenue_micro_cny_per_day
    prefill_plan = fleet.prefill_gpus_busy / fleet.num_prefill_gpus
    decode_plan = fleet.decode_gpus_busy / fleet.num_decode_gpus
    prompt = totals["input_tokens_per_request"]
    why_tokens = (
        f"prompts average {prompt:,.0f} tokens (the plan: "
        f"{the_plan.inputs.input_tokens_per_request:,.0f}; sessions' lengths, the context "
        f"cap and the lognormal spread set them) and {1 - served_share:.1%} of requests are "
        "refused"
    )
    mix_why = "the token mix (prompt length, hit rate, answer length) at the plan's prices"
    rows = [
        (
            "tokens/day",
            t.input_tokens_per_day + t.output_tokens_per_day,
            totals["tokens"],
            why_tokens,
        ),
        (
            "requests/s served",
            t.requests_per_s,
            totals["served_requests"] / seconds,
            f"the plan's rate is offered; {1 - served_share:.1%} refused at the slice's queues",
        ),
        ("input tokens/request", the_plan.inputs.input_tokens_per_request, prompt, why_tokens),
        (
            "output tokens/request",
            the_plan.inputs.output_tokens_per_request,
            totals["output_tokens_per_request"],
            "lognormal answers, mean 720, capped at max_tokens",
        ),
        (
            "hit rate",
            the_plan.inputs.hit_rate,
            totals["hit_rate"],
            "emerges from sessions re-sending their prefix; the plan assumes 96%",
        ),
        (
            "prefill GPU utilization",
            prefill_plan,
            totals["prefill_util"],
            "the plan sizes GPUs at 100% busy; a queue at 100% refuses (the slice's bound)",
        ),
        (
            "decode GPU utilization",
            decode_plan,
            totals["decode_util"],
            "follows the requests served and their answers' length",
        ),
        (
            "revenue/day, CNY",
            money.revenue_micro_cny_per_day / 1e6,
            revenue / 1e6,
            "the tokens served, at the plan's prices",
        ),
        (
            "revenue per busy GPU-hour, CNY",
            money.revenue_per_busy_gpu_hour_micro_cny / 1e6,
            revenue / 1e6 / totals["busy_gpu_hours"] if totals["busy_gpu_hours"] else 0.0,
            "busy: the simulated utilization x GPUs; the plan's busy GPUs are its own arithmetic",
        ),
        (
            "revenue per deployed GPU-hour, CNY",
            money.revenue_per_gpu_hour_micro_cny / 1e6,
            revenue / 1e6 / totals["gpu_hours"],
            "the plan's fleet in both",
        ),
        ("revenue mix: hit", money.hit_revenue_share, ours.money.hit_revenue_share, mix_why),
        ("revenue mix: miss", money.miss_revenue_share, ours.money.miss_revenue_share, mix_why),
        (
            "revenue mix: output",
            money.output_revenue_share,
            ours.money.output_revenue_share,
            mix_why,
        ),
        (
            "store read, bytes/s",
            the_plan.storage.ssd_read_bytes_per_s,
            totals["store_read_bytes_per_s_mean"],
            "the plan reads every hit from the store; the simulation serves most from node memory",
        ),
    ]
    out = []
    for name, plan_value, sim_value, why in rows:
        diff = (sim_value - plan_value) / plan_value if plan_value else None
        within = diff is not None and abs(diff) <= 0.10
        out.append(
            {
                "figure": name,
                "plan": plan_value,
                "simulated": sim_value,
                "difference": diff,
                "within_10pct": within,
                "why": "" if within else why,
            }
        )
    return out


# -- what-ifs --------------------------------------------------------------------------------
_REF = SimConfig()
EXACT_REPLAY_TOKENS = 2_560  # worker/cost_model.py: exact replay, 20 sliding layers x 128
LOST_DECODE_SHARE = 18 / 19  # one of the reference's 19 decode super-nodes of 64


@dataclass(frozen=True)
class WhatIf:
    name: str
    description: str
    changes: dict | None = None  # SimConfig fields of the slice (None: the baseline's)
    curve: str | None = None  # the day's curve instead of the settings'
    not_modelled: str | None = None  # why it cannot be simulated faithfully yet
    scale_store: float | None = None  # store bandwidth factor (the slice's is scaled)


WHAT_IFS = {
    w.name: w
    for w in (
        WhatIf(
            "hit-90",
            "hit rate 90%",
            not_modelled="the hit rate emerges from the sessions; no input sets it (the "
            "plan's arithmetic at 90% is `kvfabric plan --hit-rate 0.9`)",
        ),
        WhatIf("store-half", "store bandwidth halved", changes={}, scale_store=0.5),
        WhatIf(
            "kv-double",
            "KV bytes per token doubled",
            changes={"kv_bytes_per_token": 2 * _REF.kv_bytes_per_token},
        ),
        WhatIf("swa-ttl-60", "swa-memcache TTL 60 s", changes={"swa_ttl_s": 60.0}),
        WhatIf(
            "replay-off",
            f"bounded replay off ({EXACT_REPLAY_TOKENS:,} tokens replayed without a snapshot)",
            changes={"replay_tokens": EXACT_REPLAY_TOKENS},
        ),
        WhatIf(
            "index-shard-lost",
            "one kv-index shard lost",
            not_modelled="one KvIndex answers for all shards; how the router merges a "
            "missing shard's answer is not simulated",
        ),
        WhatIf(
            "decode-node-lost",
            "one decode super-node lost (18 of 19)",
            changes={
                "decode_tokens_per_s": _REF.decode_tokens_per_s * LOST_DECODE_SHARE,
                "decode_kv_bytes_per_gpu": int(_REF.decode_kv_bytes_per_gpu * LOST_DECODE_SHARE),
            },
        ),
        WhatIf("daily", "daily curve, peak 2x the mean", curve="daily"),
        WhatIf("round-robin", "routing round-robin", changes={"placement": "round-robin"}),
    )
}


def what_if_row(label: str, day: Day, the_plan: Plan) -> dict:
    totals = day.totals()
    revenue = day_plan(day, the_plan.inputs).money.revenue_micro_cny_per_day / 1e6
    return {
        "what_if": label,
        "hit_rate": totals["hit_rate"],
        "ttft_p99_s": float(np.average(day.ttft_p99_s, weights=day.served_per_s + 1e-12)),
        "prefill_util": totals["prefill_util"],
        "decode_util": totals["decode_util"],
        "refused": 1 - totals["served_requests"] / totals["requests"],
        "revenue_per_busy_gpu_hour": revenue / totals["busy_gpu_hours"]
        if totals["busy_gpu_hours"]
        else 0.0,
        "store_read_bytes_per_s": totals["store_read_bytes_per_s_mean"],
        "not_modelled": None,
    }


def run_what_ifs(
    names: Sequence[str],
    settings: DaySettings,
    baseline: Sequence[CalibrationPoint],
    the_plan: Plan,
    progress: Progress | None = None,
) -> list[dict]:
    """A row per what-if beside the baseline's, each calibrated at one load: the baseline
    point nearest the plan's requests per prefill GPU."""
    target = the_plan.traffic.requests_per_s / the_plan.fleet.num_prefill_gpus
    base_point = min(baseline, key=lambda p: abs(p.arrivals_per_s_per_gpu - target))
    rows = [
        what_if_row(
            f"baseline (load {base_point.load:g})", _day([base_point], the_plan, settings), the_plan
        )
    ]
    for name in names:
        what = WHAT_IFS[name]
        if what.not_modelled is not None:
            rows.append({"what_if": what.description, "not_modelled": what.not_modelled})
            continue
        points: Sequence[CalibrationPoint] = [base_point]
        if what.curve is not None:
            points = baseline
        if what.changes is not None:
            changes = dict(what.changes)
            if what.scale_store is not None:
                slice_store = settings.slice_config().store_read_bytes_per_s
                changes["store_read_bytes_per_s"] = slice_store * what.scale_store
            config = settings.slice_config(**changes)
            started = time.perf_counter()
            points = calibrate(config, [base_point.load])
            if progress is not None:
                progress(f"what-if {name}: {time.perf_counter() - started:.1f} s wall")
        day = _day(points, the_plan, settings, what.curve)
        rows.append(what_if_row(what.description, day, the_plan))
    return rows


def _day(
    points: Sequence[CalibrationPoint],
    the_plan: Plan,
    settings: DaySettings,
    curve: str | None = None,
) -> Day:
    return run_fluid_day(points, the_plan, curve or settings.curve, settings.step_s)


def reference_plan() -> Plan:
    return plan(PlanInputs())
