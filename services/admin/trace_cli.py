"""`kvfabric trace REQUEST_ID`: one request's spans, read back from a trace directory (the
JSON lines every service writes under `--trace-dir`, shared.telemetry), printed as a tree:
when each step started, how long it took, which service ran it, what it found.

The request is found by its id on any span of its trace (every hop that knows it sets
`kvfabric.request_id`), or by the trace id ingress returned in `x-trace-id`; then every span of
that trace, from every process's file, goes into the tree. A span whose parent is not in the
files (a client's own span, or one not written yet) is shown at the top level with a note.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import typer

from services.admin.launcher import TRACE_DIR_RECORD, recorded_trace_dir
from shared.telemetry import ATTRIBUTE_PREFIX, REQUEST_ID

# Attributes not worth a column: the request id is in the heading, the subject in the name.
HIDDEN_ATTRIBUTES = frozenset(
    {REQUEST_ID, "messaging.destination.name", "url.path", "http.request.method"}
)
SHORT_NAMES = {"http.response.status_code": "status"}


class TraceNotFound(LookupError):
    """No span of the trace dir names the request; the message says what was searched."""


@dataclass
class Node:
    span: dict[str, Any]
    children: list[Node] = field(default_factory=list)
    missing_parent: str | None = None  # its parent's span id, when that span is not recorded

    @property
    def start_ns(self) -> int:
        return self.span["start_ns"]


def trace_spans(trace_dir: Path, needle: bytes = b"") -> Iterator[dict[str, Any]]:
    """The spans of every trace file whose line contains `needle` (a cheap filter before
    parsing: the files hold every request's spans). A line still being written is skipped,
    and so is one a crashed process left torn (the next line was appended to it)."""
    for path in sorted(trace_dir.glob("*.jsonl")):
        with path.open("rb") as file:
            for line in file:
                if not line.endswith(b"\n") or needle not in line:
                    continue
                try:
                    span = json.loads(line)
                except ValueError:
                    continue
                if isinstance(span, dict) and "trace_id" in span:
                    yield span


def find_trace_ids(trace_dir: Path, key: str) -> list[str]:
    """The traces with a span naming request `key`, else the trace whose id is `key`."""
    found: dict[str, None] = {}  # in the order first seen
    for span in trace_spans(trace_dir, f'"{REQUEST_ID}":{json.dumps(key)}'.encode()):
        if span.get("attributes", {}).get(REQUEST_ID) == key:
            found[span["trace_id"]] = None
    if not found and load_trace(trace_dir, key):
        found[key] = None
    return list(found)


def load_trace(trace_dir: Path, trace_id: str) -> list[dict[str, Any]]:
    needle = f'"trace_id":{json.dumps(trace_id)}'.encode()
    return [span for span in trace_spans(trace_dir, needle) if span["trace_id"] == trace_id]


def count_traces(trace_dir: Path) -> tuple[int, int, int]:
    """(files, spans, traces) in the trace dir, for the message of a request not found."""
    trace_ids, num_spans = set(), 0
    for span in trace_spans(trace_dir):
        num_spans += 1
        trace_ids.add(span["trace_id"])
    return len(list(trace_dir.glob("*.jsonl"))), num_spans, len(trace_ids)


def build_tree(spans: list[dict[str, Any]]) -> list[Node]:
    """The spans of one trace as trees, children in start order; roots first the true root
    (no parent), then spans whose parent is missing from the files, by start."""
    nodes = {span["span_id"]: Node(span) for span in spans}
    roots: list[Node] = []
    for node in nodes.values():
        parent_id = node.span.get("parent_span_id")
        parent = nodes.get(parent_id) if parent_id else None
        if parent is not None:
            parent.children.append(node)
        else:
            node.missing_parent = parent_id
            roots.append(node)
    for node in nodes.values():
        node.children.sort(key=lambda n: n.start_ns)
    roots.sort(key=lambda n: (n.missing_parent is not None, n.start_ns))
    return roots


def duration_ms(span: dict[str, Any]) -> float:
    return (span["end_ns"] - span["start_ns"]) / 1e6


def _ms(value: float) -> str:
    return f"{value:.2f} ms" if abs(value) < 1 else f"{value:.1f} ms"


def _attributes(span: dict[str, Any], request_id: str) -> str:
    parts = []
    for key, value in span["attributes"].items():
        if key in HIDDEN_ATTRIBUTES and not (key == REQUEST_ID and value != request_id):
            continue
        name = SHORT_NAMES.get(key, key.removeprefix(ATTRIBUTE_PREFIX))
        parts.append(f"{name}={json.dumps(value) if isinstance(value, list) else value}")
    status = span.get("status") or {}
    if status.get("code") == "ERROR":
        parts.append(f"ERROR: {status.get('description') or 'failed'}")
    return "  " + " ".join(parts) if parts else ""


def render(spans: list[dict[str, Any]], request_id: str = "") -> list[str]:
    """The trace as lines: a heading, then one line per span -- start (from the trace's
    first span), duration, service, the name indented by depth, key attributes."""
    roots = build_tree(spans)
    start_ns = min(s["start_ns"] for s in spans)
    end_ns = max(s["end_ns"] for s in spans)
    services = sorted({s["service"] for s in spans})
    width = max(len(s) for s in services)
    lines = [
        f"trace {spans[0]['trace_id']}"
        + (f"  request {request_id}" if request_id else "")
        + f"  {len(spans)} spans, {len(services)} services ({', '.join(services)}), "
        f"{_ms((end_ns - start_ns) / 1e6)}",
        f"{'start':>10} {'duration':>10}  {'service':<{width}}  span",
    ]

    def walk(node: Node, depth: int) -> None:
        span = node.span
        note = f"  (parent {node.missing_parent} not recorded)" if node.missing_parent else ""
        lines.append(
            f"{'+' + _ms((span['start_ns'] - start_ns) / 1e6):>10} {_ms(duration_ms(span)):>10}"
            f"  {span['service']:<{width}}  {'  ' * depth}{span['name']}"
            f"{_attributes(span, request_id)}{note}"
        )
        for child in node.children:
            walk(child, depth + 1)

    for root in roots:
        walk(root, 0)
    return lines


def trace_report(trace_dir: Path, request_id: str) -> list[str]:
    """The lines `kvfabric trace` prints; TraceNotFound naming the dir and what it holds."""
    if not trace_dir.is_dir():
        raise TraceNotFound(f"trace dir {trace_dir} does not exist")
    trace_ids = find_trace_ids(trace_dir, request_id)
    if not trace_ids:
        num_files, num_spans, num_traces = count_traces(trace_dir)
        raise TraceNotFound(
            f"request {request_id!r} not found in {trace_dir} ({num_traces} traces, "
            f"{num_spans} spans in {num_files} files; spans reach the files about half a "
            f"second after they end, and only sampled requests are traced)"
        )
    lines: list[str] = []
    for trace_id in trace_ids:
        if lines:
            lines.append("")
        spans = load_trace(trace_dir, trace_id)
        lines += render(spans, request_id if trace_id != request_id else _request_of(spans))
    return lines


def _request_of(spans: list[dict[str, Any]]) -> str:
    """The request a trace found by its id served: the id its first span names."""
    for span in sorted(spans, key=lambda s: s["start_ns"]):
        if REQUEST_ID in span["attributes"]:
            return span["attributes"][REQUEST_ID]
    return ""


def trace_command(
    request_id: str = typer.Argument(..., help="a request id (or the x-trace-id ingress sent)"),
    trace_dir: Path | None = typer.Option(
        None,
        help="where the services wrote their spans (default: the one `kvfabric up "
        "--trace-dir` recorded in --state-dir)",
    ),
    state_dir: Path = typer.Option(Path(".kvfabric"), help="the cluster's state dir"),
) -> None:
    """Print one request's trace, every hop's spans as a tree, from a trace directory."""
    if trace_dir is None:
        trace_dir = recorded_trace_dir(state_dir)
        if trace_dir is None:
            typer.echo(
                f"trace: no --trace-dir given and none recorded in "
                f"{state_dir / TRACE_DIR_RECORD} (start the cluster with `kvfabric up "
                f"--trace-dir DIR`)",
                err=True,
            )
            raise typer.Exit(1)
    try:
        lines = trace_report(trace_dir, request_id)
    except TraceNotFound as exc:
        typer.echo(f"trace: {exc}", err=True)
        raise typer.Exit(1) from exc
    typer.echo("\n".join(lines))
