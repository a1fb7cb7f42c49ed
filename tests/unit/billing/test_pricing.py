"""Pricing: windows (edges, midnight wrap, zones, DST), exact integer charges, price files."""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest

from services.billing.pricing import (
    OFF_PEAK,
    ModelPricing,
    PriceBook,
    Prices,
    PricingError,
    Window,
    cny,
    micro_cny,
    price,
    usd,
    usd_rate,
)

PEAK = Prices(200_000, 2_000_000, 8_000_000)  # the docstring's example: 0.2 / 2 / 8 CNY per M
BEIJING = ZoneInfo("Asia/Shanghai")
PEAK_FILE = """
[default]
time_zone = "Asia/Shanghai"
off_peak = { hit = 20_000, miss = 1_000_000, output = 4_000_000 }

[[default.windows]]
name = "peak"
start = "08:30"
end = "00:30"
prices = { hit = 200_000, miss = 2_000_000, output = 8_000_000 }
"""


def at(zone: ZoneInfo | str, *fields: int) -> int:
    """Unix ms of a local wall-clock time in `zone`."""
    tz = ZoneInfo(zone) if isinstance(zone, str) else zone
    return int(datetime(*fields, tzinfo=tz).timestamp() * 1000)  # type: ignore[misc]


def peak_book(tmp_path: Path) -> PriceBook:
    path = tmp_path / "prices.toml"
    path.write_text(PEAK_FILE)
    return PriceBook.from_file(path)


def test_default_is_the_reference_off_peak_price_in_beijing_time() -> None:
    book = PriceBook.default()
    charge = price(
        book, "any-model", at(BEIJING, 2025, 1, 15, 12, 0), 1_000_000, 1_000_000, 1_000_000
    )
    assert charge.window == OFF_PEAK
    assert charge.prices == Prices(20_000, 1_000_000, 4_000_000)
    # a million tokens of each: CNY 0.02 + 1 + 4, exactly
    assert (charge.hit_pico_cny, charge.miss_pico_cny, charge.output_pico_cny) == (
        20_000 * 10**6,
        10**12,
        4 * 10**12,
    )
    assert cny(charge.total_pico_cny) == Decimal("5.020000")
    assert book.any_model.time_zone == "Asia/Shanghai"


@pytest.mark.parametrize(
    ("hms", "window"),
    [
        ((8, 29, 59), OFF_PEAK),  # a second before the start
        ((8, 30, 0), "peak"),  # at the start: inclusive
        ((8, 30, 1), "peak"),
        ((0, 29, 59), "peak"),  # a second before the end, past midnight: the window wraps
        ((0, 30, 0), OFF_PEAK),  # at the end: exclusive
        ((0, 30, 1), OFF_PEAK),
        ((23, 59, 59), "peak"),
        ((0, 0, 0), "peak"),
        ((4, 0, 0), OFF_PEAK),
    ],
)
def test_window_edges_and_midnight_wrap(
    tmp_path: Path, hms: tuple[int, int, int], window: str
) -> None:
    book = peak_book(tmp_path)
    charge = price(book, "m", at(BEIJING, 2025, 3, 10, *hms), 1, 1, 1)
    assert charge.window == window
    assert charge.prices == (PEAK if window == "peak" else book.any_model.off_peak)


def test_milliseconds_before_the_start_are_still_off_peak(tmp_path: Path) -> None:
    book = peak_book(tmp_path)
    start = at(BEIJING, 2025, 3, 10, 8, 30)
    assert price(book, "m", start - 1, 0, 0, 1).window == OFF_PEAK
    assert price(book, "m", start, 0, 0, 1).window == "peak"


