"""`kvfabric billing report|usage|migrate`: where the money comes from, read from the ledger;
its schema brought up to date.

Both read the ledger directly (`--ledger-url`; by default the one `kvfabric up` keeps under
its state dir), so they work while the cluster runs and after it stopped. Money is exact in
the ledger (integer pico-CNY) and rounded once here, half-even.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import typer

from services.billing.ledger import LedgerError, open_ledger
from services.billing.pricing import cny
from services.billing.report import (
    format_share,
    render_csv,
    render_json,
    render_table,
    revenue_mix,
    total,
)

app = typer.Typer(help=__doc__, no_args_is_help=True, add_completion=False)
DEFAULT_LEDGER = f"sqlite:///{(Path('.kvfabric') / 'billing' / 'ledger.db').resolve()}"
LEDGER = typer.Option(
    DEFAULT_LEDGER, help="sqlite:///PATH or postgresql://...", envvar="KVF_BILLING_LEDGER_URL"
)
FORMAT = typer.Option("table", "--format", help="table | csv | json")
USD_RATE = typer.Option(None, help="USD per CNY (e.g. 0.145): adds a USD column")


def _ms(text: str | None, name: str) -> int | None:
    if text is None:
        return None
    try:
        return int(datetime.fromisoformat(text).timestamp() * 1000)
    except ValueError as exc:
        raise typer.BadParameter(f"{text!r} is not an ISO date/time", param_hint=name) from exc


def _emit(rows, fmt: str, usd_rate: str | None, device_ms: int | None = None) -> None:  # noqa: ANN001
    """The rows as a table (with the revenue mix, and revenue per device-hour where the
    workers' uptime is known), CSV (the rows alone) or JSON (an object: rows, total,
    device-hours, revenue per device-hour)."""
    whole = total(rows)
    per_hour = None
    if device_ms:  # pico-CNY per device-hour, exact: total x 3.6e6 / device_ms
        per_hour = whole.total_pico_cny * 3_600_000 // device_ms
    if fmt == "json":
        body = {
            "rows": json.loads(render_json(rows)),
            "total": json.loads(render_json([whole]))[0],
            # Significant digits, not decimals: a short run's few seconds are not 0.0 hours.
            "device_hours": None if device_ms is None else f"{device_ms / 3.6e6:.6g}",
            "revenue_per_device_hour_cny": None if per_hour is None else str(cny(per_hour, 2)),
        }
        typer.echo(json.dumps(body, indent=2))
    elif fmt == "csv":
        typer.echo(render_csv(rows), nl=False)
    elif fmt == "table":
        if not rows:
            typer.echo("no usage in the ledger for that selection")
            return
        typer.echo(render_table(rows, usd_rate=usd_rate))
        mix = revenue_mix(whole)
        if mix is not None:
            typer.echo(
                f"revenue mix (hit / miss / output): {format_share(mix.hit)} / "
                f"{format_share(mix.miss)} / {format_share(mix.output)}"
            )
        if per_hour is not None:
            hours = device_ms / 3.6e6
            shown = f"{hours:,.3f}" if hours >= 1 else f"{hours:.3g}"
            typer.echo(
                f"revenue per GPU-hour: CNY {cny(per_hour, 2)} over "
                f"{shown} device-hours the workers reported"
            )
    else:
        raise typer.BadParameter("one of table, csv, json", param_hint="--format")


@app.command()
def report(
    by: str = typer.Option("account", help="account | model | hour | day"),
    since: str | None = typer.Option(None, help="from this ISO date/time (local if no zone)"),
    until: str | None = typer.Option(None, help="before this ISO date/time"),
    time_zone: str = typer.Option("UTC", help="hours and days in this zone"),
    ledger_url: str = LEDGER,
    fmt: str = FORMAT,
    usd_rate: str | None = USD_RATE,
) -> None:
    """Tokens by kind, revenue by kind, cache-hit share and effective price per million
    tokens, grouped by account, model, hour or day, with the revenue mix of the whole and
    revenue per GPU-hour (the device-hours the workers' heartbeats cover)."""
    if by not in ("account", "model", "hour", "day"):
        raise typer.BadParameter("one of account, model, hour, day", param_hint="--by")
    since_ms, until_ms = _ms(since, "--since"), _ms(until, "--until")
    rows, device_ms = _read(
        ledger_url,
        lambda ledger: (
            ledger.report(by, since_ms, until_ms, time_zone=time_zone),  # type: ignore[arg-type]
            ledger.device_ms(since_ms, until_ms),
        ),
    )
    _emit(rows, fmt, usd_rate, device_ms)


@app.command()
def usage(
    account: str = typer.Option(..., help="the account (as `kvfabric keys list` shows it)"),
    ledger_url: str = LEDGER,
    fmt: str = FORMAT,
    usd_rate: str | None = USD_RATE,
) -> None:
    """One account's usage and charges, by model."""
    _emit(_read(ledger_url, lambda ledger: ledger.usage(account)), fmt, usd_rate)


def _read(ledger_url: str, query):  # noqa: ANN001, ANN202
    """`query(ledger)` on the ledger at `ledger_url`; a ledger that cannot open exits 1."""
    try:
        ledger = open_ledger(ledger_url, must_exist=True)
    except LedgerError as exc:
        typer.echo(f"billing: {exc}", err=True)
        raise typer.Exit(1) from exc
    try:
        return query(ledger)
    finally:
        ledger.close()


@app.command()
def migrate(ledger_url: str = LEDGER) -> None:
    """Bring the ledger's schema up to this version's (billing also does it on start): each
    migration once, in one transaction, under a lock, so two at once apply it once. A
    ledger newer than this code is refused, not written."""
    try:
        ledger = open_ledger(ledger_url)
    except LedgerError as exc:
        typer.echo(f"billing migrate: {exc}", err=True)
        raise typer.Exit(1) from exc
    try:
        versions = ledger.schema_versions()
    finally:
        ledger.close()
    applied = ledger.migrations_applied
    if applied:
        typer.echo(f"applied {', '.join(map(str, applied))}: schema version {max(versions)}")
    else:
        typer.echo(f"up to date: schema version {max(versions, default=0)}")
