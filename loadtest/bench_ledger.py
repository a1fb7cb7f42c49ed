"""Ledger write throughput: `Ledger.record`, and the billing service's whole path (usage
records pulled from JetStream by `UsageConsumer`, priced, committed, acknowledged), against a
bare executemany INSERT of the same rows into the same database, SQLite and PostgreSQL,
printed (not asserted).

    python -m loadtest.bench_ledger [--num-rows 20000] [--batch-size 500]
        [--backends sqlite postgres] [--postgres-url postgresql://...]

Each measurement writes the rows in batches, one transaction (and commit) per batch, into a
fresh database (a new SQLite file; a new PostgreSQL schema). Without --postgres-url a
throwaway server is started from the machine's binaries, with fsync on, as production runs.
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

from services.billing.ledger import COLUMNS, LedgerRow, open_ledger
from services.billing.ledger.sqlite import SqliteLedger
from services.billing.pricing import PriceBook, price
from shared.schema import UsageRecord

INSERT = f"INSERT INTO usage_ledger ({', '.join(COLUMNS)}) VALUES ({{}})"


def make_rows(num_rows: int) -> list[LedgerRow]:
    book, t0 = PriceBook.default(), 1_736_899_200_000
    rows = []
    for i in range(num_rows):
        finished = t0 + i * 997
        record = UsageRecord(request_id=f"req-{uuid.uuid4().hex}", api_key_id=f"key-{i % 50}",
                             model="tiny-coder", num_cache_hit_tokens=74_000 + i % 900,
                             num_cache_miss_tokens=3_000 + i % 70, num_output_tokens=400 + i % 300,
                             finish_reason="stop", started_ms=finished - 9000,
                             finished_ms=finished, account=f"acct-{i % 20}")  # fmt: skip
        charge = price(book, record.model, finished, record.num_cache_hit_tokens,
                       record.num_cache_miss_tokens, record.num_output_tokens)  # fmt: skip
        rows.append(LedgerRow.of(record, source="decode" if i % 10 else "ingress", charge=charge))
    return rows


def timed(
    write: Callable[[Sequence[LedgerRow]], object], rows: list[LedgerRow], size: int
) -> float:
    """Rows per second through `write`, one call per batch."""
    started = time.perf_counter()
    for offset in range(0, len(rows), size):
        write(rows[offset : offset + size])
    return len(rows) / (time.perf_counter() - started)


def bench_sqlite(rows: list[LedgerRow], size: int, directory: Path) -> None:
    for synchronous in ("FULL", "NORMAL"):
        ledger = SqliteLedger(str(directory / f"ledger-{synchronous}.db"), synchronous=synchronous)
        rate = timed(ledger.record, rows, size)
        again = timed(ledger.record, rows, size)  # every row a duplicate: redelivery
        ledger.close()
        print(f"sqlite   Ledger.record (synchronous={synchronous:<6})  {rate:>9,.0f} rows/s   "
              f"(redelivered: {again:,.0f} rows/s)")  # fmt: skip
    path = directory / "bare.db"
    open_ledger(f"sqlite:///{path}").close()  # the same table, indexes and checks
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    sql = INSERT.format(", ".join("?" * len(COLUMNS)))

    def bare(batch: Sequence[LedgerRow]) -> None:
        conn.execute("BEGIN IMMEDIATE")
        conn.executemany(sql, [r.values() for r in batch])
        conn.execute("COMMIT")

    rate = timed(bare, rows, size)
    conn.close()
    print(f"sqlite   bare INSERT   (synchronous=FULL  )  {rate:>9,.0f} rows/s")


def bench_postgres(rows: list[LedgerRow], size: int, url: str) -> None:  # noqa: PLR0915
    import psycopg

    from shared.testing.postgres import schema_url

    def fresh() -> str:
        schema = f"bench_{uuid.uuid4().hex[:10]}"
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(f"CREATE SCHEMA {schema}")
        return schema_url(url, schema)

    ledger = open_ledger(fresh())
    rate = timed(ledger.record, rows, size)
    again = timed(ledger.record, rows, size)
    ledger.close()
    print(f"postgres Ledger.record                       {rate:>9,.0f} rows/s   "
          f"(redelivered: {again:,.0f} rows/s)")  # fmt: skip
    target = fresh()
    open_ledger(target).close()
    sql = INSERT.format(", ".join(["%s"] * len(COLUMNS)))
    with psycopg.connect(target, autocommit=True) as conn:

        def bare(batch: Sequence[LedgerRow]) -> None:
            with conn.transaction(), conn.cursor() as cursor:
                cursor.executemany(sql, [r.values() for r in batch])

        rate = timed(bare, rows, size)
    print(f"postgres bare INSERT                         {rate:>9,.0f} rows/s")
    rate = through_jetstream(records_of(rows), fresh(), size)
    print(f"postgres JetStream -> UsageConsumer -> ledger  {rate:>9,.0f} records/s")


def through_jetstream(records: list[UsageRecord], ledger_url: str, size: int) -> float:
    """Records/s from a JetStream usage log into the ledger through the service's consumer
    (the records are published before timing starts; the time is until the last is in)."""
    import asyncio

    from services.billing.consumer import UsageConsumer
    from shared.bus import Bus
    from shared.natsd import NatsServer
    from shared.usage import ensure_usage_stream

    async def run(url: str) -> float:
        bus = await Bus.connect(url, service="bench", root="bench.v1")
        await ensure_usage_stream(bus)
        subject = bus.subjects.usage("decode")
        await asyncio.gather(*(bus.js.publish(subject, r, msg_id=r.request_id) for r in records))
        ledger = open_ledger(ledger_url)
        consumer = UsageConsumer(bus, ledger, PriceBook.default(), batch_size=size,
                                 fetch_timeout_s=0.2)  # fmt: skip
        await consumer.start()
        started = time.perf_counter()
        task = asyncio.create_task(consumer.run())
        while consumer.counts.num_ledgered < len(records):
            await asyncio.sleep(0.01)
        rate = len(records) / (time.perf_counter() - started)
        await consumer.stop()
        await task
        ledger.close()
        await bus.close()
        return rate

    with (
        tempfile.TemporaryDirectory(prefix="bench-ledger-nats-") as directory,
        NatsServer(Path(directory)) as server,
    ):
        return asyncio.run(run(server.url))


def records_of(rows: list[LedgerRow]) -> list[UsageRecord]:
    return [UsageRecord(request_id=r.request_id, api_key_id=r.api_key_id, model=r.model,
                        num_cache_hit_tokens=r.num_cache_hit_tokens,
                        num_cache_miss_tokens=r.num_cache_miss_tokens,
                        num_output_tokens=r.num_output_tokens, finish_reason=r.finish_reason,
                        started_ms=r.started_ms, finished_ms=r.finished_ms, account=r.account)
            for r in rows]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--num-rows", type=int, default=20_000)
    parser.add_argument("--batch-size", type=int, default=500)
    parser.add_argument("--backends", nargs="+", choices=["sqlite", "postgres"],
                        default=["sqlite", "postgres"])  # fmt: skip
    parser.add_argument("--postgres-url", help="an existing server; else a throwaway one")
    args = parser.parse_args()
    rows = make_rows(args.num_rows)
    print(f"{args.num_rows:,} rows in batches of {args.batch_size}, one commit per batch")
    if "sqlite" in args.backends:
        with tempfile.TemporaryDirectory(prefix="bench-ledger-") as directory:
            bench_sqlite(rows, args.batch_size, Path(directory))
            rate = through_jetstream(records_of(rows), f"sqlite:///{directory}/service.db",
                                     args.batch_size)  # fmt: skip
            print(f"sqlite   JetStream -> UsageConsumer -> ledger  {rate:>9,.0f} records/s")
    if "postgres" in args.backends:
        if args.postgres_url:
            bench_postgres(rows, args.batch_size, args.postgres_url)
        else:
            from shared.testing.postgres import PostgresServer

            server = PostgresServer(fsync=True).start()
            try:
                bench_postgres(rows, args.batch_size, server.url)
            finally:
                server.stop()
    print(f"load average during the run: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
