"""The fluid model of a day (`kvfabric simulate --day`): simulated windows calibrate it, a
traffic curve drives it, and it integrates the day's tokens, revenue, GPU-hours and store
reads step by step.

Calibration: a slice of the reference (`SimConfig.scaled`: the same store bandwidth and
capacity per prefill GPU) is simulated at a few offered loads, every request through the
production router policy and kv-index (`simulation.py`). Each run's steady state is one
`CalibrationPoint`: its arrivals per prefill GPU (the x-axis) and what they gave per GPU and
per request (hit rate, utilization, TTFT, refused share, tokens per request, store bytes per
hit token, the share of hits from node memory). A full-scale window is not simulated here (the
router's decision, with the simulator's own node-memory lookups, costs ~0.75 ms at 2,400
workers: docs/simulator.md), so what the fluid model
scales up is the slice's per-GPU behaviour; what only the full fleet shows (kv-index shard
fan-out, NATS fan-in, one table of 2,400 workers) is in the limits table instead.

The day: per step (a minute by default) the traffic curve's rate over the fleet's prefill GPUs
is a load per GPU; the figures are interpolated (linearly) between the calibration points at
that load. Below the lowest point the utilizations fall in proportion to the load (the other
figures are held); above the highest, the served rate per GPU is held at that point's and the
rest is refused (`steps_beyond` counts those steps). Revenue is the plan's prices on the
tokens served; the day's totals go through `services.admin.plan.plan` (its arithmetic, not a
copy).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields

import numpy as np

from services.admin.plan import Plan, PlanInputs, plan
from simulator.config import SimConfig
from simulator.simulation import Simulation

DAY_S = 86_400
# The figures a calibration point carries that the fluid model interpolates, per load.
FIGURES = (
    "hit_rate",
    "local_hit_share",
    "prefill_util",
    "decode_util",
    "ttft_p50_s",
    "ttft_p99_s",
    "refused_share",
    "input_tokens_per_request",
    "output_tokens_per_request",
    "store_bytes_per_hit_token",
    "decisions_per_request",
)
# Figures that scale with the load below the lowest calibrated point (the rest are held).
_UTILIZATIONS = ("prefill_util", "decode_util")


@dataclass(frozen=True)
class CalibrationPoint:
    """The steady state of one simulated slice at one offered load, per GPU and per request."""

    load: float  # the run's offered load (SimConfig.load)
    arrivals_per_s_per_gpu: float  # requests arriving per prefill GPU: the x-axis
    hit_rate: float
    local_hit_share: float  # of the hit tokens, read from the prefill node's own memory
    prefill_util: float
    decode_util: float
    ttft_p50_s: float
    ttft_p99_s: float
    refused_share: float  # of the requests that arrived, refused
    input_tokens_per_request: float  # of the requests routed
    output_tokens_per_request: float
    store_bytes_per_hit_token: float  # store reads over hit tokens: the rest came from memory
    decisions_per_request: float  # routing attempts per request (retries count)
    decisions_per_cpu_s: float  # the production policy + index, measured in the run
    num_requests: int  # routed in the steady state: the sample's size
    # The steady windows' spread (standard deviation across them): the sampling noise.
    hit_rate_sd: float = 0.0
    prefill_util_sd: float = 0.0
    wall_s: float = 0.0

    @classmethod
    def of(cls, sim: Simulation, wall_s: float = 0.0) -> CalibrationPoint:
        config, steady = sim.config, sim.steady()
        if steady is None or steady.num_routed == 0 or steady.num_hit_tokens == 0:
            raise ValueError("the run has no steady state: lengthen duration_s past warmup_s")
        span_s = steady.end_s - steady.start_s
        summary = sim.summarize(steady)
        windows = [
            sim.summarize(w)
            for w in sim.windows.ordered()
            if w.start_s >= config.warmup_s and w.end_s <= config.duration_s + 1e-9
        ]
        arrived = max(steady.num_arrived, 1)
        return cls(
            load=config.load,
            arrivals_per_s_per_gpu=steady.num_arrived / span_s / config.num_prefill_gpus,
            hit_rate=steady.hit_rate,
            local_hit_share=summary["local_hit_share"],
            prefill_util=summary["prefill_util"],
            decode_util=summary["decode_util"],
            ttft_p50_s=summary["ttft_p50_s"] or 0.0,
            ttft_p99_s=summary["ttft_p99_s"] or 0.0,
            refused_share=min(steady.num_refused / arrived, 1.0),
            input_tokens_per_request=steady.num_prompt_tokens / steady.num_routed,
            output_tokens_per_request=steady.num_output_tokens / steady.num_routed,
            store_bytes_per_hit_token=steady.store_read_bytes / steady.num_hit_tokens,
            decisions_per_request=sim.num_decisions / max(sim.ledger.num_issued, 1),
            decisions_per_cpu_s=sim.decisions_per_cpu_s,
            num_requests=steady.num_routed,
            hit_rate_sd=float(np.std([w["hit_rate"] for w in windows])),
            prefill_util_sd=float(np.std([w["prefill_util"] for w in windows])),
            wall_s=wall_s,
        )

    def to_dict(self) -> dict:
        return asdict(self)


def calibrate(
    base: SimConfig,
    loads: Sequence[float],
    progress: Callable[[str], None] | None = None,
) -> list[CalibrationPoint]:
    """Simulate `base` at each offered load; one point per run, by arrivals per GPU."""
    import time

    points = []
    for load in loads:
        started = time.perf_counter()
        sim = Simulation(base.replace(load=load)).run()
        point = CalibrationPoint.of(sim, time.perf_counter() - started)
        points.append(point)
        if progress is not None:
            progress(
                f"calibrated load {load:g}: {point.arrivals_per_s_per_gpu:.2f} requests/s per "
                f"GPU, hit {point.hit_rate:.1%}, prefill {point.prefill_util:.1%}, "
                f"{point.wall_s:.1f} s wall"
            )
    return sorted(points, key=lambda p: p.arrivals_per_s_per_gpu)


class FluidModel:
    """The calibrated figures as functions of arrivals per prefill GPU."""

    def __init__(self, points: Sequence[CalibrationPoint]) -> None:
        if not points:
            raise ValueError("the fluid model needs at least one calibration point")
        self.points = sorted(points, key=lambda p: p.arrivals_per_s_per_gpu)
        self.x = np.array([p.arrivals_per_s_per_gpu for p in self.points])
        self.table = {name: np.array([getattr(p, name) for p in self.points]) for name in FIGURES}

    @property
    def max_served_per_gpu(self) -> float:
        top = self.points[-1]
        return top.arrivals_per_s_per_gpu * (1 - top.refused_share)

    def at(self, arrivals_per_s_per_gpu: float | np.ndarray) -> dict[str, np.ndarray]:
        """Every figure at these loads, and `served_share` (of the arrivals) and `beyond`
        (whether the load is past the highest calibrated one)."""
        x = np.atleast_1d(np.asarray(arrivals_per_s_per_gpu, dtype=float))
        low, high = self.x[0], self.x[-1]
        out = {name: np.interp(x, self.x, values) for name, values in self.table.items()}
        below = x < low
        for name in _UTILIZATIONS:
            out[name] = np.where(below, out[name] * x / low, out[name])
        served = 1 - out["refused_share"]
        beyond = x > high * (1 + 1e-9)
        with np.errstate(divide="ignore", invalid="ignore"):
            held = np.where(x > 0, self.max_served_per_gpu / x, 1.0)
        out["served_share"] = np.where(beyond, np.minimum(held, 1.0), served)
        out["refused_share"] = 1 - out["served_share"]
        out["beyond"] = beyond
        return out

    def leave_one_out(self) -> list[dict]:
        """Each point against the model of the others: the sampling error (needs 2+ points;
        an end point is extrapolated as the model would: held or saturated)."""
        rows = []
        if len(self.points) < 2:
            return rows
        for i, point in enumerate(self.points):
            others = FluidModel([p for j, p in enumerate(self.points) if j != i])
            predicted = others.at(point.arrivals_per_s_per_gpu)
            row = {"arrivals_per_s_per_gpu": point.arrivals_per_s_per_gpu, "load": point.load}
            for name in ("hit_rate", "prefill_util", "decode_util", "ttft_p99_s"):
                measured, guess = getattr(point, name), float(predicted[name][0])
                row[name] = {
                    "measured": measured,
                    "predicted": guess,
                    "error": (guess - measured) / measured if measured else None,
                }
            row["hit_rate_sd"] = point.hit_rate_sd
            row["prefill_util_sd"] = point.prefill_util_sd
            rows.append(row)
        return rows


def traffic_curve(mean_per_s: float, curve: str = "flat", step_s: float = 60.0) -> np.ndarray:
    """Requests/s per step of a day. `flat`: the mean all day. `daily`: a smooth day (two
    harmonics) whose mean is `mean_per_s` and whose peak, at 14:00, is twice it (its trough,
    at ~03:00, is ~0.47x)."""
    steps = round(DAY_S / step_s)
    if curve == "flat":
        return np.full(steps, float(mean_per_s))
    if curve != "daily":
        raise ValueError(f"curve must be flat or daily, got {curve!r}")
    t = (np.arange(steps) + 0.5) * step_s
    theta = 2 * math.pi * (t - 14 * 3600) / DAY_S
    shape = 1 + 0.75 * np.cos(theta) + 0.25 * np.cos(2 * theta)
    return mean_per_s * shape / shape.mean()


@dataclass(frozen=True)
class Day:
    """A day of the fluid model: per-step series and the day's totals."""

    step_s: float
    num_prefill_gpus: int
    num_decode_gpus: int
    arrivals_per_s: np.ndarray  # the curve
    served_per_s: np.ndarray
    hit_tokens_per_s: np.ndarray
    miss_tokens_per_s: np.ndarray
    output_tokens_per_s: np.ndarray
    prefill_util: np.ndarray
    decode_util: np.ndarray
    ttft_p50_s: np.ndarray
    ttft_p99_s: np.ndarray
    store_read_bytes_per_s: np.ndarray  # what the hits not served from node memory read
    revenue_micro_cny_per_s: np.ndarray  # the plan's prices on the tokens served
    decisions_per_s: np.ndarray
    steps_beyond: int  # steps past the highest calibrated load

    def total(self, series: np.ndarray) -> float:
        return float(series.sum() * self.step_s)

    @property
    def hours(self) -> np.ndarray:
        return (np.arange(len(self.arrivals_per_s)) + 0.5) * self.step_s / 3600

    def totals(self) -> dict:
        hit, miss = self.total(self.hit_tokens_per_s), self.total(self.miss_tokens_per_s)
        output = self.total(self.output_tokens_per_s)
        seconds = len(self.arrivals_per_s) * self.step_s
        prefill_busy_h = self.total(self.prefill_util) * self.num_prefill_gpus / 3600
        decode_busy_h = self.total(self.decode_util) * self.num_decode_gpus / 3600
        served = self.total(self.served_per_s)
        return {
            "seconds": seconds,
            "requests": self.total(self.arrivals_per_s),
            "served_requests": served,
            "hit_tokens": hit,
            "miss_tokens": miss,
            "output_tokens": output,
            "tokens": hit + miss + output,
            "hit_rate": hit / (hit + miss) if hit + miss else 0.0,
            "input_tokens_per_request": (hit + miss) / served if served else 0.0,
            "output_tokens_per_request": output / served if served else 0.0,
            "prefill_util": prefill_busy_h * 3600 / (self.num_prefill_gpus * seconds),
            "decode_util": decode_busy_h * 3600 / (self.num_decode_gpus * seconds),
            "busy_gpu_hours": prefill_busy_h + decode_busy_h,
            "gpu_hours": (self.num_prefill_gpus + self.num_decode_gpus) * seconds / 3600,
            "revenue_micro_cny": self.total(self.revenue_micro_cny_per_s),
            "store_read_bytes_per_s_mean": self.total(self.store_read_bytes_per_s) / seconds,
            "store_read_bytes_per_s_peak": float(self.store_read_bytes_per_s.max()),
            "ttft_p99_s_max": float(self.ttft_p99_s.max()),
            "steps_beyond": self.steps_beyond,
        }


