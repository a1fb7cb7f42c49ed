"""The billing ledger: one row per request, in SQLite (embedded) or PostgreSQL (production).

`open_ledger(url)` opens it and applies the migrations; `Ledger.record(rows)` writes a batch
in one transaction; `report`, `usage` and `count` read it. See base.py for the behaviour,
rows.py for the one-row-per-request rule.
"""

from __future__ import annotations

from pathlib import Path

from services.billing.ledger.base import BUCKET_MS, Ledger, ReportBy
from services.billing.ledger.rows import (
    ANONYMOUS,
    COLUMNS,
    DECODE,
    INGRESS,
    SOURCES,
    LedgerConfigError,
    LedgerError,
    LedgerRow,
    RecordResult,
    ReportRow,
)
from services.billing.ledger.schema import MIGRATIONS_DIR

SQLITE_PREFIX = "sqlite:///"
POSTGRES_PREFIXES = ("postgresql://", "postgres://")


def open_ledger(
    url: str, *, migrations_dir: Path = MIGRATIONS_DIR, must_exist: bool = False
) -> Ledger:
    """`sqlite:///relative.db`, `sqlite:////absolute/path.db`, `sqlite:///:memory:`, or a
    libpq URL `postgresql://user@host:port/db[?options]`. `must_exist`: a SQLite file that
    is not there is an error, not a new empty ledger (a reader's typo must not make one)."""
    if url.startswith(SQLITE_PREFIX):
        from services.billing.ledger.sqlite import SqliteLedger

        path = url[len(SQLITE_PREFIX) :]
        if not path:
            raise LedgerConfigError(f"ledger url {url!r} names no file")
        if must_exist and path != ":memory:" and not Path(path).is_file():
            raise LedgerConfigError(
                f"no ledger at {path} (billing creates it on start; or pass --ledger-url)"
            )
        return SqliteLedger(path, migrations_dir=migrations_dir)
    if url.startswith(POSTGRES_PREFIXES):
        from services.billing.ledger.postgres import PostgresLedger  # psycopg only when used

        return PostgresLedger(url, migrations_dir=migrations_dir)
    raise LedgerConfigError(
        f"ledger url {url!r} must start with {SQLITE_PREFIX} or {POSTGRES_PREFIXES[0]}"
    )


__all__ = [
    "ANONYMOUS",
    "BUCKET_MS",
    "COLUMNS",
    "DECODE",
    "INGRESS",
    "MIGRATIONS_DIR",
    "Ledger",
    "LedgerConfigError",
    "LedgerError",
    "LedgerRow",
    "RecordResult",
    "ReportBy",
    "ReportRow",
    "SOURCES",
    "open_ledger",
]
