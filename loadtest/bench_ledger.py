"""Ledger write throughput: `Ledger.record`, and the billing service's whole path (usage
records pulled from JetStream by `UsageConsumer`, priced, committed, acknowledged), against a
bare batched INSERT of the same rows into the same database, SQLite and PostgreSQL, side by
side in one run; the ratios are printed (not asserted).

    python -m loadtest.bench_ledger [--num-rows 20000] [--batch-size 500] [--repeat 3]
        [--backends sqlite postgres] [--postgres-url postgresql://...]

Each measurement writes the rows in batches, one transaction (and commit) per batch, into a
fresh database (a new SQLite file; a new PostgreSQL schema). The bare INSERT into SQLite is
the faster of executemany and one multi-row INSERT per batch (what the ledger uses), so the
ratio is against the best a bare writer does. Each figure is the median of --repeat runs
(the machine is noisy). Without --postgres-url a throwaway server is started from the
machine's binaries, with fsync on, as production runs.
"""

from __future__ import annotations

import argparse
import sqlite3
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

from loadtest.results import BenchResult
from services.billing.ledger import COLUMNS, LedgerRow, open_ledger
from services.billing.ledger.sqlite import SqliteLedger
from services.billing.pricing import PriceBook, price
from shared.schema import UsageRecord

INSERT = f"INSERT INTO usage_ledger ({', '.join(COLUMNS)}) VALUES {{}}"


def make_rows(num_rows: int) -> list[LedgerRow]:
    book, t0 = PriceBook.default(), 1_736_899_200_000
    rows = []
    for i in range(num_rows):
        finished = t0 + i * 997
        record = UsageRecord(
            request_id=f"req-{uuid.uuid4().hex}",
            api_key_id=f"key-{i % 50}",
            model="tiny-coder",
            num_cache_hit_tokens=74_000 + i % 900,
            num_cache_miss_tokens=3_000 + i % 70,
            num_output_tokens=400 + i % 300,
            finish_reason="stop",
            started_ms=finished - 9000,
            finished_ms=finished,
            account=f"acct-{i % 20}",
        )
        charge = price(
            book,
            record.model,
            finished,
            record.num_cache_hit_tokens,
            record.num_cache_miss_tokens,
            record.num_output_tokens,
        )
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


def medians(repeat: int, measures: dict[str, Callable[[], float]]) -> dict[str, float]:
    """Each figure's median over `repeat` rounds; a round runs every measure once, so the
    figures compared are taken side by side, not minutes apart."""
    runs: dict[str, list[float]] = {name: [] for name in measures}
    for _ in range(repeat):
        for name, measure in measures.items():
            runs[name].append(measure())
    return {name: statistics.median(values) for name, values in runs.items()}


def bench_sqlite(rows: list[LedgerRow], size: int, repeat: int, result: BenchResult) -> None:
    def in_fresh_file(measure: Callable[[Path], float]) -> Callable[[], float]:
        def run() -> float:
            with tempfile.TemporaryDirectory(prefix="bench-ledger-") as directory:
                return measure(Path(directory))

        return run

    def ledger(directory: Path) -> float:
        ledger = SqliteLedger(str(directory / "ledger.db"))
        try:
            return timed(ledger.record, rows, size)
        finally:
            ledger.close()

    def bare(multi_row: bool) -> Callable[[Path], float]:
        def run(directory: Path) -> float:
            path = directory / "bare.db"
            open_ledger(f"sqlite:///{path}").close()  # the same table, indexes and checks
            conn = sqlite3.connect(path, isolation_level=None)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=FULL")
            one_row = f"({', '.join('?' * len(COLUMNS))})"

            def write(batch: Sequence[LedgerRow]) -> None:
                conn.execute("BEGIN IMMEDIATE")
                if multi_row:
                    sql = INSERT.format(", ".join([one_row] * len(batch)))
                    conn.execute(sql, [value for row in batch for value in row])
                else:
                    conn.executemany(INSERT.format(one_row), batch)
                conn.execute("COMMIT")

            try:
                return timed(write, rows, size)
            finally:
                conn.close()

        return run

    def service(directory: Path) -> float:
        return through_jetstream(records_of(rows), f"sqlite:///{directory}/service.db", size)

    results = medians(
        repeat,
        {
            "bare_executemany": in_fresh_file(bare(multi_row=False)),
            "bare_multi_row": in_fresh_file(bare(multi_row=True)),
            "ledger_record": in_fresh_file(ledger),
            "service": in_fresh_file(service),
        },
    )
    result.figure("sqlite: bare INSERT, executemany", results["bare_executemany"], "rows/s")
    result.figure(
        "sqlite: bare INSERT, one multi-row per batch", results["bare_multi_row"], "rows/s"
    )
    bare = max(results["bare_executemany"], results["bare_multi_row"])
    report("sqlite", results, bare, "the faster bare INSERT", result)


def report(
    backend: str, results: dict[str, float], bare: float, peer: str, result: BenchResult
) -> None:
    result.ratio(f"{backend}: Ledger.record", results["ledger_record"], bare, peer, "rows/s")
    result.ratio(
        f"{backend}: JetStream -> UsageConsumer -> ledger",
        results["service"],
        bare,
        peer,
        "records/s",
        0.5,
    )
    result.figure(
        f"{backend}: records/s into the ledger per billing process",
        results["service"],
        "records/s",
        5000,
    )


