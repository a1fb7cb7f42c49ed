"""shared.telemetry's pieces: the sampler (roots by ratio once exporting, children follow
their parent), the trace-file exporter (one JSON line per finished span), the span helpers
(children of ended or remote parents), the kept context of a message sent later, and the
tracing config (`trace_sample_ratio`, `trace_dir`) checked where it is read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import NonRecordingSpan, SpanContext, StatusCode, TraceFlags
from typer.testing import CliRunner

from services.admin.cli import app
from services.router.config import RouterConfig
from shared import telemetry
from shared.config import ConfigError, load_config
from shared.telemetry import JsonLinesSpanExporter, KvfSampler, trace_file

MASK_64 = (1 << 64) - 1


def _remote_parent(*, sampled: bool) -> Context:
    flags = TraceFlags(TraceFlags.SAMPLED if sampled else TraceFlags.DEFAULT)
    ctx = SpanContext(0xABC, 0xDEF, is_remote=True, trace_flags=flags)
    return trace.set_span_in_context(NonRecordingSpan(ctx))


def _is_sampled(sampler: KvfSampler, trace_id: int, parent: Context | None = None) -> bool:
    return sampler.should_sample(parent, trace_id, "x").decision.is_sampled()


def test_sampler_records_nothing_until_something_exports() -> None:
    sampler = KvfSampler()
    assert not _is_sampled(sampler, 1)
    # A request that arrives with a sampled traceparent is traced all the same.
    assert _is_sampled(sampler, 1, _remote_parent(sampled=True))
    sampler.configure(is_exporting=True)
    assert _is_sampled(sampler, MASK_64)  # default ratio 1.0: every root


def test_sampler_takes_roots_by_ratio_and_children_follow_their_parent() -> None:
    sampler = KvfSampler()
    sampler.configure(is_exporting=True, ratio=0.5)
    # TraceIdRatioBased keeps a root whose trace id's low 64 bits are below ratio * 2^64.
    assert _is_sampled(sampler, 1)
    assert not _is_sampled(sampler, MASK_64)
    sampler.configure(is_exporting=True, ratio=0.0)
    assert not _is_sampled(sampler, 1)
    assert _is_sampled(sampler, 1, _remote_parent(sampled=True))
    sampler.configure(is_exporting=True, ratio=1.0)
    assert not _is_sampled(sampler, 1, _remote_parent(sampled=False))


@pytest.mark.parametrize("ratio", [-0.1, 1.5, float("nan")])
def test_sampler_refuses_a_ratio_outside_zero_to_one(ratio: float) -> None:
    with pytest.raises(ValueError, match="sample ratio must be in"):
        KvfSampler().configure(is_exporting=True, ratio=ratio)


def test_trace_file_is_named_after_the_instance_with_its_service() -> None:
    assert trace_file(Path("/t"), "router", "router-0") == Path("/t/router-0.jsonl")
    assert trace_file(Path("/t"), "router", "r7") == Path("/t/router-r7.jsonl")


def _provider(path: Path, service: str = "router") -> tuple[TracerProvider, JsonLinesSpanExporter]:
    exporter = JsonLinesSpanExporter(path)
    resource = Resource.create({"service.name": service, "service.instance.id": f"{service}-0"})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


def test_file_exporter_writes_one_json_line_per_span_with_its_fields(tmp_path: Path) -> None:
    path = tmp_path / "traces" / "router-0.jsonl"  # the directory is made
    provider, exporter = _provider(path)
    tracer = provider.get_tracer("t")
    with tracer.start_as_current_span("router route") as parent:
        parent.set_attributes({"kvfabric.request_id": "r1", "kvfabric.tiers": ("ssd", "dram")})
        with tracer.start_as_current_span("router match") as child:
            child.set_status(StatusCode.ERROR, "kv-index did not answer")
    exporter.shutdown()
    lines = path.read_text().splitlines()
    assert len(lines) == 2
    match, route = (json.loads(line) for line in lines)  # children finish first
    assert route["name"] == "router route" and route["parent_span_id"] is None
    assert route["service"] == "router" and route["instance_id"] == "router-0"
    assert route["attributes"] == {"kvfabric.request_id": "r1", "kvfabric.tiers": ["ssd", "dram"]}
    assert match["parent_span_id"] == route["span_id"] and match["trace_id"] == route["trace_id"]
    assert len(route["trace_id"]) == 32 and len(route["span_id"]) == 16
    assert match["status"] == {"code": "ERROR", "description": "kv-index did not answer"}
    assert route["status"]["code"] == "UNSET"
    assert route["kind"] == "INTERNAL"
    assert 0 < route["start_ns"] <= match["start_ns"] <= match["end_ns"] <= route["end_ns"]


def test_file_exporter_appends_after_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "prefill-0.jsonl"
    for name in ("before", "after"):
        provider, exporter = _provider(path, "prefill")
        with provider.get_tracer("t").start_as_current_span(name):
            pass
        exporter.shutdown()
    assert [json.loads(line)["name"] for line in path.read_text().splitlines()] == [
        "before",
        "after",
    ]


@pytest.fixture
def spans() -> InMemorySpanExporter:
    """Spans of the process-wide provider (installed once per process; this adds a processor,
    and exporting starts sampling roots at ratio 1)."""
    exporter = InMemorySpanExporter()
    telemetry.setup_tracing("test", "test-0", processor=SimpleSpanProcessor(exporter))
    return exporter


def test_span_helpers_nest_under_ended_and_remote_parents(spans: InMemorySpanExporter) -> None:
    with telemetry.span("root") as root:
        assert root.is_recording()
    # A task the root started may run after it ended: its steps are still the root's.
    late = telemetry.child_span(root, "late", start_ns=root.start_time)
    late.end()
    with telemetry.span("late.step", parent=root):
        pass
    remote = trace.get_current_span(_remote_parent(sampled=True))
    with telemetry.span("remote.step", parent=remote):
        pass
    by_name = {s.name: s for s in spans.get_finished_spans()}
    assert by_name["late"].parent.span_id == root.get_span_context().span_id
    assert by_name["late"].start_time == root.start_time
    assert by_name["late.step"].parent.span_id == root.get_span_context().span_id
    assert by_name["remote.step"].context.trace_id == 0xABC
    assert by_name["remote.step"].parent.span_id == 0xDEF


def test_span_helpers_make_nothing_under_an_unsampled_parent(
    spans: InMemorySpanExporter,
) -> None:
    unsampled = trace.get_current_span(_remote_parent(sampled=False))
    with telemetry.span("skipped", parent=unsampled) as made:
        assert made is unsampled and not made.is_recording()
    assert telemetry.child_span(unsampled, "skipped too") is trace.INVALID_SPAN
    assert [s.name for s in spans.get_finished_spans()] == []


def test_an_unsampled_parent_is_current_in_its_steps_so_the_next_hop_follows_it(
    spans: InMemorySpanExporter,
) -> None:
    # A request left out by the ratio, stepped from another task (its span kept on its job):
    # what that step sends must say "not sampled", or the next hop (exporting, ratio 1 here)
    # would start a trace of its own.
    unsampled = trace.get_current_span(_remote_parent(sampled=False))
    assert trace.get_current_span() is not unsampled
    with telemetry.span("prefill transfer", parent=unsampled) as made:
        assert made is unsampled and trace.get_current_span() is unsampled
        headers: dict[str, str] = {}
        telemetry.inject(headers)
    assert trace.get_current_span() is not unsampled  # detached after the block
    assert headers[telemetry.TRACEPARENT].endswith("-00")  # the "not sampled" flag
    with telemetry.incoming_span("suffix", headers) as next_hop:
        assert not next_hop.is_recording()
    assert [s.name for s in spans.get_finished_spans()] == []


def test_a_kept_context_continues_the_trace_once(spans: InMemorySpanExporter) -> None:
    with telemetry.span("decode finish") as finish:
        telemetry.keep_context("req-1")
    telemetry.keep_context("req-2")  # no span current: nothing to continue
    headers = telemetry.take_context("req-1")
    assert headers is not None and telemetry.take_context("req-1") is None
    assert telemetry.take_context("req-2") is None
    parent = telemetry.remote_parent(headers)
    assert parent.get_span_context().span_id == finish.get_span_context().span_id
    assert parent.get_span_context().trace_flags.sampled


# -- the config ----------------------------------------------------------------------------
def test_trace_config_defaults_and_sources(tmp_path: Path) -> None:
    config = load_config(RouterConfig, [], {})
    assert config.trace_dir is None and config.trace_sample_ratio == 1.0
    environ = {"KVF_TRACE_SAMPLE_RATIO": "0.25", "KVF_TRACE_DIR": str(tmp_path)}
    config = load_config(RouterConfig, [], environ)
    assert config.trace_sample_ratio == 0.25 and config.trace_dir == tmp_path
    config = load_config(RouterConfig, ["--trace-sample-ratio", "0"], environ)
    assert config.trace_sample_ratio == 0.0


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("1.5", "trace_sample_ratio must be in [0, 1], got 1.5"),
        ("-0.1", "trace_sample_ratio must be in [0, 1], got -0.1"),
        ("nan", "trace_sample_ratio must be in [0, 1], got nan"),
        ("half", "--trace-sample-ratio='half'"),
    ],
)
def test_a_bad_sample_ratio_fails_at_start(value: str, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(RouterConfig, ["--trace-sample-ratio", value], {})
    assert message in str(caught.value)


def test_a_trace_dir_that_is_a_file_fails_at_start(tmp_path: Path) -> None:
    path = tmp_path / "taken"
    path.write_text("x")
    with pytest.raises(ConfigError, match="exists and is not a directory"):
        load_config(RouterConfig, ["--trace-dir", str(path)], {})


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--trace-sample-ratio", "2"], "must be in [0, 1], got 2.0"),
        (["--otlp-endpoint", "collector:4318"], "must be an http(s) URL"),
    ],
)
def test_up_refuses_bad_tracing_flags_before_starting_anything(
    tmp_path: Path, flags: list[str], message: str
) -> None:
    result = CliRunner().invoke(
        app,
        ["up", "--state-dir", str(tmp_path), "--models", "tiny-coder", *flags],
        env={"COLUMNS": "300"},
    )
    assert result.exit_code == 2
    assert message in " ".join(result.output.replace("│", " ").split())
    assert not (tmp_path / "logs").exists()  # no cluster was started
