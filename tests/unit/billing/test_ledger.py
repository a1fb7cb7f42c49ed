"""The ledger, one suite run against SQLite and a real PostgreSQL server."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest

from services.billing.ledger import (
    ANONYMOUS,
    MIGRATIONS_DIR,
    Ledger,
    LedgerConfigError,
    LedgerError,
    LedgerRow,
    RecordResult,
    ReportRow,
    open_ledger,
)
from services.billing.pricing import PriceBook, price
from shared.schema import UsageRecord, UsageStatus
from shared.testing.postgres import postgres_schema_url, postgres_url  # noqa: F401 (fixtures)

BOOK = PriceBook.default()
T0 = int(datetime(2025, 1, 15, tzinfo=ZoneInfo("UTC")).timestamp() * 1000)
HOUR_MS = 3_600_000


def row(
    request_id: str,
    source: str = "decode",
    *,
    account: str = "acme",
    api_key_id: str = "key-1",
    model: str = "tiny-coder",
    hit: int = 900,
    miss: int = 100,
    output: int = 50,
    finished_ms: int = T0,
) -> LedgerRow:
    record = UsageRecord(
        request_id=request_id,
        api_key_id=api_key_id,
        model=model,
        num_cache_hit_tokens=hit,
        num_cache_miss_tokens=miss,
        num_output_tokens=output,
        status=UsageStatus.COMPLETED,
        finish_reason="stop",
        started_ms=finished_ms - 1000,
        finished_ms=finished_ms,
        prefill_worker_id="prefill-0",
        decode_worker_id="decode-0",
        account=account,
    )
    charge = price(BOOK, model, finished_ms, hit, miss, output)
    return LedgerRow.of(record, source=source, charge=charge, recorded_ms=finished_ms + 5)


@pytest.fixture(params=["sqlite", "postgres"])
def ledger_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'billing' / 'ledger.db'}"
    return str(request.getfixturevalue("postgres_schema_url"))


@pytest.fixture
def ledger(ledger_url: str) -> Iterator[Ledger]:
    opened = open_ledger(ledger_url)
    yield opened
    opened.close()


def test_migrations_are_applied_once(ledger_url: str) -> None:
    first = open_ledger(ledger_url)
    assert first.migrations_applied == list(range(1, NEXT))
    first.record([row("r1")])
    first.close()
    again = open_ledger(ledger_url)
    assert again.migrations_applied == []
    assert again.schema_versions() == list(range(1, NEXT))
    assert again.count() == 1
    again.close()
    again.close()  # safe twice


NEXT = len(list(MIGRATIONS_DIR.glob("*.sql"))) + 1  # what a newer billing would add


def _with(tmp_path: Path, name: str, sql: str) -> Path:
    """This code's migrations and one more: what a newer version of billing would carry."""
    newer = tmp_path / "migrations"
    newer.mkdir()
    for migration in MIGRATIONS_DIR.glob("*.sql"):
        (newer / migration.name).write_text(migration.read_text())
    (newer / name).write_text(sql)
    return newer


def test_a_new_migration_is_applied_and_a_newer_database_refused(
    ledger_url: str, tmp_path: Path
) -> None:
    open_ledger(ledger_url).close()
    newer = _with(
        tmp_path,
        f"{NEXT:04d}_note.sql",
        "-- a test column\nALTER TABLE usage_ledger ADD COLUMN note TEXT;",
    )
    upgraded = open_ledger(ledger_url, migrations_dir=newer)
    assert upgraded.migrations_applied == [NEXT]
    assert upgraded.schema_versions() == list(range(1, NEXT + 1))
    upgraded.close()
    with pytest.raises(LedgerError, match=f"schema version {NEXT}, newer than this code knows"):
        open_ledger(ledger_url)


def test_an_additive_migration_leaves_the_ledger_writable_by_the_older_version(
    ledger_url: str, tmp_path: Path
) -> None:
    """A rolling upgrade: the new billing migrates, the old one (this code) keeps writing."""
    newer = _with(
        tmp_path,
        f"{NEXT:04d}_note.sql",
        "-- additive\nALTER TABLE usage_ledger ADD COLUMN note TEXT DEFAULT NULL;",
    )
    open_ledger(ledger_url, migrations_dir=newer).close()
    older = open_ledger(ledger_url)
    assert older.migrations_applied == []
    older.record([row("r1")])
    assert older.count() == 1 and older.get("r1") == row("r1")
    older.close()


