"""Pure helpers over `ReportRow`s: shares, effective prices, money formatting, rendering.

Everything is computed from the rows' exact integers; a Decimal appears only in what is
shown, rounded once (half-even). Shares and prices are None for a row with nothing to divide
by, rather than a made-up zero.

JSON carries money as decimal strings: a sum of pico-CNY passes 2^53 (about CNY 9,007)
quickly, and JavaScript's JSON numbers round beyond that.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from decimal import Decimal

from services.billing.ledger.rows import ReportRow
from services.billing.pricing import cny, usd

MIN_PLACES, MAX_PLACES = 2, 6
_MONEY = ("hit_pico_cny", "miss_pico_cny", "output_pico_cny", "total_pico_cny")
_COUNTS = ("num_requests", "num_cache_hit_tokens", "num_cache_miss_tokens", "num_output_tokens")


@dataclass(frozen=True, slots=True)
class RevenueMix:
    """Each kind's share of revenue (they sum to 1, up to the Decimal's 28 digits)."""

    hit: Decimal
    miss: Decimal
    output: Decimal


def total(rows: Iterable[ReportRow], key: str = "total") -> ReportRow:
    summed = ReportRow(key)
    for row in rows:
        summed = summed.plus(row)
    return summed


def revenue_mix(row: ReportRow) -> RevenueMix | None:
    if row.total_pico_cny == 0:
        return None
    whole = Decimal(row.total_pico_cny)
    return RevenueMix(
        row.hit_pico_cny / whole, row.miss_pico_cny / whole, row.output_pico_cny / whole
    )


def effective_price(row: ReportRow) -> Decimal | None:
    """Revenue per token over all tokens, in micro-CNY per million tokens (a pico-CNY per
    token is exactly that): what the traffic paid on average."""
    if row.num_tokens == 0:
        return None
    return Decimal(row.total_pico_cny) / row.num_tokens


def cache_hit_share(row: ReportRow) -> Decimal | None:
    """Cache-hit tokens over all input tokens."""
    if row.num_input_tokens == 0:
        return None
    return Decimal(row.num_cache_hit_tokens) / row.num_input_tokens


def format_cny(pico_cny: int, places: int = 2) -> str:
    """ "CNY 1,234.56": 2 to 6 decimals (6 shows every micro-CNY)."""
    return f"CNY {cny(pico_cny, _places(places)):,}"


def format_usd(pico_cny: int, rate: int | str | Decimal, places: int = 2) -> str:
    """ "USD 38.00" at `rate` (micro-USD per CNY as an int, or USD per CNY as a string)."""
    return f"USD {usd(pico_cny, rate, _places(places)):,}"


def format_share(share: Decimal | None, places: int = 1) -> str:
    return "-" if share is None else f"{share * 100:.{places}f}%"


def render_table(
    rows: Sequence[ReportRow], *, places: int = 2, usd_rate: int | str | Decimal | None = None
) -> str:
    """Aligned text, one line per row and a total line; money in CNY (and USD at a rate)."""
    header = [
        "key",
        "requests",
        "hit tok",
        "miss tok",
        "out tok",
        "hit %",
        "CNY hit",
        "CNY miss",
        "CNY out",
        "CNY total",
        "CNY/M tok",
    ]
    if usd_rate is not None:
        header.append("USD total")
    lines = [header]
    for row in [*rows, total(rows)]:
        price = effective_price(row)
        cells = [
            row.key,
            *(f"{getattr(row, c):,}" for c in _COUNTS),
            format_share(cache_hit_share(row)),
            *(f"{cny(getattr(row, c), _places(places)):,}" for c in _MONEY),
            "-" if price is None else f"{price / 10**6:.4f}",
        ]
        if usd_rate is not None:
            cells.append(f"{usd(row.total_pico_cny, usd_rate, _places(places)):,}")
        lines.append(cells)
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    rule = ["-" * w for w in widths]
    lines.insert(1, rule)
    lines.insert(len(lines) - 1, rule)
    return "\n".join(_aligned(line, widths) for line in lines)


def _aligned(cells: list[str], widths: list[int]) -> str:
    """The key left-aligned, numbers right-aligned."""
    padded = [
        c.ljust(w) if i == 0 else c.rjust(w)
        for i, (c, w) in enumerate(zip(cells, widths, strict=True))
    ]
    return "  ".join(padded).rstrip()


def render_csv(rows: Sequence[ReportRow]) -> str:
    """Exact integers (pico-CNY), plus the total in CNY to 6 decimals."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["key", *_COUNTS, *_MONEY, "total_cny"])
    for row in rows:
        writer.writerow(
            [row.key, *(getattr(row, c) for c in _COUNTS + _MONEY), cny(row.total_pico_cny, 6)]
        )
    return out.getvalue()


def render_json(rows: Sequence[ReportRow]) -> str:
    """A JSON array; counts as numbers, money as strings (see the module docstring)."""
    return json.dumps([_json_row(row) for row in rows], indent=2)


def _json_row(row: ReportRow) -> dict[str, object]:
    out: dict[str, object] = {"key": row.key}
    out.update({c: getattr(row, c) for c in _COUNTS})
    out.update({c: str(getattr(row, c)) for c in _MONEY})
    out["total_cny"] = str(cny(row.total_pico_cny, 6))
    mix = revenue_mix(row)
    out["revenue_mix"] = (
        None
        if mix is None
        else {
            "hit": str(round(mix.hit, 6)),
            "miss": str(round(mix.miss, 6)),
            "output": str(round(mix.output, 6)),
        }
    )
    return out


def _places(places: int) -> int:
    if not MIN_PLACES <= places <= MAX_PLACES:
        raise ValueError(f"places must be {MIN_PLACES} to {MAX_PLACES}, got {places}")
    return places
