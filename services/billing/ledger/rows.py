"""What the ledger stores and returns, and the one rule for a request id seen twice.

The rule: a row from decode (its own count) replaces one from ingress (the caller's estimate,
published when the stream's decode worker died); any other repeat leaves the existing row
alone, so redelivery is harmless. The database applies it (an upsert); this module decides
which row of a batch goes to the database for each id, and turns the database's answer into
counts that read as if the batch's rows had been recorded one by one.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import astuple, dataclass, field
from typing import Literal, NamedTuple, get_args, get_type_hints

from services.billing.pricing import Charge
from shared.schema import UsageRecord

DECODE = "decode"
INGRESS = "ingress"
SOURCES = (DECODE, INGRESS)
ANONYMOUS = "anonymous"

Outcome = Literal["inserted", "replaced", "kept"]


class LedgerError(RuntimeError):
    """The ledger could not do what was asked; for `record`, nothing of the batch was written."""


class LedgerConfigError(LedgerError, ValueError):
    """A ledger URL, report key or row that cannot work, whatever the database does."""


class LedgerRow(NamedTuple):
    """One request, priced: the columns of `usage_ledger`, in order. A tuple, so it binds to
    an INSERT as it is (a frozen dataclass of 24 fields took 8 us to build here, a third of
    the billing service's whole budget per record)."""

    request_id: str
    account: str
    api_key_id: str
    model: str
    status: str
    finish_reason: str | None
    source: str  # 'decode' | 'ingress'
    num_cache_hit_tokens: int
    num_cache_miss_tokens: int
    num_output_tokens: int
    price_window: str
    hit_price_micro_cny_per_m: int
    miss_price_micro_cny_per_m: int
    output_price_micro_cny_per_m: int
    hit_pico_cny: int
    miss_pico_cny: int
    output_pico_cny: int
    total_pico_cny: int
    started_ms: int
    finished_ms: int
    recorded_ms: int
    prefill_worker_id: str
    decode_worker_id: str
    cache_miss_cause: str  # migration 0004
    # migration 0005: what a pin (cache_control) wrote and keeps, and what that cost
    num_cache_write_tokens: int
    pin_ttl_s: int
    cache_write_price_micro_cny_per_m: int
    storage_price_micro_cny_per_m_hour: int
    write_pico_cny: int
    storage_pico_cny: int

    @classmethod
    def of(
        cls, record: UsageRecord, *, source: str, charge: Charge, recorded_ms: int | None = None
    ) -> LedgerRow:
        """The row for `record` published on usage.<source>, priced as `charge`.

        The account is the record's; a record without one is billed to its API key, and one
        with neither to "anonymous". A record without a finish time is filed at the instant
        it was priced (`charge.at_ms`), so time reports never see a 1970 row.
        """
        if source not in SOURCES:
            raise LedgerConfigError(f"usage source must be one of {SOURCES}, got {source!r}")
        prices = charge.prices
        return cls(
            record.request_id,
            record.account or record.api_key_id or ANONYMOUS,
            record.api_key_id,
            record.model,
            str(record.status),
            record.finish_reason,
            source,
            record.num_cache_hit_tokens,
            record.num_cache_miss_tokens,
            record.num_output_tokens,
            charge.window,
            prices.hit,
            prices.miss,
            prices.output,
            charge.hit_pico_cny,
            charge.miss_pico_cny,
            charge.output_pico_cny,
            charge.total_pico_cny,
            record.started_ms,
            record.finished_ms or charge.at_ms,
            int(time.time() * 1000) if recorded_ms is None else recorded_ms,
            record.prefill_worker_id,
            record.decode_worker_id,
            record.cache_miss_cause,
            record.num_cache_write_tokens,
            record.pin_ttl_s,
            prices.cache_write,
            prices.storage_hour,
            charge.write_pico_cny,
            charge.storage_pico_cny,
        )  # positional, in field order: what NamedTuple builds fastest

    def values(self) -> tuple[object, ...]:
        """The column values, in `COLUMNS` order (what an INSERT binds)."""
        return tuple(self)


COLUMNS: tuple[str, ...] = LedgerRow._fields
TEXT_COLUMNS = frozenset(
    name for name, kind in get_type_hints(LedgerRow).items() if str in (kind, *get_args(kind))
)


@dataclass(frozen=True, slots=True)
class RecordResult:
    """What one `Ledger.record` did; the three counts add up to the number of rows given.

    Beside them, for billing's metrics (not compared: the counts are the result): the rows
    inserted or replaced by source (`SOURCES` order), and the money of the request ids new
    to the ledger (hit, miss, output pico-CNY; a replacement's change is not known here)."""

    num_inserted: int = 0  # a request id the ledger did not have
    num_replaced: int = 0  # decode's row over the caller's
    num_duplicates: int = 0  # already there: left as it was
    num_ledgered_by_source: tuple[int, ...] = field(default=(0,) * len(SOURCES), compare=False)
    inserted_pico_cny: tuple[int, ...] = field(default=(0, 0, 0), compare=False)

    def __add__(self, other: RecordResult) -> RecordResult:
        return RecordResult(
            self.num_inserted + other.num_inserted,
            self.num_replaced + other.num_replaced,
            self.num_duplicates + other.num_duplicates,
            _add(self.num_ledgered_by_source, other.num_ledgered_by_source),
            _add(self.inserted_pico_cny, other.inserted_pico_cny),
        )


def _add(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(x + y for x, y in zip(a, b, strict=True))


class Pending(NamedTuple):
    """The row of a batch that goes to the database for one request id."""

    row: LedgerRow
    num_rows: int  # rows of the batch with this id
    first_is_ingress: bool


def plan(rows: Sequence[LedgerRow]) -> list[Pending]:
    """One row per request id (the first decode row, else the first row), sorted by id.

    Two rows with one id cannot go in one statement (PostgreSQL refuses to upsert a row
    twice in one command), and the sorting makes every writer lock ids in the same order,
    so two replicas writing overlapping batches wait for each other instead of deadlocking.
    """
    winners: dict[str, LedgerRow] = {}
    counts: dict[str, int] = {}
    first_ingress: dict[str, bool] = {}
    for row in rows:
        if row.source not in SOURCES:
            raise LedgerConfigError(f"{row.request_id}: source must be one of {SOURCES}")
        seen = winners.get(row.request_id)
        if seen is None:
            first_ingress[row.request_id] = row.source == INGRESS
            winners[row.request_id] = row
        elif seen.source == INGRESS and row.source == DECODE:
            winners[row.request_id] = row
        counts[row.request_id] = counts.get(row.request_id, 0) + 1
    return [Pending(winners[i], counts[i], first_ingress[i]) for i in sorted(winners)]


def tally(pending: Sequence[Pending], outcomes: Sequence[Outcome]) -> RecordResult:
    """Counts as if each row had been recorded alone, in order, from the database's outcome
    for each id's winning row."""
    inserted = replaced = duplicates = from_decode = from_ingress = hit = miss = output = 0
    for item, outcome in zip(pending, outcomes, strict=True):
        row = item.row
        if outcome == "inserted":
            inserted += 1
            # ingress first, decode later in the batch: one insert, then one replacement
            extra = int(item.first_is_ingress and row.source == DECODE)
            replaced += extra
            duplicates += item.num_rows - 1 - extra
            from_ingress += int(extra or row.source == INGRESS)
            from_decode += int(row.source == DECODE)
            hit, miss = hit + row.hit_pico_cny, miss + row.miss_pico_cny
            output += row.output_pico_cny
        elif outcome == "replaced":
            replaced += 1
            duplicates += item.num_rows - 1
            from_decode += 1  # only decode replaces
        else:
            duplicates += item.num_rows
    by_source = {DECODE: from_decode, INGRESS: from_ingress}
    return RecordResult(
        inserted, replaced, duplicates, tuple(by_source[s] for s in SOURCES), (hit, miss, output)
    )


def outcome_from_existing(existing_source: str | None, row: LedgerRow) -> Outcome:
    """What the upsert does to `row` given the source already stored (None: no row)."""
    if existing_source is None:
        return "inserted"
    if existing_source == INGRESS and row.source == DECODE:
        return "replaced"
    return "kept"


@dataclass(frozen=True, slots=True)
class ReportRow:
    """Sums over a group of rows: exact integers (tokens, and money in pico-CNY)."""

    key: str
    num_requests: int = 0
    num_cache_hit_tokens: int = 0
    num_cache_miss_tokens: int = 0
    num_output_tokens: int = 0
    hit_pico_cny: int = 0
    miss_pico_cny: int = 0
    output_pico_cny: int = 0
    total_pico_cny: int = 0

    @property
    def num_input_tokens(self) -> int:
        return self.num_cache_hit_tokens + self.num_cache_miss_tokens

    @property
    def num_tokens(self) -> int:
        return self.num_input_tokens + self.num_output_tokens

    def plus(self, other: ReportRow, key: str | None = None) -> ReportRow:
        """Both groups as one (keyed `key`, else this row's key)."""
        sums = (a + b for a, b in zip(astuple(self)[1:], astuple(other)[1:], strict=True))
        return ReportRow(self.key if key is None else key, *sums)