def test_duplicates_and_redelivery_leave_one_row_per_request(ledger: Ledger) -> None:
    first = ledger.record([row("r1"), row("r1"), row("r2"), row("r1")])
    assert first == RecordResult(num_inserted=2, num_replaced=0, num_duplicates=2)
    redelivered = ledger.record([row("r2"), row("r1"), row("r3")])
    assert redelivered == RecordResult(num_inserted=1, num_replaced=0, num_duplicates=2)
    assert ledger.count() == 3
    assert ledger.record([]) == RecordResult()


def test_decode_replaces_ingress_and_never_the_other_way(ledger: Ledger) -> None:
    estimate, counted = row("r1", "ingress", output=10), row("r1", "decode", output=42)
    assert ledger.record([estimate]) == RecordResult(1, 0, 0)
    assert ledger.record([counted]) == RecordResult(0, 1, 0)
    assert ledger.get("r1") == counted
    assert ledger.record([estimate]) == RecordResult(0, 0, 1)  # late caller's estimate: kept
    assert ledger.record([counted]) == RecordResult(0, 0, 1)
    assert ledger.get("r1") == counted
    stored = ledger.get("r1")
    assert stored is not None and stored.num_output_tokens == 42 and stored.source == "decode"


def test_both_sources_in_one_batch_count_as_if_recorded_in_order(ledger: Ledger) -> None:
    result = ledger.record(
        [
            row("a", "ingress"),
            row("a", "decode", output=7),
            row("b", "decode", output=8),
            row("b", "ingress"),
        ]
    )
    assert result == RecordResult(num_inserted=2, num_replaced=1, num_duplicates=1)
    a, b = ledger.get("a"), ledger.get("b")
    assert a is not None and (a.source, a.num_output_tokens) == ("decode", 7)
    assert b is not None and (b.source, b.num_output_tokens) == ("decode", 8)


def test_the_result_says_what_was_ledgered_by_source_and_the_new_rows_money(
    ledger: Ledger,
) -> None:
    """For billing's metrics: rows taken per source (SOURCES order: decode, ingress), and the
    money (hit, miss, output pico-CNY) of the request ids new to the ledger."""
    a_estimate, a_counted = row("a", "ingress", output=10), row("a", "decode", output=7)
    b = row("b", "decode", output=8)
    first = ledger.record([a_estimate, b, b])
    assert first.num_ledgered_by_source == (1, 1)  # b from decode, a's estimate from ingress
    money = [
        sum(getattr(r, f"{kind}_pico_cny") for r in (a_estimate, b))
        for kind in ("hit", "miss", "output")
    ]
    assert list(first.inserted_pico_cny) == money and money[2] > 0
    second = ledger.record([a_counted, row("c", "ingress"), b])
    assert (second.num_inserted, second.num_replaced, second.num_duplicates) == (1, 1, 1)
    assert second.num_ledgered_by_source == (1, 1)  # a replaced by decode, c from ingress
    c = row("c", "ingress")
    assert second.inserted_pico_cny == (c.hit_pico_cny, c.miss_pico_cny, c.output_pico_cny)
    both = first + second
    assert both.num_ledgered_by_source == (2, 2)
    assert both.inserted_pico_cny == tuple(
        x + y for x, y in zip(first.inserted_pico_cny, second.inserted_pico_cny, strict=True)
    )


def test_the_row_comes_back_column_for_column(ledger: Ledger) -> None:
    original = row("r1", "ingress")._replace(finish_reason=None, status="cancelled")
    ledger.record([original])
    assert ledger.get("r1") == original
    assert ledger.get("absent") is None


def test_account_falls_back_to_the_key_then_anonymous() -> None:
    assert row("r", account="", api_key_id="key-9").account == "key-9"
    assert row("r", account="", api_key_id="").account == ANONYMOUS
    assert row("r", account="acme", api_key_id="").account == "acme"
    with pytest.raises(LedgerConfigError, match="source"):
        row("r", "router")


