"""`kvfabric trace`'s reading of a trace dir: spans of one request found by its id in any
process's file, built into a tree (children in start order, spans whose parent was never
written shown at the top with a note) and printed indented by depth; the errors name what
was searched."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from opentelemetry import propagate
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.trace import StatusCode
from typer.testing import CliRunner

from services.admin.cli import app
from services.admin.launcher import record_trace_dir
from services.admin.trace_cli import TraceNotFound, build_tree, render, trace_report
from shared.telemetry import JsonLinesSpanExporter, trace_file

MS = 1_000_000
LINE = re.compile(r"^ *\+[\d.]+ ms +(?P<duration>[\d.]+) ms  (?P<service>\S+) +(?P<rest>.+)$")


def _span(
    span_id: str,
    parent: str | None,
    name: str,
    start_ms: float,
    end_ms: float,
    service: str = "router",
    **attributes: Any,
) -> dict[str, Any]:
    return {
        "trace_id": "ab" * 16,
        "span_id": span_id,
        "parent_span_id": parent,
        "name": name,
        "service": service,
        "instance_id": f"{service}-0",
        "kind": "INTERNAL",
        "start_ns": round(start_ms * MS),
        "end_ns": round(end_ms * MS),
        "attributes": attributes,
        "status": {"code": "UNSET", "description": None},
    }


def _rows(lines: list[str]) -> list[tuple[int, str, str, float]]:
    """(depth, service, name, duration ms) of each span line, depth from the name's column."""
    column = lines[1].index("span")
    rows = []
    for line in lines[2:]:
        match = LINE.match(line)
        assert match, line
        depth = (match.start("rest") - column) // 2
        name = match["rest"].partition("  ")[0]  # two spaces before the attributes
        rows.append((depth, match["service"], name, float(match["duration"])))
    return rows


def test_tree_orders_children_by_start_and_puts_orphans_after_the_root() -> None:
    spans = [
        _span("c2", "r", "second", 5, 6),
        _span("o", "gone", "orphan", 0.5, 1),
        _span("r", None, "root", 1, 10),
        _span("c1", "r", "first", 2, 3),
        _span("g", "c1", "grandchild", 2.5, 2.7),
    ]
    roots = build_tree(spans)
    assert [n.span["name"] for n in roots] == ["root", "orphan"]
    assert roots[0].missing_parent is None and roots[1].missing_parent == "gone"
    assert [n.span["name"] for n in roots[0].children] == ["first", "second"]
    assert [n.span["name"] for n in roots[0].children[0].children] == ["grandchild"]


def test_render_indents_by_depth_with_start_duration_and_key_attributes() -> None:
    spans = [
        _span(
            "r",
            None,
            "POST /v1/chat/completions",
            0,
            40,
            "ingress",
            **{"kvfabric.request_id": "req-1", "http.response.status_code": 200},
        ),
        _span(
            "m",
            "r",
            "router match",
            1,
            1.5,
            "router",
            **{"kvfabric.request_id": "req-1", "kvfabric.hit_blocks.ssd": 6},
        ),
        _span("k", "m", "match", 1.1, 1.4, "kv-index", **{"kvfabric.tiers": ["ssd", "dram"]}),
        _span("f", "r", "fork", 2, 3, "ingress", **{"kvfabric.request_id": "req-1-1"}),
        _span("o", "zz", "billing record", 1000, 1001, "billing"),
    ]
    spans[3]["status"] = {"code": "ERROR", "description": "Overloaded: queues full"}
    lines = render(spans, "req-1")
    assert lines[0].startswith(f"trace {'ab' * 16}  request req-1  5 spans, 4 services")
    assert "(billing, ingress, kv-index, router)" in lines[0] and lines[0].endswith("1001.0 ms")
    assert _rows(lines) == [
        (0, "ingress", "POST /v1/chat/completions", 40.0),
        (1, "router", "router match", 0.5),
        (2, "kv-index", "match", 0.3),
        (1, "ingress", "fork", 1.0),
        (0, "billing", "billing record", 1.0),
    ]
    root, match, kv, fork, orphan = lines[2:]
    assert root.endswith("POST /v1/chat/completions  status=200")  # its own request id hidden
    assert "+1000.0 ms" in orphan and orphan.endswith("(parent zz not recorded)")
    assert match.endswith("router match  hit_blocks.ssd=6")
    assert kv.endswith('tiers=["ssd", "dram"]')
    assert fork.endswith("request_id=req-1-1 ERROR: Overloaded: queues full")


