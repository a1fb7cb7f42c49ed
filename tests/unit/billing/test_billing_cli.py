"""`kvfabric billing` against ledger files: a report on a ledger that is not there is an
error (no empty ledger made), `migrate` applies the schema once, and `--version` works."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from services.admin.cli import app
from services.billing.ledger.schema import load_migrations

runner = CliRunner()


def test_a_report_on_a_missing_ledger_is_an_error_and_makes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "billing" / "ledger.db"
    done = runner.invoke(app, ["billing", "report", "--ledger-url", f"sqlite:///{path}"])
    assert done.exit_code == 1
    assert f"no ledger at {path}" in done.output
    assert not path.exists() and not path.parent.exists()


def test_migrate_applies_the_schema_once_then_reports_read_it(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    versions = [m.version for m in load_migrations()]
    first = runner.invoke(app, ["billing", "migrate", "--ledger-url", url])
    assert first.exit_code == 0, first.output
    assert first.output.startswith(f"applied {', '.join(map(str, versions))}:")
    again = runner.invoke(app, ["billing", "migrate", "--ledger-url", url])
    assert again.output.strip() == f"up to date: schema version {versions[-1]}"
    report = runner.invoke(app, ["billing", "report", "--ledger-url", url, "--format", "json"])
    assert report.exit_code == 0 and '"num_requests": 0' in report.output


def test_version() -> None:
    done = runner.invoke(app, ["--version"])
    assert done.exit_code == 0 and done.output.startswith("kvfabric 0.")
