"""The output convention of every data command: --format table|json|csv."""

from __future__ import annotations

import csv
import io
import json

import pytest
import typer

from services.admin.output import check_format, emit, to_csv


def test_csv_has_every_field_and_nested_values_as_json() -> None:
    rows = [{"a": 1, "b": {"x": [1, 2]}}, {"a": 2, "c": "with, comma"}]
    parsed = list(csv.DictReader(io.StringIO(to_csv(rows))))
    assert parsed == [
        {"a": "1", "b": '{"x": [1, 2]}', "c": ""},
        {"a": "2", "b": "", "c": "with, comma"},
    ]


def test_each_format_prints_only_its_own_form(capsys: pytest.CaptureFixture[str]) -> None:
    rows = [{"id": "k1"}]
    emit("json", rows, lambda: print("TABLE"))
    assert json.loads(capsys.readouterr().out) == rows
    emit("json", rows, lambda: print("TABLE"), document={"rows": rows, "more": 1})
    assert json.loads(capsys.readouterr().out) == {"rows": rows, "more": 1}
    emit("csv", rows, lambda: print("TABLE"))
    assert capsys.readouterr().out == "id\nk1\n"
    emit("table", rows, lambda: print("TABLE"))
    assert capsys.readouterr().out == "TABLE\n"


def test_an_unknown_format_is_a_usage_error() -> None:
    with pytest.raises(typer.BadParameter, match="one of table, json, csv"):
        check_format("yaml")
    assert check_format("text", ("text", "json")) == "text"