def test_racing_replicas_end_with_decode_rows(ledger_url: str) -> None:
    """An ingress writer and two decode writers (one a redelivery) on the same ids, each on
    its own connection, batches meeting from opposite ends."""
    num_ids, batch = 1200, 100
    ids = [f"req-{i:05d}" for i in range(num_ids)]
    plans = {
        "ingress": [row(i, "ingress", output=1) for i in ids],
        "decode": [row(i, "decode", output=2) for i in reversed(ids)],
        "decode-again": [row(i, "decode", output=2) for i in ids],
    }
    ledgers = {name: open_ledger(ledger_url) for name in plans}
    results = dict.fromkeys(plans, RecordResult())
    errors: list[BaseException] = []
    start = threading.Barrier(len(plans))

    def write(name: str) -> None:
        try:
            start.wait()
            rows = plans[name]
            for offset in range(0, len(rows), batch):
                results[name] += ledgers[name].record(rows[offset : offset + batch])
        except BaseException as exc:  # reported below, with the thread's name
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(name,)) for name in plans]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors, errors
    reader = ledgers["ingress"]
    assert reader.count() == num_ids
    assert all(reader.get(i).source == "decode" for i in ids[::97])  # type: ignore[union-attr]
    assert reader.report("model")[0].num_output_tokens == 2 * num_ids  # every row decode's
    ingress, decode, again = results["ingress"], results["decode"], results["decode-again"]
    assert ingress.num_replaced == 0 and ingress.num_inserted + ingress.num_duplicates == num_ids
    # exactly one decode row takes each id, by insert or by replacing the caller's
    decode_took = (
        decode.num_inserted + decode.num_replaced + again.num_inserted + again.num_replaced
    )
    assert decode_took == num_ids
    assert decode.num_replaced + again.num_replaced == ingress.num_inserted
    for ledger in ledgers.values():
        ledger.close()


def test_a_failed_batch_leaves_nothing(ledger: Ledger) -> None:
    good = [row(f"r{i}") for i in range(100)]
    negative = row("bad")._replace(num_output_tokens=-1)  # the CHECK refuses it
    with pytest.raises(LedgerError, match="none written"):
        ledger.record(good[:50] + [negative] + good[50:])
    assert ledger.count() == 0
    too_big = row("big")._replace(output_pico_cny=2**63, total_pico_cny=2**63)
    with pytest.raises(LedgerError, match="none written"):
        ledger.record(good + [too_big])
    assert ledger.count() == 0
    assert ledger.record(good) == RecordResult(100, 0, 0)  # the ledger still works after
    assert ledger.count() == 100


def test_ten_thousand_rows_in_one_call(ledger: Ledger) -> None:
    rows = [row(f"bulk-{i}", "ingress" if i % 3 else "decode", output=i) for i in range(10_000)]
    assert ledger.record(rows) == RecordResult(10_000, 0, 0)
    assert ledger.count() == 10_000
    [only] = ledger.report("account")
    assert only.num_requests == 10_000
    assert only.num_output_tokens == sum(range(10_000))
    assert only.total_pico_cny == sum(r.total_pico_cny for r in rows)


def test_reports_by_account_and_model_are_exact_sums(ledger: Ledger) -> None:
    rows = [
        row("a1", account="acme", model="m1", hit=10, miss=1, output=3),
        row("a2", account="acme", model="m2", hit=20, miss=2, output=4),
        row("b1", account="beta", model="m1", hit=30, miss=3, output=5),
    ]
    ledger.record(rows)
    by_account = {r.key: r for r in ledger.report("account")}
    assert list(by_account) == ["acme", "beta"]
    acme = by_account["acme"]
    assert (
        acme.num_requests,
        acme.num_cache_hit_tokens,
        acme.num_cache_miss_tokens,
        acme.num_output_tokens,
    ) == (2, 30, 3, 7)
    assert acme.hit_pico_cny == 30 * 20_000 and acme.miss_pico_cny == 3 * 1_000_000
    assert acme.output_pico_cny == 7 * 4_000_000
    assert acme.total_pico_cny == rows[0].total_pico_cny + rows[1].total_pico_cny
    by_model = {r.key: r for r in ledger.report("model")}
    assert by_model["m1"].num_requests == 2 and by_model["m1"].num_output_tokens == 8
    assert [r.key for r in ledger.usage("acme")] == ["m1", "m2"]
    assert ledger.usage("acme")[1].total_pico_cny == rows[1].total_pico_cny
    assert ledger.usage("nobody") == []


def test_sums_past_bigint_stay_exact(ledger: Ledger) -> None:
    """Each row fits BIGINT; their sum (1.4e19 pico-CNY) does not."""
    huge = [
        row(f"h{i}")._replace(
            hit_pico_cny=2**62, miss_pico_cny=0, output_pico_cny=7, total_pico_cny=2**62 + 7
        )
        for i in range(3)
    ]
    ledger.record(huge)
    [total] = ledger.report("account")
    assert total.total_pico_cny == 3 * (2**62 + 7)
    assert total.hit_pico_cny == 3 * 2**62