def test_one_instant_is_peak_in_one_zone_and_off_peak_in_another() -> None:
    window = Window("peak", "08:30", "00:30", PEAK)
    beijing = PriceBook(ModelPricing("", "Asia/Shanghai", Prices(1, 1, 1), (window,)))
    london = PriceBook(ModelPricing("", "Europe/London", Prices(1, 1, 1), (window,)))
    instant = at("UTC", 2025, 1, 15, 2, 0)  # 10:00 in Beijing, 02:00 in London
    assert price(beijing, "m", instant, 0, 0, 1).window == "peak"
    assert price(london, "m", instant, 0, 0, 1).window == OFF_PEAK


def test_dst_moves_the_window_against_utc() -> None:
    """09:00-17:00 New York time starts at 13:00 UTC in summer (EDT) and 14:00 in winter."""
    window = Window("business", "09:00", "17:00", PEAK)
    book = PriceBook(ModelPricing("", "America/New_York", Prices(1, 1, 1), (window,)))
    assert price(book, "m", at("UTC", 2025, 7, 1, 13, 30), 0, 0, 1).window == "business"
    assert price(book, "m", at("UTC", 2025, 1, 15, 13, 30), 0, 0, 1).window == OFF_PEAK
    # the spring-forward night: 02:00-03:00 does not exist; 01:59:59 EST, then 03:00 EDT
    night = PriceBook(
        ModelPricing(
            "", "America/New_York", Prices(1, 1, 1), (Window("night", "02:30", "03:30", PEAK),)
        )
    )
    assert price(night, "m", at("UTC", 2025, 3, 9, 6, 59, 59), 0, 0, 1).window == OFF_PEAK
    assert price(night, "m", at("UTC", 2025, 3, 9, 7, 0, 0), 0, 0, 1).window == "night"
    # the fall-back night: 01:30 happens twice, both inside a 01:00-02:00 window
    fall = PriceBook(
        ModelPricing(
            "", "America/New_York", Prices(1, 1, 1), (Window("w", "01:00", "02:00", PEAK),)
        )
    )
    assert price(fall, "m", at("UTC", 2025, 11, 2, 5, 30), 0, 0, 1).window == "w"  # EDT
    assert price(fall, "m", at("UTC", 2025, 11, 2, 6, 30), 0, 0, 1).window == "w"  # EST
    assert price(fall, "m", at("UTC", 2025, 11, 2, 7, 0), 0, 0, 1).window == OFF_PEAK


