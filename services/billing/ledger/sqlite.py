"""The embedded ledger: one SQLite file, WAL mode, synchronous=FULL.

WAL lets reports read while billing writes. synchronous=FULL, not NORMAL: billing acknowledges
a batch to JetStream as soon as `record` returns, and under NORMAL a committed WAL frame may
still be lost at a power cut (not at a process crash), which would lose records JetStream
has already let go of. FULL costs one fsync of the WAL per commit, i.e. per batch of ~500
rows (the figures are in loadtest/bench_ledger.py's output).

Writers take the database's one write lock at BEGIN IMMEDIATE (waiting up to `busy_timeout_s`
for another process's batch), so a second billing process on the same file queues instead of
failing. Inside that lock nobody else writes, so the counts (`RecordResult`) come from
reading which of the batch's ids already have a row; the row kept is still decided by the
upsert itself.
"""

from __future__ import annotations

import functools
import sqlite3
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import ClassVar

from services.billing.ledger.base import Ledger
from services.billing.ledger.rows import (
    COLUMNS,
    LedgerConfigError,
    LedgerError,
    Outcome,
    Pending,
    outcome_from_existing,
)
from services.billing.ledger.schema import MIGRATIONS_DIR, Cursor

SYNCHRONOUS_MODES = ("FULL", "EXTRA", "NORMAL")
_READ_CHUNK = 500  # ids per IN (...) list: far under SQLite's 32,766 bound variables

_ROWS_PER_INSERT = 1000  # x 24 columns: under SQLite's 32,766 bound variables


@functools.cache
def upsert_sql(num_rows: int) -> str:
    """One INSERT of `num_rows` rows under the rule (rows.py). One statement, not executemany:
    sqlite3 releases the GIL around each step of a statement, and an executemany of 500 rows
    is 500 steps, each waiting for the GIL back from the event loop's thread; one statement
    is one step (measured: the billing service 19K -> 23K records/s)."""
    row = f"({', '.join('?' * len(COLUMNS))})"
    return (
        f"INSERT INTO usage_ledger ({', '.join(COLUMNS)}) VALUES {', '.join([row] * num_rows)} "
        "ON CONFLICT (request_id) DO UPDATE SET "
        + ", ".join(f"{c} = excluded.{c}" for c in COLUMNS[1:])
        + " WHERE usage_ledger.source = 'ingress' AND excluded.source = 'decode'"
    )


class SqliteLedger(Ledger):
    param: ClassVar[str] = "?"
    least: ClassVar[str] = "min"
    greatest: ClassVar[str] = "max"
    driver_errors: ClassVar[tuple[type[BaseException], ...]] = (sqlite3.Error,)

    def __init__(
        self,
        path: str,
        *,
        migrations_dir: Path = MIGRATIONS_DIR,
        busy_timeout_s: float = 30.0,
        synchronous: str = "FULL",
    ) -> None:
        if synchronous not in SYNCHRONOUS_MODES:
            raise LedgerConfigError(f"synchronous must be one of {SYNCHRONOUS_MODES}")
        self.path = path
        self._conn: sqlite3.Connection | None = None
        try:
            if path != ":memory:":
                Path(path).parent.mkdir(parents=True, exist_ok=True)
            # isolation_level=None: sqlite3 opens no transactions of its own; ours are explicit
            self._conn = sqlite3.connect(
                path, timeout=busy_timeout_s, isolation_level=None, check_same_thread=False
            )
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute(f"PRAGMA synchronous={synchronous}")
        except (OSError, sqlite3.Error) as exc:
            self._close()
            raise LedgerError(f"opening the ledger {path}: {exc}") from exc
        super().__init__(migrations_dir)

    @contextmanager
    def _transaction(self, *, write: bool = True) -> Iterator[Cursor]:
        if self._conn is None:
            raise sqlite3.ProgrammingError("the ledger is closed")
        cursor = self._conn.cursor()
        cursor.execute("BEGIN IMMEDIATE" if write else "BEGIN")
        try:
            yield cursor
            cursor.execute("COMMIT")
        except BaseException:
            if self._conn.in_transaction:
                self._conn.execute("ROLLBACK")
            raise
        finally:
            cursor.close()

    def _lock_for_migrations(self, cursor: Cursor) -> None:
        """BEGIN IMMEDIATE already holds the file's write lock."""

    def _upsert(self, cursor: Cursor, pending: Sequence[Pending]) -> list[Outcome]:
        ids = [p.row.request_id for p in pending]
        existing: dict[str, str] = {}
        for start in range(0, len(ids), _READ_CHUNK):
            chunk = ids[start : start + _READ_CHUNK]
            cursor.execute(
                "SELECT request_id, source FROM usage_ledger "
                f"WHERE request_id IN ({', '.join('?' * len(chunk))})",
                chunk,
            )
            existing.update(cursor.fetchall())
        outcomes = [outcome_from_existing(existing.get(p.row.request_id), p.row) for p in pending]
        for start in range(0, len(pending), _ROWS_PER_INSERT):
            chunk = pending[start : start + _ROWS_PER_INSERT]
            cursor.execute(upsert_sql(len(chunk)), [v for p in chunk for v in p.row])
        return outcomes

    def _close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()
