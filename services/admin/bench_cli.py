"""`kvfabric bench NAME`: run a benchmark and print the ratios it measured side by side in one
run; `--json PATH` writes the same result as JSON. `kvfabric bench list` names them all (and
what each compares), `kvfabric bench all` runs every one in turn (`--json` is then a
directory: one NAME.json each). Each benchmark's own options (`python -m loadtest.bench_<name>
--help`) are set with `--set KEY=VALUE`, e.g. `kvfabric bench peers --set vllm-cores=0-1`.
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from pathlib import Path

import typer

from loadtest.registry import BENCHMARKS, Benchmark, get
from loadtest.results import OptionError
from shared.logging import configure_logging

QUICK_HELP = "small sizes, as CI runs them (a minute or so each; rough figures)"


def bench_command(
    name: str = typer.Argument(..., help=f"list, all, or one of: {', '.join(BENCHMARKS)}"),
    quick: bool = typer.Option(False, "--quick", help=QUICK_HELP),
    json_path: Path | None = typer.Option(
        None, "--json", help="write the result here (with `all`: a directory)"
    ),
    peers: bool = typer.Option(False, "--peers", help="`all` runs the peer benchmarks too"),
    no_peer: bool = typer.Option(
        False, "--no-peer", help="ours alone, where a benchmark can leave its peer out (kv-index)"
    ),
    settings: list[str] = typer.Option(
        [],
        "--set",
        metavar="KEY=VALUE",
        help="one of the benchmark's own options (repeatable; its module's flags, e.g. "
        "`--set vllm-cores=0-1` for peers); one benchmark only",
    ),
) -> None:
    """Run a benchmark (or `list` them, or run `all`)."""
    # What the benchmark prints is the report; its in-process clients log warnings only.
    configure_logging(service="bench", instance_id="bench", level="warning")
    options = parse_settings(settings)
    if options and name in ("list", "all"):
        raise typer.BadParameter(
            "options are for one benchmark, not `list` or `all`", param_hint="--set"
        )
    if name == "list":
        width = max(len(b) for b in BENCHMARKS)
        for bench in BENCHMARKS.values():
            peer = "" if bench.in_suite else "  (installs a peer; not in CI)"
            typer.echo(f"{bench.name:<{width}}  {bench.compares}{peer}")
        return
    if name == "all":
        _run_all(quick, json_path, peers, not no_peer)
        return
    try:
        bench = get(name)
    except KeyError as exc:
        raise typer.BadParameter(str(exc.args[0]), param_hint="NAME") from None
    if no_peer and not bench.has_peer_option:
        raise typer.BadParameter(f"{name} has no peer to leave out", param_hint="--no-peer")
    try:
        _run_one(bench, quick, json_path, not no_peer, options, settings)
    except OptionError as exc:
        raise typer.BadParameter(str(exc), param_hint="--set") from None


def parse_settings(settings: list[str]) -> dict[str, object]:
    """`KEY=VALUE`s as options: dashes in KEY are underscores; VALUE an int, a float,
    true/false, or else the text (for an option that takes several, comma-separated: the
    benchmark's registry entry splits it)."""
    options: dict[str, object] = {}
    for setting in settings:
        key, sep, text = setting.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"{setting!r} is not KEY=VALUE", param_hint="--set")
        options[key.strip().replace("-", "_")] = _value(text.strip())
    return options


_INT = re.compile(r"[+-]?\d+")
_FLOAT = re.compile(r"[+-]?(\d+\.\d*|\.\d+|\d+)([eE][+-]?\d+)?")


def _value(text: str) -> object:
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    if _INT.fullmatch(text):
        return int(text)
    if _FLOAT.fullmatch(text):
        return float(text)
    return text


def _run_one(
    bench: Benchmark,
    quick: bool,
    json_path: Path | None,
    peer: bool,
    options: dict[str, object] | None = None,
    settings: Sequence[str] = (),
) -> None:
    typer.echo(f"== {bench.name}: {bench.compares}{' (quick)' if quick else ''} ==")
    result = bench.run(quick=quick, peer=peer or not bench.has_peer_option, options=options)
    result.command = (
        f"kvfabric bench {bench.name}{' --quick' if quick else ''}"
        f"{' --no-peer' if bench.has_peer_option and not peer else ''}"
        + "".join(f" --set {s}" for s in settings)
    )
    result.print()
    if json_path is not None:
        result.write_json(json_path)
        typer.echo(f"wrote {json_path}")


def _run_all(quick: bool, json_dir: Path | None, peers: bool, peer: bool) -> None:
    """Every benchmark in turn; a failing one is reported and the others still run."""
    failed = []
    for bench in BENCHMARKS.values():
        if not bench.in_suite and not peers:
            continue
        started = time.monotonic()
        try:
            _run_one(bench, quick, json_dir / f"{bench.name}.json" if json_dir else None, peer)
        except Exception as exc:  # the next benchmark still runs; the exit code says so
            failed.append(bench.name)
            typer.echo(f"{bench.name} FAILED after {time.monotonic() - started:.0f} s: {exc!r}")
    if failed:
        typer.echo(f"failed: {', '.join(failed)}")
        raise typer.Exit(1)
