"""Report helpers: shares, effective price, money formatting, table / CSV / JSON."""

from __future__ import annotations

import csv
import io
import json
from decimal import Decimal

import pytest

from services.billing.ledger import ReportRow
from services.billing.report import (
    cache_hit_share,
    effective_price,
    format_cny,
    format_share,
    format_usd,
    render_csv,
    render_json,
    render_table,
    revenue_mix,
    total,
)


def priced(key: str, hit: int, miss: int, output: int, requests: int = 1) -> ReportRow:
    """A row at the reference off-peak prices (0.02 / 1 / 4 CNY per M)."""
    money = (hit * 20_000, miss * 1_000_000, output * 4_000_000)
    return ReportRow(key, requests, hit, miss, output, *money, sum(money))


AGENT = priced("agent", 96_000, 4_000, 932, requests=2)  # 96% of input a cache hit
HUGE = ReportRow("huge", 3, 0, 0, 0, 3 * 2**62, 0, 21, 3 * 2**62 + 21)  # past BIGINT


def test_revenue_mix_is_each_kinds_share_of_revenue() -> None:
    mix = revenue_mix(AGENT)
    assert mix is not None
    # 1.92 + 4 + 3.728 = 9.648 (in 1e-3 CNY): hit 19.90%, miss 41.46%, output 38.64%
    assert round(mix.hit, 4) == Decimal("0.1990")
    assert round(mix.miss, 4) == Decimal("0.4146")
    assert round(mix.output, 4) == Decimal("0.3864")
    assert abs(mix.hit + mix.miss + mix.output - 1) < Decimal("1e-25")
    assert revenue_mix(ReportRow("empty")) is None


def test_cache_hit_share_and_effective_price() -> None:
    assert cache_hit_share(AGENT) == Decimal("0.96")
    assert cache_hit_share(priced("out-only", 0, 0, 10)) is None
    # a million tokens of each kind: CNY 5.02 over 3M tokens = 1.673... CNY per M
    even = priced("even", 10**6, 10**6, 10**6)
    price = effective_price(even)
    assert price is not None and round(price) == 1_673_333  # micro-CNY per million tokens
    assert price == Decimal(5_020_000) / 3
    assert effective_price(ReportRow("empty")) is None


def test_total_adds_every_field_exactly() -> None:
    summed = total([AGENT, HUGE, AGENT])
    assert summed.key == "total"
    assert summed.num_requests == 7
    assert summed.num_cache_hit_tokens == 2 * 96_000
    assert summed.total_pico_cny == 2 * AGENT.total_pico_cny + 3 * 2**62 + 21


def test_money_formats_with_two_to_six_decimals() -> None:
    assert format_cny(260_640_000_000_000) == "CNY 260.64"
    assert format_cny(1_234_567_891_234_567_890, 2) == "CNY 1,234,567.89"
    assert format_cny(1_234_567, 6) == "CNY 0.000001"  # 1.234567 micro-CNY
    assert format_cny(2_500_000, 6) == "CNY 0.000002"  # half-even: 2.5 -> 2
    assert format_cny(3_500_000, 6) == "CNY 0.000004"  # 3.5 -> 4
    assert format_usd(260_640_000_000_000, "0.1458") == "USD 38.00"
    assert format_usd(260_640_000_000_000, 138_000, 4) == "USD 35.9683"
    for places in (1, 7):
        with pytest.raises(ValueError, match="places"):
            format_cny(1, places)
    assert format_share(Decimal("0.1990049")) == "19.9%"
    assert format_share(None) == "-"


def test_table_is_aligned_and_ends_with_the_total() -> None:
    text = render_table([AGENT, HUGE], usd_rate="0.138")
    lines = text.splitlines()
    assert lines[0].split()[:3] == ["key", "requests", "hit"]
    assert len({len(line) for line in lines}) == 1  # every column padded to one width
    assert lines[2].startswith("agent") and lines[3].startswith("huge")
    assert lines[-1].startswith("total")
    assert set(lines[1].replace(" ", "")) == {"-"} and set(lines[-2].replace(" ", "")) == {"-"}
    assert "96.0%" in lines[2]
    assert f"{3 * 2**62 // 10**12:,}" in lines[3]  # CNY 13,835,058.06 in full
    assert lines[-1].split()[1] == "5"  # requests: 2 + 3
    # numbers are right-aligned: the requests column ends at the same offset on every row
    end = lines[0].index("requests") + len("requests")
    assert all(line[end - 1] != " " for line in lines[2:])


def test_csv_and_json_keep_exact_integers() -> None:
    parsed = list(csv.DictReader(io.StringIO(render_csv([AGENT, HUGE]))))
    assert [r["key"] for r in parsed] == ["agent", "huge"]
    assert int(parsed[1]["total_pico_cny"]) == 3 * 2**62 + 21
    assert parsed[1]["total_cny"] == "13835058.055282"
    assert int(parsed[0]["num_cache_hit_tokens"]) == 96_000
    loaded = json.loads(render_json([AGENT, HUGE]))
    assert int(loaded[1]["total_pico_cny"]) == 3 * 2**62 + 21
    assert isinstance(loaded[1]["total_pico_cny"], str)  # money past 2^53 must not be a number
    assert loaded[0]["num_requests"] == 2
    assert loaded[0]["revenue_mix"]["hit"] == "0.199005"
    assert json.loads(render_json([ReportRow("empty")]))[0]["revenue_mix"] is None
