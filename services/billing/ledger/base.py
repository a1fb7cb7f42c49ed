"""The ledger's behaviour, once for both databases; sqlite.py and postgres.py add the driver.

Synchronous and thread-safe (one connection per `Ledger`, used under a lock): billing calls
`record` from a worker thread, one batch at a time, and acknowledges the batch only after
it returns, so `record` commits before it returns or raises `LedgerError` with nothing of
the batch written.

Sums of money may pass BIGINT (2^63 pico-CNY is 9.2 million CNY, ~15 hours of the
reference deployment's revenue), and SQLite's SUM raises on overflow. So each report sums the
micro-CNY (value / 10^6) and the pico-CNY remainder (value % 10^6) apart and joins them in
Python: exact, whatever the total, with the same SQL in both databases.

Time reports group by the instant a request finished (`finished_ms`). "hour" and "day" are
read in a time zone (UTC unless given; any IANA zone): the database groups by UTC quarter
hour, and each quarter hour joins the local hour or day it falls in, so a zone with a
half-hour offset (Asia/Kolkata) or a DST change comes out right. An hour's key is its local
start with its offset ("2025-11-02T01:00-04:00", so the two 01:00s of a DST fall-back stay
apart), a day's is its local date ("2025-11-02"); rows come in time order. Account and model
rows come in key order.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import replace
from datetime import datetime
from pathlib import Path
from typing import Any, ClassVar, Literal, get_args
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from services.billing.ledger.rows import (
    COLUMNS,
    LedgerConfigError,
    LedgerError,
    LedgerRow,
    Outcome,
    Pending,
    RecordResult,
    ReportRow,
    plan,
    tally,
)
from services.billing.ledger.schema import (
    MIGRATIONS_DIR,
    Cursor,
    apply_migrations,
    load_migrations,
)
from services.billing.uptime import DeviceSpan

ReportBy = Literal["account", "model", "hour", "day"]
BUCKET_MS = 15 * 60 * 1000  # every zone in use today is offset from UTC by whole quarter hours
_MONEY = ("hit_pico_cny", "miss_pico_cny", "output_pico_cny", "total_pico_cny")
_SUMS = ", ".join(
    [
        "COUNT(*)",
        "SUM(num_cache_hit_tokens)",
        "SUM(num_cache_miss_tokens)",
        "SUM(num_output_tokens)",
    ]
    # the remainder without `%`, which psycopg reads as a placeholder
    + [f"SUM({c} / 1000000), SUM({c} - {c} / 1000000 * 1000000)" for c in _MONEY]
)
_GROUP = {
    "account": "account",
    "model": "model",
    "hour": f"finished_ms / {BUCKET_MS}",
    "day": f"finished_ms / {BUCKET_MS}",
}


class Ledger(ABC):
    param: ClassVar[str]  # the driver's placeholder
    least: ClassVar[str] = "LEAST"  # the two-argument min / max (SQLite: min, max)
    greatest: ClassVar[str] = "GREATEST"
    driver_errors: ClassVar[tuple[type[BaseException], ...]]  # what becomes a LedgerError

    def __init__(self, migrations_dir: Path = MIGRATIONS_DIR) -> None:
        self._lock = threading.Lock()
        try:
            migrations = load_migrations(migrations_dir)
            with self._lock, self._guarded("applying migrations"), self._transaction() as cursor:
                self._lock_for_migrations(cursor)
                self.migrations_applied = apply_migrations(
                    cursor, migrations, param=self.param, now_ms=int(time.time() * 1000)
                )
        except BaseException:
            self._close()  # a ledger that failed to open holds no connection
            raise

    # -- the driver ---------------------------------------------------------------------------

    @abstractmethod
    def _transaction(self, *, write: bool = True) -> AbstractContextManager[Cursor]:
        """A cursor in a transaction that commits on exit, or rolls back on an exception;
        `write=False` for one that only reads (it need not lock out writers)."""

    @abstractmethod
    def _lock_for_migrations(self, cursor: Cursor) -> None:
        """Keep another process from migrating the same database in the same moment."""

    @abstractmethod
    def _upsert(self, cursor: Cursor, pending: Sequence[Pending]) -> list[Outcome]:
        """Write each pending row under the rule (rows.py), one outcome per row."""

    @abstractmethod
    def _close(self) -> None: ...

    # -- writing ------------------------------------------------------------------------------

    def record(self, rows: Sequence[LedgerRow]) -> RecordResult:
        """Write a batch in ONE transaction, committed before this returns."""
        if not rows:
            return RecordResult()
        pending = plan(rows)
        guard = self._guarded(f"recording {len(rows)} rows (none written)")
        with self._lock, guard, self._transaction() as cursor:
            outcomes = self._upsert(cursor, pending)
        return tally(pending, outcomes)

    def record_device_spans(self, spans: Sequence[DeviceSpan]) -> None:
        """Merge heartbeat spans (uptime.py) into `device_usage`, in one transaction."""
        if not spans:
            return
        p, lo, hi = self.param, self.least, self.greatest
        sql = (
            "INSERT INTO device_usage (hour_ms, instance_id, service, model, num_devices, "
            f"first_ms, last_ms) VALUES ({', '.join([p] * 7)}) "
            "ON CONFLICT (hour_ms, instance_id) DO UPDATE SET "
            f"first_ms = {lo}(device_usage.first_ms, excluded.first_ms), "
            f"last_ms = {hi}(device_usage.last_ms, excluded.last_ms), "
            "num_devices = excluded.num_devices"
        )
        values = [
            (s.hour_ms, s.instance_id, s.service, s.model, s.num_devices, s.first_ms, s.last_ms)
            for s in spans
        ]
        guard = self._guarded(f"recording {len(spans)} device spans")
        with self._lock, guard, self._transaction() as cursor:
            cursor.executemany(sql, values)

    def device_ms(self, since_ms: int | None = None, until_ms: int | None = None) -> int:
        """Device time in the hours starting in [since_ms, until_ms), in milliseconds."""
        clauses, params = self._between(since_ms, until_ms, column="hour_ms")
        where = f"WHERE {clauses}" if clauses else ""
        total = "COALESCE(SUM((last_ms - first_ms) * num_devices), 0)"
        sql = f"SELECT {total} FROM device_usage {where}"
        return int(self._query(sql, params)[0][0])

    # -- reading ------------------------------------------------------------------------------

    def report(
        self,
        by: ReportBy,
        since_ms: int | None = None,
        until_ms: int | None = None,
        *,
        time_zone: str = "UTC",
    ) -> list[ReportRow]:
        """Sums per account, model, hour or day of requests finished in [since_ms, until_ms)."""
        if by not in get_args(ReportBy):
            raise LedgerConfigError(f"report by must be one of {get_args(ReportBy)}, got {by!r}")
        try:
            zone = ZoneInfo(time_zone)
        except (ZoneInfoNotFoundError, ValueError) as exc:
            raise LedgerConfigError(f"time_zone must be an IANA zone, got {time_zone!r}") from exc
        where, params = self._between(since_ms, until_ms)
        rows = self._sums(_GROUP[by], where, params)
        if by in ("account", "model"):
            return rows
        merged: dict[str, tuple[float, ReportRow]] = {}
        for row in rows:
            order, key = _local_key(int(row.key), by, zone)
            seen = merged.get(key)
            merged[key] = (order, seen[1].plus(row) if seen else replace(row, key=key))
        return [row for _, row in sorted(merged.values(), key=lambda item: item[0])]

    def usage(self, account: str) -> list[ReportRow]:
        """One account's sums, by model."""
        return self._sums("model", f"account = {self.param}", [account])

    def schema_versions(self) -> list[int]:
        """The migrations this database has had, in order."""
        rows = self._query("SELECT version FROM schema_version ORDER BY version", [])
        return [int(version) for (version,) in rows]

    def count(self) -> int:
        return int(self._query("SELECT COUNT(*) FROM usage_ledger", [])[0][0])

    def get(self, request_id: str) -> LedgerRow | None:
        """The row the ledger keeps for this request, if any."""
        sql = f"SELECT {', '.join(COLUMNS)} FROM usage_ledger WHERE request_id = {self.param}"
        found = self._query(sql, [request_id])
        return LedgerRow(*found[0]) if found else None

    def close(self) -> None:
        """Safe to call twice."""
        with self._lock:
            self._close()

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- helpers ------------------------------------------------------------------------------

    def _guarded(self, doing: str) -> AbstractContextManager[None]:
        return _Guard(doing, self.driver_errors)

    def _between(
        self, since_ms: int | None, until_ms: int | None, *, column: str = "finished_ms"
    ) -> tuple[str, list[Any]]:
        clauses, params = [], []
        if since_ms is not None:
            clauses.append(f"{column} >= {self.param}")
            params.append(since_ms)
        if until_ms is not None:
            clauses.append(f"{column} < {self.param}")
            params.append(until_ms)
        return " AND ".join(clauses), params

    def _sums(self, group: str, where: str, params: list[Any]) -> list[ReportRow]:
        sql = (
            f"SELECT {group}, {_SUMS} FROM usage_ledger {'WHERE ' + where if where else ''} "
            f"GROUP BY {group} ORDER BY {group}"
        )
        return [_report_row(values) for values in self._query(sql, params)]

    def _query(self, sql: str, params: list[Any]) -> list[Any]:
        guard = self._guarded("reading the ledger")
        with self._lock, guard, self._transaction(write=False) as cursor:
            cursor.execute(sql, params)
            return cursor.fetchall()


