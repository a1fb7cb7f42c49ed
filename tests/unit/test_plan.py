"""`services.admin.plan` and `kvfabric plan`: the reference deployment's published figures
(docs/design.md, 'The reference deployment'), how the plan moves with its inputs, the
rounding, and the command's output and errors."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
from typer.testing import CliRunner

from services.admin.cli import app
from services.admin.plan import REFERENCE_OUTPUT_TOKENS_PER_REQUEST, PlanError, PlanInputs, plan
from services.admin.plan_cli import OPTION_OF_FIELD

runner = CliRunner()
REFERENCE = plan()
TIB = 1024**4
PIB = 1024**5


def test_reference_fleet_matches_the_published_figures() -> None:
    fleet = REFERENCE.fleet
    assert abs(fleet.num_pairs - 1185) <= 2
    assert abs(fleet.num_gpus - 2370) <= 4
    assert fleet.prefill_to_decode_ratio == pytest.approx(1.0, abs=0.01)
    assert fleet.num_prefill_servers == 149  # "~150 nodes"
    assert fleet.num_decode_super_nodes == {64: 19, 128: 10}  # "~18-19" of 64


def test_reference_money_matches_the_published_figures() -> None:
    money = REFERENCE.money
    for micro_cny in (
        money.revenue_per_busy_gpu_hour_micro_cny,
        money.revenue_per_gpu_hour_micro_cny,
    ):
        assert abs(micro_cny / 1e6 - 260.64) <= 0.5
    assert money.revenue_per_busy_gpu_hour_micro_cny == 260_640_000  # exact: rates and prices
    assert 37.5 <= money.revenue_per_gpu_hour_micro_usd / 1e6 <= 38.5
    shares = (money.hit_revenue_share, money.miss_revenue_share, money.output_revenue_share)
    for share, published in zip(shares, (0.199, 0.414, 0.387), strict=True):
        assert abs(share - published) <= 0.001
    assert sum(shares) == pytest.approx(1.0)
    assert 0 < money.gross_margin < 1


def test_reference_traffic_matches_the_check_figures() -> None:
    traffic = REFERENCE.traffic
    expected = {
        "hit_tokens_per_day": 147.5e12,
        "miss_tokens_per_day": 6.1e12,
        "output_tokens_per_day": 1.44e12,
        "input_tokens_per_s": 1.78e9,
        "output_tokens_per_s": 16.6e6,
        "requests_per_s": 23_000,
    }
    for name, value in expected.items():
        assert getattr(traffic, name) == pytest.approx(value, rel=0.01), name
    assert (
        traffic.input_tokens_per_day + traffic.output_tokens_per_day
        == REFERENCE.inputs.tokens_per_day
    )
    assert traffic.hit_tokens_per_day + traffic.miss_tokens_per_day == traffic.input_tokens_per_day


def test_default_output_tokens_balance_prefill_and_decode() -> None:
    assert abs(REFERENCE_OUTPUT_TOKENS_PER_REQUEST - 718.67) < 0.01
    fleet = REFERENCE.fleet
    assert fleet.prefill_gpus_busy == pytest.approx(fleet.decode_gpus_busy, rel=1e-9)


def test_reference_storage_fits_the_published_tier() -> None:
    storage = REFERENCE.storage
    # 100 PiB, 10 TiB/s aggregate read (docs/design.md, 'The reference deployment').
    assert storage.ssd_capacity_bytes <= 100 * PIB
    assert storage.ssd_read_bytes_per_s == pytest.approx(10 * TIB, rel=0.1)
    hit_bytes_per_s = REFERENCE.traffic.hit_tokens_per_s * REFERENCE.inputs.kv_bytes_per_token
    assert storage.ssd_read_bytes_per_s == round(hit_bytes_per_s)
    twice = plan(PlanInputs(ssd_reads_per_hit_token=2)).storage.ssd_read_bytes_per_s
    assert twice == pytest.approx(2 * storage.ssd_read_bytes_per_s, abs=1)
    longer = plan(PlanInputs(retention_days=4)).storage.ssd_capacity_bytes
    assert longer == pytest.approx(2 * storage.ssd_capacity_bytes, rel=1e-9)


def test_control_plane_carries_one_store_and_one_eviction_per_new_block() -> None:
    control, traffic = REFERENCE.control_plane, REFERENCE.traffic
    new_tokens_per_s = traffic.miss_tokens_per_s + traffic.output_tokens_per_s
    assert control.blocks_stored_per_s == pytest.approx(new_tokens_per_s / 64)
    assert control.kv_events_per_s == pytest.approx(2 * control.blocks_stored_per_s)
    assert control.requests_per_s == traffic.requests_per_s
    smaller_blocks = plan(PlanInputs(block_size_tokens=16)).control_plane
    assert smaller_blocks.kv_events_per_s == pytest.approx(4 * control.kv_events_per_s)


def test_more_hits_need_fewer_prefill_gpus_and_shift_revenue_to_hits() -> None:
    plans = [plan(PlanInputs(hit_rate=h)) for h in (0.5, 0.8, 0.9, 0.96, 0.98)]
    for lower, higher in zip(plans, plans[1:], strict=False):
        assert higher.fleet.num_prefill_gpus < lower.fleet.num_prefill_gpus
        assert higher.money.hit_revenue_share > lower.money.hit_revenue_share
        assert higher.money.miss_revenue_share < lower.money.miss_revenue_share
        assert higher.money.revenue_micro_cny_per_day < lower.money.revenue_micro_cny_per_day
        assert higher.fleet.num_decode_gpus == lower.fleet.num_decode_gpus


def test_prefill_rate_scales_with_misses_unless_measured_at_the_plan_hit_rate() -> None:
    # No cache at all: the reference deployment's ~60K tokens/s per prefill GPU.
    cold = plan(PlanInputs(hit_rate=0.0))
    assert cold.fleet.prefill_tokens_per_s_per_gpu == pytest.approx(60_000)
    as_is = plan(PlanInputs(hit_rate=0.5, prefill_rate_hit_rate=0.5))
    assert as_is.fleet.prefill_tokens_per_s_per_gpu == pytest.approx(1.5e6)


def test_more_traffic_or_slower_gpus_need_more_gpus() -> None:
    base = REFERENCE.fleet
    assert plan(PlanInputs(tokens_per_day=310 * 10**12)).fleet.num_gpus == pytest.approx(
        2 * base.num_gpus, abs=2
    )
    assert plan(PlanInputs(decode_tokens_per_s_per_gpu=7_000)).fleet.num_decode_gpus > (
        base.num_decode_gpus
    )
    more_output = plan(PlanInputs(output_tokens_per_request=1_500))
    assert more_output.fleet.num_decode_gpus > base.num_decode_gpus
    assert more_output.money.output_revenue_share > REFERENCE.money.output_revenue_share


def test_headroom_adds_gpus_and_lowers_revenue_per_deployed_gpu_hour() -> None:
    padded = plan(PlanInputs(headroom_fraction=0.25))
    fleet, base = padded.fleet, REFERENCE.fleet
    assert fleet.num_prefill_gpus == math.ceil(base.prefill_gpus_busy * 1.25)
    assert fleet.num_decode_gpus == math.ceil(base.decode_gpus_busy * 1.25)
    assert 2_400 <= fleet.num_gpus <= 3_000  # "2,400-3,000 with headroom"
    money = padded.money
    assert money.revenue_micro_cny_per_day == REFERENCE.money.revenue_micro_cny_per_day
    assert money.revenue_per_busy_gpu_hour_micro_cny == 260_640_000
    assert money.revenue_per_gpu_hour_micro_cny / 1e6 == pytest.approx(260.64 / 1.25, rel=0.001)
    assert money.gross_margin < REFERENCE.money.gross_margin


def _exact(num_gpus: int, headroom: float = 0.0) -> PlanInputs:
    """Traffic that loads exactly `num_gpus` prefill and as many decode GPUs."""
    return PlanInputs(
        tokens_per_day=2 * 86_400 * 1_000 * num_gpus,
        input_tokens_per_request=1_000,
        output_tokens_per_request=1_000,
        hit_rate=0.0,
        prefill_rate_hit_rate=0.0,
        prefill_tokens_per_s_per_gpu=1_000,
        decode_tokens_per_s_per_gpu=1_000,
        headroom_fraction=headroom,
    )


@pytest.mark.parametrize(
    ("num_gpus", "servers", "of_64", "of_128"),
    [(8, 1, 1, 1), (9, 2, 1, 1), (64, 8, 1, 1), (65, 9, 2, 1), (129, 17, 3, 2)],
)
def test_servers_and_super_nodes_round_up(num_gpus: int, servers: int, of_64: int, of_128: int):
    fleet = plan(_exact(num_gpus)).fleet
    assert fleet.num_prefill_gpus == fleet.num_decode_gpus == num_gpus
    assert fleet.num_prefill_servers == servers
    assert fleet.num_decode_super_nodes == {64: of_64, 128: of_128}


def test_float_noise_does_not_buy_a_gpu() -> None:
    # 100 x (1 + 0.1) is 110.00000000000001 in floating point.
    assert plan(_exact(100, headroom=0.1)).fleet.num_prefill_gpus == 110
    assert plan(_exact(100, headroom=0.101)).fleet.num_prefill_gpus == 111


def test_money_is_integer_micro_cny_and_the_plan_is_json_data() -> None:
    money = REFERENCE.money
    kinds = (
        money.hit_revenue_micro_cny_per_day,
        money.miss_revenue_micro_cny_per_day,
        money.output_revenue_micro_cny_per_day,
    )
    assert all(type(v) is int for v in (*kinds, money.revenue_per_gpu_hour_micro_cny))
    assert sum(kinds) == money.revenue_micro_cny_per_day
    # 6.14T miss tokens at CNY 1 per 1M: one micro-CNY per token.
    assert money.miss_revenue_micro_cny_per_day == REFERENCE.traffic.miss_tokens_per_day
    data = json.loads(json.dumps(REFERENCE.to_dict()))
    assert set(data) == {"inputs", "traffic", "fleet", "money", "storage", "control_plane"}


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"hit_rate": 1.0}, "hit_rate"),
        ({"hit_rate": -0.01}, "hit_rate"),
        ({"prefill_tokens_per_s_per_gpu": 0.0}, "prefill_tokens_per_s_per_gpu"),
        ({"decode_tokens_per_s_per_gpu": -1.0}, "decode_tokens_per_s_per_gpu"),
        ({"decode_tokens_per_s_per_gpu": math.nan}, "decode_tokens_per_s_per_gpu"),
        ({"headroom_fraction": -0.1}, "headroom_fraction"),
        ({"tokens_per_day": 155e12}, "tokens_per_day"),  # a float where money math wants int
        ({"decode_super_node_gpus": ()}, "decode_super_node_gpus"),
        ({"decode_super_node_gpus": (64, 0)}, "decode_super_node_gpus"),
    ],
)
def test_bad_inputs_name_their_field(change: dict, field: str) -> None:
    with pytest.raises(PlanError) as caught:
        PlanInputs(**change)
    assert caught.value.field == field


def test_every_input_has_an_option() -> None:
    assert set(OPTION_OF_FIELD) == {f.name for f in dataclasses.fields(PlanInputs)}


def test_cli_json_is_the_plan_of_the_options() -> None:
    result = runner.invoke(
        app, ["plan", "--format", "json", "--headroom", "0.25", "--hit-price", "0.05"]
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    expected = plan(PlanInputs(headroom_fraction=0.25, hit_price_micro_cny_per_mtok=50_000))
    assert data == json.loads(json.dumps(expected.to_dict()))
    assert data["inputs"]["hit_price_micro_cny_per_mtok"] == 50_000


def test_cli_defaults_are_the_reference_and_the_table_is_grouped() -> None:
    as_json = runner.invoke(app, ["plan", "--format", "json"])
    assert json.loads(as_json.output) == json.loads(json.dumps(REFERENCE.to_dict()))
    table = runner.invoke(app, ["plan", "--super-node-gpus", "64"])
    assert table.exit_code == 0, table.output
    for text in ("traffic", "GPUs and servers", "money", "storage", "control plane"):
        assert f"\n{text}\n" in table.output
    for figure in ("1,185", "2,370", "CNY 260.64", "19.9% / 41.4% / 38.7%"):
        assert figure in table.output
    assert "super-nodes of 64" in table.output and "super-nodes of 128" not in table.output


@pytest.mark.parametrize(
    ("args", "option"),
    [
        (["--hit-rate", "1"], "--hit-rate"),
        (["--hit-rate", "-0.5"], "--hit-rate"),
        (["--prefill-rate", "0"], "--prefill-rate"),
        (["--decode-rate", "-14000"], "--decode-rate"),
        (["--gpu-cost", "-1"], "--gpu-cost"),
        (["--tokens-per-day", "inf"], "--tokens-per-day"),
        (["--super-node-gpus", "0"], "--super-node-gpus"),
    ],
)
def test_cli_bad_input_is_a_usage_error_naming_the_option(args: list[str], option: str) -> None:
    result = runner.invoke(app, ["plan", *args])
    assert result.exit_code == 2
    assert f"Invalid value for {option}" in result.output


def test_index_memory_at_the_reference_scale() -> None:
    """~7.6T new tokens a day are ~118B 64-token blocks: the kv-index holds every one of the
    retention, at the measured bytes per block, split over its shards."""
    control, inputs = REFERENCE.control_plane, REFERENCE.inputs
    new_tokens = REFERENCE.storage.new_kv_tokens_per_day
    assert new_tokens == pytest.approx(7.58e12, rel=0.01)
    assert control.index_blocks_per_day == pytest.approx(118e9, rel=0.01)
    assert control.index_blocks_per_day == new_tokens / 64
    per_day = control.index_bytes_per_day_of_retention
    assert per_day == math.ceil(control.index_blocks_per_day * inputs.index_bytes_per_block)
    assert control.index_blocks == pytest.approx(
        inputs.retention_days * control.index_blocks_per_day
    )
    assert control.index_bytes == pytest.approx(inputs.retention_days * per_day, abs=1)
    assert inputs.index_bytes_per_block <= 32  # the default is the measured figure
    assert control.index_bytes_per_shard * inputs.num_index_shards >= control.index_bytes
    assert control.index_bytes_per_shard == -(-control.index_bytes // inputs.num_index_shards)
    assert control.index_blocks_per_shard == control.index_blocks / inputs.num_index_shards
    # 237B blocks in 32-bit row numbers (at most 2**32 - 3 a shard): 56 shards at the least.
    assert control.index_min_shards == 56
    assert control.index_blocks_per_shard <= (1 << 32) - 3  # the default 64 shards fit


def test_index_memory_moves_with_its_inputs() -> None:
    base = REFERENCE.control_plane
    fat = plan(PlanInputs(index_bytes_per_block=2 * REFERENCE.inputs.index_bytes_per_block))
    assert fat.control_plane.index_bytes == pytest.approx(2 * base.index_bytes, abs=2)
    longer = plan(PlanInputs(retention_days=4)).control_plane
    assert longer.index_bytes_per_day_of_retention == base.index_bytes_per_day_of_retention
    assert longer.index_bytes == pytest.approx(2 * base.index_bytes, abs=2)
    assert longer.index_min_shards == 111  # 473.5B blocks / (2**32 - 3) = 110.2
    more_shards = plan(PlanInputs(num_index_shards=128)).control_plane
    assert more_shards.index_bytes == base.index_bytes
    assert more_shards.index_bytes_per_shard == pytest.approx(base.index_bytes_per_shard / 2, abs=1)
    small_blocks = plan(PlanInputs(block_size_tokens=16)).control_plane
    assert small_blocks.index_blocks == pytest.approx(4 * base.index_blocks)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"index_bytes_per_block": 0.0}, "index_bytes_per_block"),
        ({"index_bytes_per_block": math.inf}, "index_bytes_per_block"),
        ({"num_index_shards": 0}, "num_index_shards"),
        ({"num_index_shards": 2.5}, "num_index_shards"),
    ],
)
def test_bad_index_inputs_name_their_field(change: dict, field: str) -> None:
    with pytest.raises(PlanError) as caught:
        PlanInputs(**change)
    assert caught.value.field == field


def test_cli_prints_the_index_memory_and_takes_its_options() -> None:
    table = runner.invoke(app, ["plan", "--index-shards", "128", "--index-bytes-per-block", "40"])
    assert table.exit_code == 0, table.output
    expected = plan(PlanInputs(num_index_shards=128, index_bytes_per_block=40.0)).control_plane
    for label in ("kv-index RAM per day of retention", "kv-index RAM per shard"):
        assert label in table.output
    assert "118.37B / 236.75B" in table.output  # blocks a day / retained
    [line] = [ln for ln in table.output.splitlines() if "kv-index RAM per shard" in ln]
    assert f"{expected.index_bytes_per_shard / 1024**3:,.2f} GiB" in line
    bad = runner.invoke(app, ["plan", "--index-shards", "0"])
    assert bad.exit_code == 2 and "Invalid value for --index-shards" in bad.output