def bench_postgres(
    rows: list[LedgerRow], size: int, repeat: int, url: str, result: BenchResult
) -> None:
    import psycopg

    from shared.testing.postgres import schema_url

    def fresh() -> str:
        schema = f"bench_{uuid.uuid4().hex[:10]}"
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(f"CREATE SCHEMA {schema}")
        return schema_url(url, schema)

    def ledger() -> float:
        ledger = open_ledger(fresh())
        try:
            return timed(ledger.record, rows, size)
        finally:
            ledger.close()

    def bare() -> float:
        target = fresh()
        open_ledger(target).close()
        sql = INSERT.format(f"({', '.join(['%s'] * len(COLUMNS))})")
        with psycopg.connect(target, autocommit=True) as conn:

            def write(batch: Sequence[LedgerRow]) -> None:
                with conn.transaction(), conn.cursor() as cursor:
                    cursor.executemany(sql, batch)

            return timed(write, rows, size)

    results = medians(
        repeat,
        {
            "bare": bare,
            "ledger_record": ledger,
            "service": lambda: through_jetstream(records_of(rows), fresh(), size),
        },
    )
    report("postgres", results, results["bare"], "bare INSERT, executemany", result)


def through_jetstream(records: list[UsageRecord], ledger_url: str, size: int) -> float:
    """Records/s from a JetStream usage log into the ledger through the service's consumer,
    with the billing process's GIL switch interval (the records are published before timing
    starts; the time is until the last is in)."""
    import asyncio

    from services.billing.consumer import GIL_SWITCH_INTERVAL_S, UsageConsumer
    from shared.bus import Bus
    from shared.natsd import NatsServer
    from shared.usage import ensure_usage_stream

    async def run(url: str) -> float:
        bus = await Bus.connect(url, service="bench", root="bench.v1")
        await ensure_usage_stream(bus)
        subject = bus.subjects.usage("decode")
        for start in range(0, len(records), 1000):
            await asyncio.gather(
                *(
                    bus.js.publish(subject, r, msg_id=r.request_id)
                    for r in records[start : start + 1000]
                )
            )
        ledger = open_ledger(ledger_url)
        consumer = UsageConsumer(
            bus, ledger, PriceBook.default(), batch_size=size, fetch_timeout_s=0.2
        )
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

    interval = sys.getswitchinterval()
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    try:
        with (
            tempfile.TemporaryDirectory(prefix="bench-ledger-nats-") as directory,
            NatsServer(Path(directory)) as server,
        ):
            return asyncio.run(run(server.url))
    finally:
        sys.setswitchinterval(interval)


def records_of(rows: list[LedgerRow]) -> list[UsageRecord]:
    return [
        UsageRecord(
            request_id=r.request_id,
            api_key_id=r.api_key_id,
            model=r.model,
            num_cache_hit_tokens=r.num_cache_hit_tokens,
            num_cache_miss_tokens=r.num_cache_miss_tokens,
            num_output_tokens=r.num_output_tokens,
            finish_reason=r.finish_reason,
            started_ms=r.started_ms,
            finished_ms=r.finished_ms,
            account=r.account,
        )
        for r in rows
    ]


def run(
    quick: bool = False,
    *,
    num_rows: int | None = None,
    batch_size: int = 500,
    repeat: int | None = None,
    backends: tuple[str, ...] = ("sqlite", "postgres"),
    postgres_url: str | None = None,
) -> BenchResult:
    """Quick: 2,000 rows, one run each. PostgreSQL is skipped, with a note, where the
    machine has no PostgreSQL binaries and no --postgres-url is given."""
    num_rows = num_rows or (2000 if quick else 20_000)
    repeat = repeat or (1 if quick else 3)
    result = BenchResult("ledger", quick)
    rows = make_rows(num_rows)
    result.note(
        f"{num_rows:,} rows in batches of {batch_size}, one commit per batch, "
        f"median of {repeat} interleaved runs"
    )
    if "sqlite" in backends:
        bench_sqlite(rows, batch_size, repeat, result)
    if "postgres" in backends:
        if postgres_url:
            bench_postgres(rows, batch_size, repeat, postgres_url, result)
        else:
            from shared.testing.postgres import PostgresServer, PostgresUnavailable

            try:
                server = PostgresServer(fsync=True).start()
            except PostgresUnavailable as exc:
                result.note(f"postgres: skipped ({exc})")
            else:
                try:
                    bench_postgres(rows, batch_size, repeat, server.url, result)
                finally:
                    server.stop()
    return result.finish()


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--num-rows", type=int, default=None, help="default 20000")
    parser.add_argument("--batch-size", type=int, default=500)
    parser.add_argument("--repeat", type=int, default=None, help="runs per figure (the median)")
    parser.add_argument(
        "--backends", nargs="+", choices=["sqlite", "postgres"], default=["sqlite", "postgres"]
    )
    parser.add_argument("--postgres-url", help="an existing server; else a throwaway one")
    parser.add_argument("--quick", action="store_true", help="small sizes (CI)")
    args = parser.parse_args()
    run(
        args.quick,
        num_rows=args.num_rows,
        batch_size=args.batch_size,
        repeat=args.repeat,
        backends=tuple(args.backends),
        postgres_url=args.postgres_url,
    ).print()


if __name__ == "__main__":
    main()
