"""The day (simulator/fluid.py, day.py, limits.py): the fluid model reproduces its windows,
the day's totals are its rate x time, its revenue is the plan's arithmetic, headroom is
capacity / demand, and the what-ifs change what they say they change."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import pytest
from typer.testing import CliRunner

from loadtest.results import BenchResult
from services.admin.cli import app
from services.admin.plan import PlanInputs, plan
from simulator import SimConfig, Simulation
from simulator.day import WHAT_IFS, DaySettings, reproduction, run_fluid_day, run_what_ifs
from simulator.fluid import (
    DAY_S,
    CalibrationPoint,
    FluidModel,
    calibrate,
    day_plan,
    simulate_day,
    traffic_curve,
)
from simulator.limits import MEASURED, limits, measured_capacities
from tests.unit.simulator.test_simulation import WORKLOAD

PLAN = plan(PlanInputs())


def point(x: float, **changes: float) -> CalibrationPoint:
    """A synthetic window whose figures are linear in its load."""
    fields = {
        "load": x / 20,
        "arrivals_per_s_per_gpu": x,
        "hit_rate": 0.90 + 0.002 * x,
        "local_hit_share": 0.9,
        "prefill_util": 0.04 * x,
        "decode_util": 0.035 * x,
        "ttft_p50_s": 0.01 * x,
        "ttft_p99_s": 0.1 * x,
        "refused_share": 0.0,
        "input_tokens_per_request": 60_000.0 + 100 * x,
        "output_tokens_per_request": 700.0,
        "store_bytes_per_hit_token": 600.0,
        "decisions_per_request": 1.0 + 0.1 * x,
        "decisions_per_cpu_s": 1_000.0,
        "num_requests": 1_000,
        **changes,
    }
    return CalibrationPoint(**fields)


POINTS = [point(5.0), point(10.0), point(20.0, refused_share=0.1)]


def flat_day(model: FluidModel, per_gpu: float, gpus: int = 100):
    rates = traffic_curve(per_gpu * gpus, "flat", 600.0)
    return simulate_day(model, rates, gpus, gpus, PlanInputs(), 600.0)


def test_a_flat_day_at_a_window_reproduces_it() -> None:
    model = FluidModel(POINTS)
    for p in POINTS:
        totals = flat_day(model, p.arrivals_per_s_per_gpu).totals()
        assert totals["hit_rate"] == pytest.approx(p.hit_rate)
        assert totals["prefill_util"] == pytest.approx(p.prefill_util)
        assert totals["decode_util"] == pytest.approx(p.decode_util)
        assert totals["served_requests"] / totals["requests"] == pytest.approx(1 - p.refused_share)
        assert totals["input_tokens_per_request"] == pytest.approx(p.input_tokens_per_request)


def test_the_days_tokens_are_its_rate_times_a_day() -> None:
    model, gpus, per_gpu = FluidModel(POINTS), 100, 10.0
    totals = flat_day(model, per_gpu, gpus).totals()
    requests = per_gpu * gpus * DAY_S
    assert totals["seconds"] == DAY_S
    assert totals["requests"] == pytest.approx(requests)
    p = POINTS[1]
    assert totals["hit_tokens"] + totals["miss_tokens"] == pytest.approx(
        requests * p.input_tokens_per_request
    )
    assert totals["output_tokens"] == pytest.approx(requests * p.output_tokens_per_request)


def test_revenue_is_the_plans_arithmetic_on_the_days_tokens() -> None:
    day = flat_day(FluidModel(POINTS), 12.0)
    totals = day.totals()
    money = day_plan(day, PlanInputs()).money
    assert totals["revenue_micro_cny"] == pytest.approx(money.revenue_micro_cny_per_day, rel=1e-6)
    inputs = PlanInputs()
    assert money.hit_revenue_micro_cny_per_day == pytest.approx(
        totals["hit_tokens"] * inputs.hit_price_micro_cny_per_mtok / 1e6, rel=1e-6
    )
    assert money.output_revenue_micro_cny_per_day == pytest.approx(
        totals["output_tokens"] * inputs.output_price_micro_cny_per_mtok / 1e6, rel=1e-6
    )


def test_past_the_highest_window_the_served_rate_is_held() -> None:
    model = FluidModel(POINTS)
    top = POINTS[-1]
    held = top.arrivals_per_s_per_gpu * (1 - top.refused_share)
    figures = model.at(np.array([40.0]))
    assert figures["beyond"][0]
    assert 40.0 * figures["served_share"][0] == pytest.approx(held)
    below = model.at(np.array([2.5]))
    assert below["prefill_util"][0] == pytest.approx(POINTS[0].prefill_util / 2)


def test_leave_one_out_of_a_line_is_exact_inside() -> None:
    rows = FluidModel([point(5.0), point(10.0), point(15.0)]).leave_one_out()
    middle = rows[1]
    assert middle["hit_rate"]["error"] == pytest.approx(0.0, abs=1e-12)
    assert middle["prefill_util"]["error"] == pytest.approx(0.0, abs=1e-12)
    assert rows[2]["prefill_util"]["error"] != pytest.approx(0.0)  # held, not extrapolated


def test_the_daily_curve_keeps_the_mean_and_peaks_at_twice_it() -> None:
    rates = traffic_curve(1_000.0, "daily", 60.0)
    assert len(rates) == 1_440
    assert rates.mean() == pytest.approx(1_000.0)
    assert rates.max() == pytest.approx(2_000.0, rel=1e-3)
    assert 0 < rates.min() < 1_000.0
    with pytest.raises(ValueError):
        traffic_curve(1.0, "weekly")


def test_headroom_is_capacity_over_demand() -> None:
    day = run_fluid_day(POINTS, PLAN, "flat", 600.0)
    rows = limits(day, PLAN, SimConfig(), 1_500.0)
    assert rows
    for row in rows:
        assert row.demand > 0
        if row.capacity is None:
            assert row.headroom is None
            continue
        assert row.headroom == pytest.approx(row.capacity / row.demand)
        assert row.instances == max(1, math.ceil(row.demand / row.capacity))
    ledger = next(r for r in rows if r.part.startswith("ledger, sqlite"))
    assert ledger.capacity == MEASURED.ledger_sqlite_records_per_s
    assert ledger.demand == pytest.approx(day.totals()["served_requests"] / DAY_S)


def test_a_bench_result_replaces_the_recorded_capacity(tmp_path) -> None:
    result = BenchResult("ledger")
    result.figure("sqlite: records/s into the ledger per billing process", 1_234.0, "records/s")
    path = tmp_path / "ledger.json"
    result.write_json(path)
    capacities = measured_capacities([path])
    assert capacities.ledger_sqlite_records_per_s == 1_234.0
    assert capacities.bus_events_per_s == MEASURED.bus_events_per_s
    assert str(path) in capacities.source


def test_the_reproduction_compares_with_the_plan() -> None:
    day = run_fluid_day(POINTS, PLAN, "flat", 600.0)
    rows = {r["figure"]: r for r in reproduction(day, PLAN)}
    assert rows["requests/s served"]["plan"] == pytest.approx(PLAN.traffic.requests_per_s)
    assert rows["hit rate"]["plan"] == 0.96
    for row in rows.values():
        if row["difference"] is not None:
            assert row["difference"] == pytest.approx(row["simulated"] / row["plan"] - 1)
        assert row["within_10pct"] or row["why"]


# -- calibrated on the real simulation (tiny: a second or two each) ----------------------------
def tiny_settings(**changes: object) -> DaySettings:
    fields = {
        "decode_node_gpus": 4,
        "loads": (0.3,),
        "duration_s": 12.0,
        "warmup_s": 4.0,
        "window_s": 4.0,
        "overrides": {"gpus_per_prefill_server": 4, "workload": WORKLOAD},
        **changes,
    }
    return DaySettings(**fields)


def test_a_calibration_point_is_its_runs_steady_state() -> None:
    config = tiny_settings().slice_config(load=0.3)
    sim = Simulation(config).run()
    p = CalibrationPoint.of(sim)
    steady = sim.steady()
    assert steady is not None
    assert p.hit_rate == steady.hit_rate
    assert p.arrivals_per_s_per_gpu == pytest.approx(steady.num_arrived / 8.0 / 4)
    assert 0 < p.local_hit_share <= 1
    assert p.store_bytes_per_hit_token == pytest.approx(
        steady.store_read_bytes / steady.num_hit_tokens
    )
    # Store bytes per hit token are the KV bytes of the hits not in node memory.
    store_share = p.store_bytes_per_hit_token / config.kv_bytes_per_token
    assert store_share == pytest.approx(1 - p.local_hit_share, abs=0.02)


def test_halving_the_store_bandwidth_does_not_raise_the_hits() -> None:
    settings = tiny_settings()
    base = calibrate(settings.slice_config(), [0.3])[0]
    half_store = settings.slice_config().store_read_bytes_per_s / 2
    half = calibrate(settings.slice_config(store_read_bytes_per_s=half_store), [0.3])[0]
    assert half.hit_rate <= base.hit_rate + 0.01
    assert half.store_bytes_per_hit_token <= base.store_bytes_per_hit_token * 1.05 + 1


def test_what_ifs_give_a_row_each_and_say_what_is_not_modelled() -> None:
    settings = tiny_settings()
    baseline = calibrate(settings.slice_config(), [0.3])
    names = ["hit-90", "swa-ttl-60", "daily", "index-shard-lost"]
    rows = run_what_ifs(names, settings, baseline, PLAN)
    assert len(rows) == len(names) + 1
    by_name = {r["what_if"]: r for r in rows}
    assert by_name[WHAT_IFS["hit-90"].description]["not_modelled"]
    assert by_name[WHAT_IFS["index-shard-lost"].description]["not_modelled"]
    daily = by_name[WHAT_IFS["daily"].description]
    assert daily["not_modelled"] is None and 0 < daily["hit_rate"] < 1


def test_round_robin_reaches_the_policy() -> None:
    config = tiny_settings().slice_config(load=0.3, placement="round-robin")
    sim = Simulation(config).run()
    assert sim.policy.config.placement == "round-robin"
    assert replace(config, placement="kv").placement == "kv"


def test_day_command_prints_a_json_document() -> None:
    args = [
        "simulate",
        "--day",
        "--gpus-per-prefill-server",
        "4",
        "--decode-node-gpus",
        "4",
        "--loads",
        "0.3",
        "--calibration-duration",
        "6",
        "--calibration-warmup",
        "3",
        "--window",
        "3",
        "--json",
    ]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    assert {"calibration", "sampling_error", "day", "reproduction", "limits"} <= set(document)
    assert document["fleet"]["num_prefill_gpus"] == PLAN.fleet.num_prefill_gpus
    assert document["day"]["requests"] == pytest.approx(PLAN.traffic.requests_per_s * DAY_S)


def test_an_unknown_what_if_is_a_usage_error() -> None:
    result = CliRunner().invoke(app, ["simulate", "--day", "--what-if", "nope"])
    assert result.exit_code == 2