@pytest.mark.parametrize(
    ("zone", "day"),
    [
        ("America/New_York", (2025, 3, 9)),  # spring forward
        ("America/New_York", (2025, 11, 2)),  # fall back
        ("Asia/Kolkata", (2025, 3, 9)),  # a half-hour offset
        ("Africa/Monrovia", (1972, 1, 6)),  # -00:44:30 until the next day: not whole minutes
    ],
)
def test_the_minute_cache_prices_every_second_as_the_zone_does(
    zone: str, day: tuple[int, int, int]
) -> None:
    """window_at caches a window per UTC minute: swept second by second over a day with a
    transition (every minute's first lookup fills the cache, the rest read it), each
    second's window is the one its local wall-clock time falls in."""
    windows = (Window("a", "01:00", "02:00", PEAK), Window("b", "02:30", "03:01", PEAK))
    pricing = ModelPricing("", zone, Prices(1, 1, 1), windows)
    start = at("UTC", *day) - 12 * 3600 * 1000
    for second in range(0, 48 * 3600, 7):  # every 7 s over two days: each second of a minute
        at_ms = start + second * 1000
        local = datetime.fromtimestamp(at_ms // 1000, ZoneInfo(zone))
        minute_of_day = local.hour * 60 + local.minute
        expected = (
            "a" if 60 <= minute_of_day < 120 else "b" if 150 <= minute_of_day < 181 else OFF_PEAK
        )
        assert pricing.window_at(at_ms)[0] == expected, local
    # a minute is cached only where it is one whole local minute (not Monrovia's -00:44:30)
    cached = [datetime.fromtimestamp(m * 60, ZoneInfo(zone)).second for m in pricing._by_minute]
    assert cached and set(cached) == {0}
    if zone == "Africa/Monrovia":  # the hours before its switch to UTC are never cached
        assert 0 < len(pricing._by_minute) < 48 * 60 - 600
    else:
        assert len(pricing._by_minute) == 48 * 60


def test_big_token_counts_are_exact() -> None:
    book = PriceBook.default()
    tokens = 155 * 10**12  # the reference deployment's tokens per day, in one charge
    charge = price(book, "m", 0, tokens, tokens, tokens)
    assert charge.output_pico_cny == 155 * 10**12 * 4_000_000  # 6.2e20: past 2^64
    assert charge.total_pico_cny == tokens * (20_000 + 1_000_000 + 4_000_000)
    assert cny(charge.total_pico_cny, 2) == Decimal("778100000.00")
    odd = price(book, "m", 0, 3, 7, 2**70 + 1)
    assert odd.output_pico_cny == (2**70 + 1) * 4_000_000  # a float would have lost the +1


def test_money_display_rounds_half_even() -> None:
    assert micro_cny(1_500_000) == Decimal(2)  # 1.5 micro-CNY -> 2 (even)
    assert micro_cny(2_500_000) == Decimal(2)  # 2.5 -> 2 (even)
    assert cny(5 * 10**9, 2) == Decimal("0.00")  # CNY 0.005 -> 0.00
    assert cny(15 * 10**9, 2) == Decimal("0.02")  # CNY 0.015 -> 0.02
    assert cny(260_640_000_000_000, 2) == Decimal("260.64")


def test_usd_at_an_integer_or_decimal_string_rate_never_a_float() -> None:
    pico = 260_640_000_000_000  # CNY 260.64
    assert usd(pico, 138_000, 2) == usd(pico, "0.138", 2) == Decimal("35.97")
    assert usd_rate(145_800) == Decimal("0.1458")
    with pytest.raises(PricingError, match="usd rate"):
        usd(pico, 0.138)  # type: ignore[arg-type]
    with pytest.raises(PricingError, match="positive"):
        usd_rate("-1")
    with pytest.raises(PricingError, match="not a decimal"):
        usd_rate("abc")


def test_model_entries_inherit_what_they_leave_out(tmp_path: Path) -> None:
    path = tmp_path / "prices.toml"
    path.write_text(
        'usd_per_cny = "0.14"\n'
        + PEAK_FILE
        + """
[models."tiny-coder"]
off_peak = { hit = 0, miss = 100_000, output = 400_000 }
[models."night-owl"]
time_zone = "UTC"
windows = []
"""
    )
    book = PriceBook.from_file(path)
    tiny = book.for_model("tiny-coder")
    assert tiny.off_peak == Prices(0, 100_000, 400_000)
    assert [w.name for w in tiny.windows] == ["peak"] and tiny.time_zone == "Asia/Shanghai"
    owl = book.for_model("night-owl")
    assert owl.windows == () and owl.time_zone == "UTC"
    assert owl.off_peak == book.any_model.off_peak
    assert book.for_model("unlisted") is book.any_model
    assert book.usd_per_cny == Decimal("0.14")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[default]\noff_peak = { hit = 0.02, miss = 1, output = 4 }", "default.off_peak.hit must"),
        ("[default]\noff_peak = { hit = 1, miss = 1 }", "default.off_peak.output must"),
        ("[default]\noff_peak = { hit = -1, miss = 1, output = 1 }", "default.off_peak.hit must"),
        ("[default]\nof_peak = { hit = 1, miss = 1, output = 1 }", "unknown field default.of_peak"),
        ('[default]\ntime_zone = "Mars/Olympus"', "default.time_zone must be an IANA zone"),
        ('[models."m"]\ntime_zone = 8', "models.m.time_zone must be an IANA zone"),
        (
            '[[default.windows]]\nname = "p"\nstart = "8:30"\nend = "09:00"\n'
            "prices = { hit = 1, miss = 1, output = 1 }",
            "default.windows[0].start must",
        ),
        (
            '[[default.windows]]\nname = "p"\nstart = "08:30"\nend = "24:00"\n'
            "prices = { hit = 1, miss = 1, output = 1 }",
            "default.windows[0].end must",
        ),
        (
            '[[default.windows]]\nname = "p"\nstart = "08:30"\nend = "08:30"\n'
            "prices = { hit = 1, miss = 1, output = 1 }",
            "default.windows[0].end equals start",
        ),
        (
            '[[default.windows]]\nname = "p"\nstart = "08:30"\nend = "09:00"',
            "default.windows[0].prices is missing",
        ),
        (
            '[[default.windows]]\nname = "a"\nstart = "08:00"\nend = "10:00"\n'
            "prices = { hit = 1, miss = 1, output = 1 }\n"
            '[[default.windows]]\nname = "b"\nstart = "09:59"\nend = "11:00"\n'
            "prices = { hit = 1, miss = 1, output = 1 }",
            "windows overlap: 'a' and 'b' both cover 09:59",
        ),
        ("usd_per_cny = 0.14", "usd_per_cny must be a decimal string"),
        ("models = 3", "models must be a table"),
        ('currency = "CNY"', "unknown field currency"),
        ("[default\n", "not valid TOML"),
    ],
)
def test_bad_price_files_name_the_field(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(PricingError, match=message.replace("[", r"\[").replace("]", r"\]")) as info:
        PriceBook.from_file(path)
    assert str(path) in str(info.value)


def test_a_missing_file_is_a_pricing_error(tmp_path: Path) -> None:
    with pytest.raises(PricingError, match="No such file"):
        PriceBook.from_file(tmp_path / "absent.toml")


def test_price_refuses_negative_or_float_counts() -> None:
    book = PriceBook.default()
    with pytest.raises(PricingError, match="miss must be a non-negative integer"):
        price(book, "m", 0, 1, -1, 1)
    with pytest.raises(PricingError, match="output must be a non-negative integer"):
        price(book, "m", 0, 1, 1, 1.0)  # type: ignore[arg-type]


def test_a_pin_is_free_by_default_and_priced_as_configured(tmp_path: Path) -> None:
    """What a pin wrote (per token) and keeps (per token-hour: a 5-minute pin is a twelfth),
    apart from the tokens' total; free unless the price file says otherwise."""
    at_ms = at("UTC", 2026, 12, 7, 3, 0)
    free = price(
        PriceBook.default(), "m", at_ms, 0, 1000, 10, cache_write_tokens=800, pin_ttl_s=3600
    )
    assert free.pin_pico_cny == 0 and free.total_pico_cny == 1000 * 1_000_000 + 10 * 4_000_000
    path = tmp_path / "prices.toml"
    path.write_text(
        "[default]\n"
        'time_zone = "UTC"\n'
        "off_peak = { hit = 20_000, miss = 1_000_000, output = 4_000_000, "
        "cache_write = 1_250_000, storage_hour = 100_000 }\n"
    )
    book = PriceBook.from_file(path)
    hour = price(book, "m", at_ms, 0, 1000, 10, cache_write_tokens=800, pin_ttl_s=3600)
    assert (hour.write_pico_cny, hour.storage_pico_cny) == (800 * 1_250_000, 800 * 100_000)
    assert hour.total_pico_cny == free.total_pico_cny  # the tokens' money, as before
    five = price(book, "m", at_ms, 0, 1000, 10, cache_write_tokens=7, pin_ttl_s=300)
    assert five.storage_pico_cny == round(7 * 100_000 / 12)  # 58,333.3: to the nearest
    with pytest.raises(PricingError, match="pin_ttl_s"):
        price(book, "m", at_ms, 0, 1, 1, cache_write_tokens=1, pin_ttl_s=-1)
    path.write_text("[default]\noff_peak = { hit = 1, miss = 1, output = 1, storage_hour = -1 }\n")
    with pytest.raises(PricingError, match="storage_hour"):
        PriceBook.from_file(path)