class _Guard(AbstractContextManager[None]):
    """Driver errors (and a value too big for BIGINT) become one `LedgerError`."""

    def __init__(self, doing: str, errors: tuple[type[BaseException], ...]) -> None:
        self.doing, self.errors = doing, errors + (OverflowError,)

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, _: Any) -> None:
        if exc is not None and isinstance(exc, self.errors):
            raise LedgerError(f"{self.doing}: {type(exc).__name__}: {exc}") from exc


def _report_row(values: Sequence[Any]) -> ReportRow:
    key, num_requests, hit, miss, output, *money = values
    joined = [int(money[i]) * 10**6 + int(money[i + 1]) for i in range(0, len(money), 2)]
    return ReportRow(str(key), int(num_requests), int(hit), int(miss), int(output), *joined)


def _local_key(bucket: int, by: str, zone: ZoneInfo) -> tuple[float, str]:
    """(order, key) of the local hour or day a UTC quarter hour falls in."""
    local = datetime.fromtimestamp(bucket * BUCKET_MS // 1000, zone)
    if by == "hour":
        start = local.replace(minute=0, second=0, microsecond=0)  # keeps `fold`: DST repeats
        return start.timestamp(), start.isoformat(timespec="minutes")
    return float(local.date().toordinal()), local.date().isoformat()