def test_reports_by_hour_and_day_in_utc_and_filtered(ledger: Ledger) -> None:
    ledger.record(
        [
            row("h0a", finished_ms=T0 + 5 * 60_000),
            row("h0b", finished_ms=T0 + HOUR_MS - 1),
            row("h1", finished_ms=T0 + HOUR_MS),
            row("d1", finished_ms=T0 + 24 * HOUR_MS),
        ]
    )
    hours = ledger.report("hour")
    assert [(r.key, r.num_requests) for r in hours] == [
        ("2025-01-15T00:00+00:00", 2),
        ("2025-01-15T01:00+00:00", 1),
        ("2025-01-16T00:00+00:00", 1),
    ]
    days = ledger.report("day")
    assert [(r.key, r.num_requests) for r in days] == [("2025-01-15", 3), ("2025-01-16", 1)]
    window = ledger.report("hour", since_ms=T0 + HOUR_MS - 1, until_ms=T0 + 24 * HOUR_MS)
    assert [(r.key, r.num_requests) for r in window] == [
        ("2025-01-15T00:00+00:00", 1),
        ("2025-01-15T01:00+00:00", 1),
    ]


def test_reports_in_a_time_zone_follow_its_offsets(ledger: Ledger) -> None:
    # 16:30 UTC is 00:30 the next day in Beijing; Kolkata is +05:30 (half-hour buckets)
    ledger.record([row("x", finished_ms=T0 + 16 * HOUR_MS + 30 * 60_000)])
    assert [r.key for r in ledger.report("day", time_zone="Asia/Shanghai")] == ["2025-01-16"]
    assert [r.key for r in ledger.report("hour", time_zone="Asia/Kolkata")] == [
        "2025-01-15T22:00+05:30"
    ]
    # New York's fall-back: 01:30 EDT and 01:30 EST are two hours with their own keys
    fall = int(datetime(2025, 11, 2, 5, 30, tzinfo=ZoneInfo("UTC")).timestamp() * 1000)
    ledger.record([row("edt", finished_ms=fall), row("est", finished_ms=fall + HOUR_MS)])
    hours = ledger.report("hour", since_ms=fall - HOUR_MS, time_zone="America/New_York")
    assert [r.key for r in hours] == ["2025-11-02T01:00-04:00", "2025-11-02T01:00-05:00"]
    days = ledger.report("day", since_ms=fall - HOUR_MS, time_zone="America/New_York")
    assert [(r.key, r.num_requests) for r in days] == [("2025-11-02", 2)]


def test_bad_arguments_are_typed_errors(ledger: Ledger, tmp_path: Path) -> None:
    with pytest.raises(LedgerConfigError, match="report by"):
        ledger.report("week")  # type: ignore[arg-type]
    with pytest.raises(LedgerConfigError, match="time_zone"):
        ledger.report("day", time_zone="Nowhere/Land")
    with pytest.raises(LedgerConfigError, match="must start with"):
        open_ledger(f"mysql://{tmp_path}")
    (tmp_path / "taken").write_text("a file, not a directory")
    with pytest.raises(LedgerError, match="opening the ledger"):
        open_ledger(f"sqlite:///{tmp_path / 'taken' / 'ledger.db'}")
    assert ReportRow("k").plus(ReportRow("j", 1, 2, 3, 4, 5, 6, 7, 18)).num_tokens == 9


def test_postgres_reconnects_after_the_connection_drops(postgres_schema_url: str) -> None:  # noqa: F811
    import psycopg

    ledger = open_ledger(postgres_schema_url)
    ledger.record([row("before")])
    with psycopg.connect(postgres_schema_url, autocommit=True) as admin:
        admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE pid <> pg_backend_pid() AND datname = current_database()"
        )
    with pytest.raises(LedgerError, match="none written"):
        ledger.record([row("lost")])  # the batch that finds the connection gone: redelivered
    assert ledger.record([row("lost"), row("after")]) == RecordResult(2, 0, 0)
    assert ledger.count() == 3
    ledger.close()


def test_device_spans_merge_and_sum(ledger: Ledger) -> None:
    from services.billing.uptime import DeviceSpan

    hour = 1_790_000_000_000 - 1_790_000_000_000 % 3_600_000
    a = DeviceSpan(hour, "decode-0", "decode", "m", 8, hour + 1_000, hour + 60_000)
    b = DeviceSpan(hour, "decode-0", "decode", "m", 8, hour + 30_000, hour + 90_000)
    c = DeviceSpan(
        hour + 3_600_000, "prefill-0", "prefill", "m", 1, hour + 3_600_500, hour + 3_601_500
    )
    ledger.record_device_spans([b, c])
    ledger.record_device_spans([a, b])  # another replica's span and a repeat: min / max
    assert ledger.device_ms() == 89_000 * 8 + 1_000
    assert ledger.device_ms(since_ms=hour + 3_600_000) == 1_000
    assert ledger.device_ms(until_ms=hour + 3_600_000) == 89_000 * 8