def simulate_day(
    model: FluidModel,
    arrivals_per_s: np.ndarray,
    num_prefill_gpus: int,
    num_decode_gpus: int,
    inputs: PlanInputs,
    step_s: float = 60.0,
) -> Day:
    """Integrate the model over the curve (requests/s per step of `step_s`) on a fleet of
    this many GPUs; `inputs` gives the prices. Store reads are the calibrated bytes per hit
    token (the slice's KV bytes per token and node-memory share) times the hits."""
    f = model.at(arrivals_per_s / num_prefill_gpus)
    served = arrivals_per_s * f["served_share"]
    input_per_s = served * f["input_tokens_per_request"]
    hit = input_per_s * f["hit_rate"]
    miss = input_per_s - hit
    output = served * f["output_tokens_per_request"]
    revenue = (
        hit * inputs.hit_price_micro_cny_per_mtok
        + miss * inputs.miss_price_micro_cny_per_mtok
        + output * inputs.output_price_micro_cny_per_mtok
    ) / 1_000_000
    return Day(
        step_s=step_s,
        num_prefill_gpus=num_prefill_gpus,
        num_decode_gpus=num_decode_gpus,
        arrivals_per_s=np.asarray(arrivals_per_s, dtype=float),
        served_per_s=served,
        hit_tokens_per_s=hit,
        miss_tokens_per_s=miss,
        output_tokens_per_s=output,
        prefill_util=np.minimum(f["prefill_util"], 1.0),
        decode_util=np.minimum(f["decode_util"], 1.0),
        ttft_p50_s=f["ttft_p50_s"],
        ttft_p99_s=f["ttft_p99_s"],
        store_read_bytes_per_s=hit * f["store_bytes_per_hit_token"],
        revenue_micro_cny_per_s=revenue,
        decisions_per_s=arrivals_per_s * f["decisions_per_request"],
        steps_beyond=int(f["beyond"].sum()),
    )


def day_plan(day: Day, inputs: PlanInputs) -> Plan:
    """The plan's arithmetic on the day's own token counts and hit rate (its money)."""
    totals = day.totals()
    served = totals["served_requests"]
    changes = {
        "tokens_per_day": round(totals["tokens"] * DAY_S / totals["seconds"]),
        "input_tokens_per_request": totals["input_tokens_per_request"],
        "output_tokens_per_request": totals["output_tokens_per_request"],
        "hit_rate": min(totals["hit_rate"], 0.999999),
    }
    if not served:
        raise ValueError("the day served nothing")
    names = {f.name for f in fields(PlanInputs)}
    return plan(PlanInputs(**{**{n: getattr(inputs, n) for n in names}, **changes}))
