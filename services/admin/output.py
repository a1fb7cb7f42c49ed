"""One output convention for every command that prints data: `--format table|json|csv`.

A table is for people (its layout may change); JSON and CSV are for programs. CSV has one
row per record with the JSON fields as columns (a nested value as its JSON text). Nothing
but the data goes to stdout in json and csv: log lines and errors go to stderr.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Callable, Sequence
from typing import Any

import typer

FORMATS = ("table", "json", "csv")


def format_option(default: str = "table", formats: Sequence[str] = FORMATS) -> Any:
    return typer.Option(default, "--format", help=" | ".join(formats))


def check_format(fmt: str, formats: Sequence[str] = FORMATS) -> str:
    if fmt not in formats:
        raise typer.BadParameter(f"one of {', '.join(formats)}, not {fmt!r}", param_hint="--format")
    return fmt


def to_csv(rows: Sequence[dict[str, Any]]) -> str:
    """Records as CSV: a header of every field seen (in first-seen order), one line each."""
    fields: dict[str, None] = {}
    for row in rows:
        fields.update(dict.fromkeys(row))
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=list(fields), lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow(
            {k: json.dumps(v) if isinstance(v, dict | list) else v for k, v in row.items()}
        )
    return out.getvalue()


def emit(
    fmt: str,
    rows: Sequence[dict[str, Any]],
    table: Callable[[], None],
    *,
    document: Any = None,
) -> None:
    """Print `rows` as `fmt`: `table()` prints the people's form; JSON is `document` when
    given (an object with more than the rows), else the rows."""
    check_format(fmt)
    if fmt == "json":
        typer.echo(json.dumps(rows if document is None else document, indent=2))
    elif fmt == "csv":
        typer.echo(to_csv(rows), nl=False)
    else:
        table()
