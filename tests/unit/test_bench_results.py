"""A benchmark result prints, writes and renders the same figures: each ratio with its
target's verdict (lower is better for latencies), one line per entry."""

from __future__ import annotations

import importlib
import json
import typing
from pathlib import Path

import pytest
import typer

from loadtest.markdown import render
from loadtest.registry import _as_hinted, get
from loadtest.results import BenchResult, OptionError, UnknownOption, bench_options
from services.admin.bench_cli import parse_settings


def sample() -> BenchResult:
    result = BenchResult("demo", quick=True, command="kvfabric bench demo --quick")
    result.ratio("decode tok/s", 30.0, 20.0, "transformers", "tokens/s", 1.5)
    result.ratio("p50 latency", 4.0, 2.0, "raw nats-py", "us", 1.3, lower_is_better=True)
    result.ratio("events/s", 9.0, 10.0, "raw nats-py", "events/s")
    result.figure("ingest", 26_000, "records/s", 5000)
    result.note("measured beside nothing else")
    return result.finish()


def test_targets_and_direction() -> None:
    decode, latency, events = sample().ratios
    assert decode.value == 1.5 and decode.met is True  # a floor, reached exactly
    assert latency.value == 2.0 and latency.met is False  # a ceiling, exceeded
    assert events.met is None  # no target: no verdict


def test_printed_lines_match_the_json(tmp_path: Path) -> None:
    result = sample()
    lines = result.lines()
    assert lines[0] == "demo (quick)"
    assert lines[1] == (
        "  decode tok/s: ours 30 vs transformers 20 tokens/s = 1.50x (target >= 1.50x: met)"
    )
    assert lines[2].endswith("= 2.00x (target <= 1.30x: NOT met)")
    assert lines[4] == "  ingest: 26,000 records/s (target >= 5,000: met)"
    assert lines[5] == "  note: measured beside nothing else"
    result.write_json(tmp_path / "demo.json")
    data = json.loads((tmp_path / "demo.json").read_text())
    assert [r["name"] for r in data["ratios"]] == ["decode tok/s", "p50 latency", "events/s"]
    assert [r["met"] for r in data["ratios"]] == [True, False, None]
    assert data["figures"][0]["value"] == 26_000 and data["command"].startswith("kvfabric")
    assert data["machine"]["cpu_count"] >= 1


def test_markdown_has_every_entry() -> None:
    data = json.loads(json.dumps(sample().to_dict()))
    text = render([data], "fallback")
    assert "## demo (quick)" in text and "`kvfabric bench demo --quick`" in text
    assert "| decode tok/s | 30 | transformers: 20 | tokens/s | 1.50x | >= 1.50: met |" in text
    assert "| p50 latency | 4 | raw nats-py: 2 | us | 2.00x | <= 1.30: **NOT met** |" in text
    assert "| ingest | 26,000 | records/s | >= 5,000: met |" in text
    assert "- measured beside nothing else" in text


def test_options_are_checked_against_what_a_benchmark_takes() -> None:
    args = bench_options({"steps": 5, "cores": ""}, {"cores": "0-1"}, {"steps": 3})
    assert (args.steps, args.cores) == (3, "0-1")
    with pytest.raises(UnknownOption, match="unknown option.*stpes; known: cores, steps"):
        bench_options({"steps": 5, "cores": ""}, {"stpes": 4})
    # a benchmark whose run() names its keywords: checked against its signature, before it runs
    with pytest.raises(UnknownOption, match="unknown option.*no_such; known: .*num_requests"):
        get("bus").run(quick=True, options={"no_such": 1})


def test_set_flags_parse_to_options() -> None:
    assert parse_settings(["vllm-cores=0-1", "steps=4", "think_s=0.5", "move=false"]) == {
        "vllm_cores": "0-1",
        "steps": 4,
        "think_s": 0.5,
        "move": False,
    }
    with pytest.raises(typer.BadParameter, match="not KEY=VALUE"):
        parse_settings(["steps"])


def test_a_set_value_for_a_tuple_option_is_split_into_its_items() -> None:
    """`--set models=a,b` reaches bench prefix as ('a', 'b'), one name as a 1-tuple (not its
    letters), `--set batch-sizes=1,8` as ints; an item that is not one is refused by name."""
    prefix = typing.get_type_hints(importlib.import_module("loadtest.bench_prefix_reuse").run)
    engine = typing.get_type_hints(importlib.import_module("loadtest.bench_engine").run)
    assert _as_hinted("models", "tiny-coder,SmolLM2-135M-Instruct", prefix["models"]) == (
        "tiny-coder",
        "SmolLM2-135M-Instruct",
    )
    assert _as_hinted("models", "SmolLM2-135M-Instruct", prefix["models"]) == (
        "SmolLM2-135M-Instruct",
    )
    assert _as_hinted("batch_sizes", "1,8", engine["batch_sizes"]) == (1, 8)
    assert _as_hinted("batch_sizes", 8, engine["batch_sizes"]) == (8,)
    assert _as_hinted("context", 2048, prefix["context"]) == 2048
    with pytest.raises(OptionError, match="batch_sizes: '1,eight' is not .* list of int"):
        _as_hinted("batch_sizes", "1,eight", engine["batch_sizes"])
    with pytest.raises(OptionError, match="batch_sizes"):
        get("engine").run(quick=True, options={"batch_sizes": "one"})
