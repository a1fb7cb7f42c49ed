"""The production ledger: PostgreSQL through psycopg 3, shared by every billing replica.

A batch is ONE statement: the rows go as one array per column, `unnest`ed into an
INSERT ... ON CONFLICT (request_id) DO UPDATE ... WHERE (decode over ingress), so a batch of
500 costs one round trip instead of 500. Two replicas racing on one id are settled by the
database: the second INSERT waits for the first's transaction on the primary key, then
either replaces the row (decode over ingress) or leaves it. Rows go in request-id order
(rows.plan) so overlapping batches lock ids in the same order and never deadlock.

`RETURNING (xmax = 0)` tells an inserted row (no prior version) from a replaced one; a row
the WHERE left alone returns nothing. A dropped connection (a database restart) is replaced
at the next call; the batch that saw it fails whole and JetStream delivers it again.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import ClassVar

import psycopg

from services.billing.ledger.base import Ledger
from services.billing.ledger.rows import COLUMNS, TEXT_COLUMNS, Outcome, Pending
from services.billing.ledger.schema import MIGRATIONS_DIR, Cursor

MIGRATION_LOCK_KEY = 0x6B76_6662_696C_6C00  # "kvfbill\0": one advisory lock for migrations
_CASTS = ", ".join(f"%s::{'text' if c in TEXT_COLUMNS else 'bigint'}[]" for c in COLUMNS)

UPSERT_SQL = (
    f"INSERT INTO usage_ledger ({', '.join(COLUMNS)}) "
    f"SELECT {', '.join(COLUMNS)} FROM unnest({_CASTS}) "
    f"WITH ORDINALITY AS batch ({', '.join(COLUMNS)}, position) ORDER BY position "
    "ON CONFLICT (request_id) DO UPDATE SET "
    + ", ".join(f"{c} = EXCLUDED.{c}" for c in COLUMNS[1:])
    + " WHERE usage_ledger.source = 'ingress' AND EXCLUDED.source = 'decode' "
    "RETURNING request_id, (xmax = 0) AS inserted"
)


class PostgresLedger(Ledger):
    param: ClassVar[str] = "%s"
    driver_errors: ClassVar[tuple[type[BaseException], ...]] = (psycopg.Error,)

    def __init__(
        self, url: str, *, migrations_dir: Path = MIGRATIONS_DIR, connect_timeout_s: int = 10
    ) -> None:
        self.url = url
        self.connect_timeout_s = connect_timeout_s
        self._conn: psycopg.Connection | None = None
        self._closed = False
        super().__init__(migrations_dir)

    def _connection(self) -> psycopg.Connection:
        if self._closed:
            raise psycopg.InterfaceError("the ledger is closed")
        if self._conn is None or self._conn.closed or self._conn.broken:
            # autocommit: every transaction is the explicit `conn.transaction()` below
            self._conn = psycopg.connect(
                self.url, autocommit=True, connect_timeout=self.connect_timeout_s
            )
        return self._conn

    @contextmanager
    def _transaction(self, *, write: bool = True) -> Iterator[Cursor]:
        conn = self._connection()
        with conn.transaction(), conn.cursor() as cursor:
            yield cursor

    def _lock_for_migrations(self, cursor: Cursor) -> None:
        # Two replicas starting at once would both find the tables missing.
        cursor.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK_KEY,))

    def _upsert(self, cursor: Cursor, pending: Sequence[Pending]) -> list[Outcome]:
        values = [p.row.values() for p in pending]
        cursor.execute(UPSERT_SQL, [list(column) for column in zip(*values, strict=True)])
        written = dict(cursor.fetchall())  # request_id -> inserted (else replaced)
        return [
            "kept"
            if (new := written.get(p.row.request_id)) is None
            else "inserted"
            if new
            else "replaced"
            for p in pending
        ]

    def _close(self) -> None:
        self._closed = True
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()
