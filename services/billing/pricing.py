"""Prices and charges, in exact integers (docs/design.md, 'Usage and billing').

A price is micro-CNY per million tokens (0.02 CNY/M = 20_000), so tokens x price is an
exact charge in pico-CNY (1e-12 CNY): a micro-CNY per million tokens is a pico-CNY per
token. Python ints do not overflow, so a charge is exact at any token count; floats never
touch money (Decimal only to show it).

A model is priced off-peak unless the request's finish time, read in the model's time zone
(zoneinfo, DST included), falls in one of its windows. A window is local wall-clock time,
start inclusive, end exclusive, and may wrap midnight (08:30-00:30).

The price file (TOML, `PriceBook.from_file`); prices are integers of micro-CNY per million
tokens; a `[models."<name>"]` entry takes the default's fields it leaves out:

    usd_per_cny = "0.1380"          # optional, for display: or usd_micro_per_cny = 138_000

    [default]
    time_zone = "Asia/Shanghai"
    off_peak = { hit = 20_000, miss = 1_000_000, output = 4_000_000 }

    [[default.windows]]             # an example, not a claim about anyone's prices
    name = "peak"
    start = "08:30"
    end = "00:30"
    prices = { hit = 200_000, miss = 2_000_000, output = 8_000_000 }

    [models."tiny-coder"]
    off_peak = { hit = 0, miss = 100_000, output = 400_000 }
    windows = []                    # no peak for this model

Pins (cache_control) may be priced apart, in any prices table: `cache_write` per million
tokens a pin wrote, `storage_hour` per million tokens a pin keeps for an hour (a 5-minute
pin costs a twelfth of that). Both default to 0: free, as the reference deployment prices
its cache.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from datetime import datetime
from decimal import ROUND_HALF_EVEN, Context, Decimal
from pathlib import Path
from typing import Any, NamedTuple
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

PICO_PER_MICRO = 10**6
PICO_PER_CNY = 10**12
OFF_PEAK = "off_peak"
DEFAULT_TIME_ZONE = "Asia/Shanghai"
MINUTES_PER_DAY = 24 * 60
_MAX_CACHED_MINUTES = 4 * MINUTES_PER_DAY
# Enough digits that no sum of charges is ever rounded before the one rounding we show.
_EXACT = Context(prec=80, rounding=ROUND_HALF_EVEN)


class PricingError(ValueError):
    """A price file or price argument that is wrong; the message names the field."""


@dataclass(frozen=True, slots=True)
class Prices:
    """Micro-CNY per million tokens, for cache-hit input, cache-miss input and output."""

    hit: int
    miss: int
    output: int
    cache_write: int = 0  # per million tokens a pin (cache_control) wrote
    storage_hour: int = 0  # per million tokens a pin keeps, per hour

    def __post_init__(self) -> None:
        for name in ("hit", "miss", "output", "cache_write", "storage_hour"):
            value = getattr(self, name)
            if type(value) is not int or value < 0:
                raise PricingError(
                    f"{name} must be a non-negative integer of micro-CNY per million tokens "
                    f"(0.02 CNY/M = 20000), got {value!r}"
                )


DEFAULT_OFF_PEAK = Prices(20_000, 1_000_000, 4_000_000)  # CNY 0.02 / 1 / 4 per M tokens


@dataclass(frozen=True, slots=True)
class Window:
    """Local wall-clock [start, end) with its own prices; start > end wraps midnight."""

    name: str
    start: str  # "HH:MM"
    end: str
    prices: Prices
    start_minute: int = field(init=False, repr=False, compare=False)
    end_minute: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or self.name == OFF_PEAK:
            raise PricingError(f"name must be a string, not empty nor {OFF_PEAK!r}: {self.name!r}")
        object.__setattr__(self, "start_minute", _minute_of(self.start, "start"))
        object.__setattr__(self, "end_minute", _minute_of(self.end, "end"))
        if self.start_minute == self.end_minute:  # empty, or the whole day: say which instead
            raise PricingError(f"end equals start ({self.start}): a window cannot be empty")

    def minutes(self) -> range | tuple[range, range]:
        if self.start_minute < self.end_minute:
            return range(self.start_minute, self.end_minute)
        return range(self.start_minute, MINUTES_PER_DAY), range(0, self.end_minute)

    def contains(self, second_of_day: int) -> bool:
        start, end = self.start_minute * 60, self.end_minute * 60
        if start < end:
            return start <= second_of_day < end
        return second_of_day >= start or second_of_day < end


@dataclass(frozen=True, slots=True)
class ModelPricing:
    model: str  # "" for the default
    time_zone: str
    off_peak: Prices
    windows: tuple[Window, ...] = ()
    zone: ZoneInfo = field(init=False, repr=False, compare=False)
    # UTC minute -> the window in force through all of it (see window_at)
    _by_minute: dict[int, tuple[str, Prices]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        try:
            if not isinstance(self.time_zone, str):
                raise ValueError(self.time_zone)
            object.__setattr__(self, "zone", ZoneInfo(self.time_zone))
        except (ZoneInfoNotFoundError, ValueError) as exc:
            raise PricingError(f"time_zone must be an IANA zone, got {self.time_zone!r}") from exc
        taken: dict[int, str] = {}
        for window in self.windows:
            parts = window.minutes()
            for part in parts if isinstance(parts, tuple) else (parts,):
                for minute in part:
                    if minute in taken:
                        raise PricingError(
                            f"windows overlap: {taken[minute]!r} and {window.name!r} both "
                            f"cover {minute // 60:02d}:{minute % 60:02d}"
                        )
                    taken[minute] = window.name

    def window_at(self, at_ms: int) -> tuple[str, Prices]:
        """The window (name, prices) in force at `at_ms` (Unix ms), read in the model's zone.

        Windows are whole local minutes, so a UTC minute that is one whole local minute (the
        zone's offset whole minutes and unchanged through it) has one window: it is cached,
        and a record costs a dict lookup instead of a time zone conversion (~1.2 us here)."""
        minute = at_ms // 60_000
        cached = self._by_minute.get(minute)
        if cached is not None:
            return cached
        local = datetime.fromtimestamp(at_ms // 1000, self.zone)
        found = self._window(local.hour * 3600 + local.minute * 60 + local.second)
        first = datetime.fromtimestamp(minute * 60, self.zone)
        last = datetime.fromtimestamp(minute * 60 + 59, self.zone)
        if first.second == 0 and last.second == 59 and first.utcoffset() == last.utcoffset():
            if len(self._by_minute) >= _MAX_CACHED_MINUTES:
                self._by_minute.clear()
            self._by_minute[minute] = found
        return found

    def _window(self, second_of_day: int) -> tuple[str, Prices]:
        for window in self.windows:
            if window.contains(second_of_day):
                return window.name, window.prices
        return OFF_PEAK, self.off_peak


@dataclass(frozen=True, slots=True)
class PriceBook:
    """A default pricing for any model, per-model entries, and an optional USD display rate."""

    any_model: ModelPricing  # for a model without an entry of its own
    models: dict[str, ModelPricing] = field(default_factory=dict)
    usd_per_cny: Decimal | None = None  # for display only (`usd`)

    def for_model(self, model: str) -> ModelPricing:
        return self.models.get(model, self.any_model)

    @classmethod
    def default(cls) -> PriceBook:
        """The reference deployment's off-peak prices (CNY 0.02 / 1 / 4 per M), Beijing time,
        no peak window."""
        return cls(ModelPricing("", DEFAULT_TIME_ZONE, DEFAULT_OFF_PEAK))

    @classmethod
    def from_file(cls, path: str | Path) -> PriceBook:
        path = Path(path)
        try:
            data = tomllib.loads(path.read_text())
        except OSError as exc:
            raise PricingError(f"price file {path}: {exc.strerror or exc}") from exc
        except tomllib.TOMLDecodeError as exc:
            raise PricingError(f"price file {path}: not valid TOML: {exc}") from exc
        try:
            return cls.from_dict(data)
        except PricingError as exc:
            raise PricingError(f"price file {path}: {exc}") from exc

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PriceBook:
        """A parsed price file (the module docstring's format)."""
        data = _table(data, {"default", "models", "usd_per_cny", "usd_micro_per_cny"}, "")
        default = _model(data.get("default", {}), "", cls.default().any_model, "default")
        models_data = data.get("models", {})
        if not isinstance(models_data, dict):
            raise PricingError('models must be a table of [models."<name>"] entries')
        models = {
            name: _model(entry, name, default, f"models.{name}")
            for name, entry in models_data.items()
        }
        if "usd_per_cny" in data and "usd_micro_per_cny" in data:
            raise PricingError("give usd_per_cny or usd_micro_per_cny, not both")
        rate = data.get("usd_per_cny", data.get("usd_micro_per_cny"))
        if "usd_per_cny" in data and not isinstance(rate, str):
            raise PricingError(f'usd_per_cny must be a decimal string ("0.138"), got {rate!r}')
        if "usd_micro_per_cny" in data and type(rate) is not int:
            raise PricingError(f"usd_micro_per_cny must be an integer, got {rate!r}")
        return cls(default, models, None if rate is None else usd_rate(rate))


class Charge(NamedTuple):
    """What one request costs: the window and prices applied, exact pico-CNY per kind."""

    model: str
    window: str
    prices: Prices
    at_ms: int  # the instant priced
    hit_pico_cny: int
    miss_pico_cny: int
    output_pico_cny: int
    write_pico_cny: int = 0  # what a pin wrote
    storage_pico_cny: int = 0  # what a pin keeps, for its time to live

    @property
    def total_pico_cny(self) -> int:
        """The tokens' money (the ledger's `total_pico_cny`, which its schema binds to the
        three token charges); a pin's is `pin_pico_cny`, apart."""
        return self.hit_pico_cny + self.miss_pico_cny + self.output_pico_cny

    @property
    def pin_pico_cny(self) -> int:
        return self.write_pico_cny + self.storage_pico_cny


def price(
    book: PriceBook,
    model: str,
    at_ms: int,
    hit: int,
    miss: int,
    output: int,
    *,
    cache_write_tokens: int = 0,
    pin_ttl_s: int = 0,
) -> Charge:
    """Price one request that finished at `at_ms` (Unix ms) with these token counts, and
    what its pin wrote and keeps (storage rounded to the nearest pico-CNY, half to even)."""
    for name, count in (("cache_write_tokens", cache_write_tokens), ("pin_ttl_s", pin_ttl_s)):
        if type(count) is not int or count < 0:
            raise PricingError(f"{name} must be a non-negative integer, got {count!r}")
    if not (
        type(hit) is type(miss) is type(output) is type(at_ms) is int  # noqa: E721
        and min(hit, miss, output, at_ms) >= 0
    ):
        for name, count in (("hit", hit), ("miss", miss), ("output", output), ("at_ms", at_ms)):
            if type(count) is not int or count < 0:
                raise PricingError(f"{name} must be a non-negative integer, got {count!r}")
    window, prices = book.for_model(model).window_at(at_ms)
    storage, remainder = divmod(cache_write_tokens * prices.storage_hour * pin_ttl_s, 3600)
    if remainder * 2 > 3600 or (remainder * 2 == 3600 and storage % 2):
        storage += 1
    return Charge(
        model,
        window,
        prices,
        at_ms,
        hit * prices.hit,
        miss * prices.miss,
        output * prices.output,
        cache_write_tokens * prices.cache_write,
        storage,
    )


def micro_cny(pico_cny: int) -> Decimal:
    """Whole micro-CNY, rounded half-even."""
    return _rounded(Decimal(pico_cny).scaleb(-6, _EXACT), 0)


def cny(pico_cny: int, places: int = 6) -> Decimal:
    """CNY with `places` decimals, rounded half-even (exact: Decimal from the integer)."""
    return _rounded(Decimal(pico_cny).scaleb(-12, _EXACT), places)


def usd_rate(rate: int | str | Decimal) -> Decimal:
    """USD per CNY from an integer of micro-USD per CNY (138_000) or a decimal string
    ("0.138"); a float is refused, so no binary rounding reaches money."""
    if type(rate) is int:
        value = Decimal(rate).scaleb(-6, _EXACT)
    elif isinstance(rate, str | Decimal):
        try:
            value = Decimal(rate)
        except ArithmeticError as exc:
            raise PricingError(f"usd rate {rate!r} is not a decimal number") from exc
    else:
        raise PricingError(f"usd rate must be an int (micro-USD per CNY) or a string, got {rate!r}")
    if not value.is_finite() or value <= 0:
        raise PricingError(f"usd rate must be positive, got {rate!r}")
    return value


def usd(pico_cny: int, rate: int | str | Decimal, places: int = 6) -> Decimal:
    """USD at `rate` (see `usd_rate`), `places` decimals, rounded half-even."""
    exact = _EXACT.multiply(Decimal(pico_cny).scaleb(-12, _EXACT), usd_rate(rate))
    return _rounded(exact, places)


def _rounded(value: Decimal, places: int) -> Decimal:
    return value.quantize(Decimal(1).scaleb(-places), ROUND_HALF_EVEN, _EXACT)


def _minute_of(text: object, where: str) -> int:
    if not isinstance(text, str) or len(text) != 5 or text[2] != ":":
        raise PricingError(f"{where} must be a string 'HH:MM', got {text!r}")
    hours, minutes = text[:2], text[3:]
    if not (hours.isdigit() and minutes.isdigit()) or int(hours) > 23 or int(minutes) > 59:
        raise PricingError(f"{where} must be a time 'HH:MM' from 00:00 to 23:59, got {text!r}")
    return int(hours) * 60 + int(minutes)


def _table(data: object, allowed: set[str], where: str) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise PricingError(f"{where or 'the price file'} must be a table, got {data!r}")
    unknown = sorted(set(data) - allowed)
    if unknown:
        field_name = f"{where}.{unknown[0]}" if where else unknown[0]
        raise PricingError(f"unknown field {field_name} (known: {', '.join(sorted(allowed))})")
    return data


def _prices(data: object, where: str) -> Prices:
    table = _table(data, {"hit", "miss", "output", "cache_write", "storage_hour"}, where)
    try:
        return Prices(
            table.get("hit"),  # type: ignore[arg-type]
            table.get("miss"),  # type: ignore[arg-type]
            table.get("output"),  # type: ignore[arg-type]
            table.get("cache_write", 0),
            table.get("storage_hour", 0),
        )
    except PricingError as exc:  # it names the field: hit, miss or output
        raise PricingError(f"{where}.{exc}") from exc


def _window(data: object, where: str) -> Window:
    table = _table(data, {"name", "start", "end", "prices"}, where)
    if "prices" not in table:
        raise PricingError(f"{where}.prices is missing")
    prices = _prices(table["prices"], f"{where}.prices")
    try:
        return Window(table.get("name"), table.get("start"), table.get("end"), prices)  # type: ignore[arg-type]
    except PricingError as exc:
        raise PricingError(f"{where}.{exc}") from exc


def _model(data: object, model: str, base: ModelPricing, where: str) -> ModelPricing:
    """An entry of the file; the fields it leaves out come from `base`."""
    table = _table(data, {"time_zone", "off_peak", "windows"}, where)
    time_zone = table.get("time_zone", base.time_zone)
    off_peak = base.off_peak
    if "off_peak" in table:
        off_peak = _prices(table["off_peak"], f"{where}.off_peak")
    windows = base.windows
    if "windows" in table:
        if not isinstance(table["windows"], list):
            raise PricingError(f"{where}.windows must be an array of tables")
        windows = tuple(_window(w, f"{where}.windows[{i}]") for i, w in enumerate(table["windows"]))
        names = [w.name for w in windows]
        if len(set(names)) != len(names):
            raise PricingError(f"{where}.windows: window names repeat ({', '.join(names)})")
    try:
        return ModelPricing(model, time_zone, off_peak, windows)
    except PricingError as exc:  # time_zone, or windows that overlap
        raise PricingError(f"{where}.{exc}") from exc