def _service(trace_dir: Path, service: str) -> TracerProvider:
    resource = Resource.create({"service.name": service, "service.instance.id": f"{service}-0"})
    provider = TracerProvider(resource=resource)
    exporter = JsonLinesSpanExporter(trace_file(trace_dir, service, f"{service}-0"))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider


def _two_hop_request(trace_dir: Path, request_id: str) -> str:
    """One request's spans in two processes' files, linked as the bus links them (W3C
    headers); returns its trace id."""
    ingress = _service(trace_dir, "ingress").get_tracer("t")
    router = _service(trace_dir, "router").get_tracer("t")
    with ingress.start_as_current_span("POST /v1/chat/completions") as root:
        root.set_attribute("kvfabric.request_id", request_id)
        headers: dict[str, str] = {}
        propagate.inject(headers)
    with router.start_as_current_span("generate", context=propagate.extract(headers)) as hop:
        hop.set_attribute("kvfabric.request_id", request_id)
        with router.start_as_current_span("router route") as route:
            route.set_status(StatusCode.ERROR, "Overloaded: no decode worker has room")
    return format(root.get_span_context().trace_id, "032x")


def test_report_follows_a_request_across_processes_files(tmp_path: Path) -> None:
    trace_id = _two_hop_request(tmp_path, "req-a")
    _two_hop_request(tmp_path, "req-b")  # another request's trace in the same files
    lines = trace_report(tmp_path, "req-a")
    assert lines[0].startswith(f"trace {trace_id}  request req-a  3 spans, 2 services")
    assert [(d, s, n) for d, s, n, _ in _rows(lines)] == [
        (0, "ingress", "POST /v1/chat/completions"),
        (1, "router", "generate"),
        (2, "router", "router route"),
    ]
    assert lines[-1].endswith("ERROR: Overloaded: no decode worker has room")
    assert trace_report(tmp_path, trace_id) == lines  # the x-trace-id ingress returned


def test_report_skips_lines_being_written_or_torn(tmp_path: Path) -> None:
    _two_hop_request(tmp_path, "req-a")
    path = tmp_path / "router-0.jsonl"
    line = path.read_text().splitlines()[0]  # a span of req-a's trace
    with path.open("a") as file:
        file.write(line[: len(line) // 2])  # a crash mid-line...
        file.write(line + "\n")  # ...and the restarted process's first line after it
        file.write(line[:40])  # a line being written now
    assert len(_rows(trace_report(tmp_path, "req-a"))) == 3
    with pytest.raises(TraceNotFound, match=r"\(1 traces, 3 spans in 2 files"):
        trace_report(tmp_path, "req-b")


def test_a_request_not_found_names_the_dir_and_what_it_holds(tmp_path: Path) -> None:
    _two_hop_request(tmp_path, "req-a")
    _two_hop_request(tmp_path, "req-b")
    with pytest.raises(TraceNotFound) as caught:
        trace_report(tmp_path, "req-c")
    assert f"request 'req-c' not found in {tmp_path} (2 traces, 6 spans in 2 files" in str(
        caught.value
    )
    with pytest.raises(TraceNotFound, match="does not exist"):
        trace_report(tmp_path / "nowhere", "req-a")


def test_trace_command_reads_the_dir_up_recorded(tmp_path: Path) -> None:
    state_dir, trace_dir = tmp_path / "state", tmp_path / "traces"
    state_dir.mkdir()
    runner = CliRunner()
    result = runner.invoke(app, ["trace", "req-a", "--state-dir", str(state_dir)])
    assert result.exit_code == 1 and "no --trace-dir given and none recorded" in result.output
    _two_hop_request(trace_dir, "req-a")
    record_trace_dir(state_dir, trace_dir)
    result = runner.invoke(app, ["trace", "req-a", "--state-dir", str(state_dir)])
    assert result.exit_code == 0, result.output
    assert "request req-a  3 spans, 2 services (ingress, router)" in result.output
    result = runner.invoke(app, ["trace", "req-z", "--trace-dir", str(trace_dir)])
    assert result.exit_code == 1 and f"'req-z' not found in {trace_dir}" in result.output
    record_trace_dir(state_dir, None)  # a cluster started without one forgets it
    result = runner.invoke(app, ["trace", "req-a", "--state-dir", str(state_dir)])
    assert result.exit_code == 1
