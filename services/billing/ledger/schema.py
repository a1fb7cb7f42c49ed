"""Numbered migrations: services/billing/migrations/NNNN_name.sql, applied once each, in order.

A `schema_version` table holds the versions applied. Opening a ledger applies what is missing
inside one transaction, so a migration is all there or not at all (PostgreSQL and SQLite both
run DDL in transactions), and opening twice (or two replicas at once: the caller holds a lock
for the transaction) applies nothing the second time. A database newer than this code is
refused rather than written with the wrong columns.

A file is split into statements at semicolons, after `--` comments are removed: keep both
out of string literals.

Rolling upgrades: a migration whose file has the line `-- additive` (new tables, new columns
with defaults: nothing an older writer would get wrong) leaves the database writable by code
that predates it, so a billing replica of the previous version keeps running while a newer one
migrates. The database records which applied migrations are additive (`schema_version.additive`,
from migration 3 on); code that finds versions it does not know refuses only if one of them is
not additive.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from services.billing.ledger.rows import LedgerError

MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"
_NAME = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")
_COMMENT = re.compile(r"--[^\n]*")
_ADDITIVE = re.compile(r"^--\s*additive\s*$", re.MULTILINE)


class Cursor(Protocol):
    """What sqlite3's and psycopg's cursors both offer."""

    def execute(self, sql: Any, params: Any = ..., /) -> Any: ...
    def executemany(self, sql: Any, params_seq: Any, /) -> Any: ...
    def fetchall(self) -> list[Any]: ...


@dataclass(frozen=True, slots=True)
class Migration:
    version: int
    name: str
    sql: str

    @property
    def additive(self) -> bool:
        """Older code may keep writing after it (the file says `-- additive`)."""
        return bool(_ADDITIVE.search(self.sql))

    def statements(self) -> list[str]:
        text = _COMMENT.sub("", self.sql)
        return [s.strip() for s in text.split(";") if s.strip()]


def load_migrations(directory: Path = MIGRATIONS_DIR) -> list[Migration]:
    """The directory's migrations by version: numbered from 1, without gaps or repeats."""
    migrations = []
    for path in sorted(directory.glob("*.sql")):
        match = _NAME.match(path.name)
        if match is None:
            raise LedgerError(f"migration {path.name}: name it NNNN_lowercase_name.sql")
        migrations.append(Migration(int(match.group(1)), match.group(2), path.read_text()))
    versions = [m.version for m in migrations]
    if versions != list(range(1, len(versions) + 1)):
        raise LedgerError(f"migrations in {directory} must be numbered 1, 2, 3...: {versions}")
    return migrations


def apply_migrations(
    cursor: Cursor, migrations: list[Migration], *, param: str, now_ms: int
) -> list[int]:
    """Apply what the database lacks, in the caller's transaction; the versions applied.

    `param` is the driver's placeholder ("?" for sqlite3, "%s" for psycopg).
    """
    cursor.execute(
        "CREATE TABLE IF NOT EXISTS schema_version ("
        " version INTEGER PRIMARY KEY, name TEXT NOT NULL, applied_ms BIGINT NOT NULL)"
    )
    cursor.execute("SELECT version FROM schema_version")
    done = {int(row[0]) for row in cursor.fetchall()}
    known = {m.version for m in migrations}
    if unknown := done - known:
        # Newer than this code: the `additive` column exists (migration 3 added it).
        cursor.execute("SELECT version, additive FROM schema_version")
        breaking = sorted(
            int(v) for v, additive in cursor.fetchall() if v in unknown and not additive
        )
        if breaking:
            raise LedgerError(
                f"the ledger database is at schema version {max(done)}, newer than this code "
                f"knows ({max(known, default=0)}), and migration {breaking[0]} changed what "
                "this version writes: upgrade billing before it writes"
            )
    applied = []
    for migration in migrations:
        if migration.version in done:
            continue
        for statement in migration.statements():
            cursor.execute(statement)
        cursor.execute(
            f"INSERT INTO schema_version (version, name, applied_ms) "
            f"VALUES ({param}, {param}, {param})",
            (migration.version, migration.name, now_ms),
        )
        if migration.additive:
            cursor.execute(
                f"UPDATE schema_version SET additive = 1 WHERE version = {param}",
                (migration.version,),
            )
        applied.append(migration.version)
    return applied
