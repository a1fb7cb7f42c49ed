"""`kvfabric simulate`: its JSON document and its table, on a cluster of four GPUs a side."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from services.admin.cli import app

ARGS = [
    "simulate",
    "--gpus-per-prefill-server",
    "4",
    "--decode-node-gpus",
    "4",
    "--load",
    "0.3",
    "--duration",
    "6",
    "--warmup",
    "3",
    "--window",
    "3",
]


def test_json_document_balances() -> None:
    result = CliRunner().invoke(app, [*ARGS, "--json"])
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    ledger = document["ledger"]
    assert ledger["num_issued"] > 0
    assert ledger["num_issued"] == ledger["num_finished"] + ledger["num_refused"]
    assert document["config"]["num_prefill_gpus"] == 4
    assert sum(w["requests"] for w in document["windows"]) == ledger["num_finished"]
    assert 0.0 < document["steady"]["hit_rate"] < 1.0  # measured, never configured
    assert document["decisions_per_cpu_s"] > 0


def test_table_shows_windows_and_the_steady_state() -> None:
    result = CliRunner().invoke(app, [*ARGS, "--seed", "3"])
    assert result.exit_code == 0, result.output
    assert "hit_rate" in result.stdout
    assert "steady state, 3-6 s:" in result.stdout
    assert "per CPU-second" in result.stdout


def test_bad_shape_is_a_usage_error() -> None:
    result = CliRunner().invoke(app, ["simulate", "--prefill-servers", "0"])
    assert result.exit_code == 2
