"""OpenTelemetry tracing: one trace per request across every hop, W3C `traceparent` in NATS
headers, spans exported over OTLP/HTTP and/or as JSON lines in a directory.

A real SDK tracer provider is always installed. Tracing is off by default: with no exporter
the sampler records only spans whose incoming parent was sampled (`ParentBased(ALWAYS_OFF)`),
so a request that carries a sampled `traceparent` is still traced through every hop, and one
that carries none costs no span. Once something exports (`otlp_endpoint`, `trace_dir`, or a
processor given by a test) roots are sampled by `sample_ratio` (`TraceIdRatioBased`) and
children follow their parent (`ParentBased`), so a trace is whole or absent, never cut.

The spans of a request's work (`span`, `child_span`) are made only under a sampled parent:
an unsampled request costs a check per step, and callers compute attributes only when
`span.is_recording()`.

`trace_dir`: each process appends its finished spans to `<trace_dir>/<instance>.jsonl`, one
JSON object a line (`span_record`); `kvfabric trace` reads them back.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Mapping, MutableMapping, Sequence
from pathlib import Path
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.sampling import (
    ALWAYS_OFF,
    ParentBased,
    Sampler,
    SamplingResult,
    TraceIdRatioBased,
)
from opentelemetry.trace import INVALID_SPAN, Span

TRACEPARENT = "traceparent"
ATTRIBUTE_PREFIX = "kvfabric."  # the attributes of this project's own spans
# On every span that knows the request: how `kvfabric trace` finds it.
REQUEST_ID = ATTRIBUTE_PREFIX + "request_id"
# Trace files are local appends: written every half second, so `kvfabric trace` sees a request
# moments after it ended (the SDK's default, 5 s, suits a collector).
FILE_EXPORT_DELAY_MS = 500
MAX_KEPT_CONTEXTS = 4096


class KvfSampler(Sampler):
    """ParentBased: roots sampled by `ratio` once something exports spans, never before."""

    def __init__(self) -> None:
        self.is_exporting = False
        self.ratio = 1.0
        self._off = ParentBased(ALWAYS_OFF)
        self._on = ParentBased(TraceIdRatioBased(1.0))

    def configure(self, *, is_exporting: bool, ratio: float = 1.0) -> None:
        if not 0.0 <= ratio <= 1.0:
            raise ValueError(f"sample ratio must be in [0, 1], got {ratio}")
        self.is_exporting, self.ratio = is_exporting, ratio
        self._on = ParentBased(TraceIdRatioBased(ratio))

    def should_sample(self, *args: Any, **kwargs: Any) -> SamplingResult:
        return (self._on if self.is_exporting else self._off).should_sample(*args, **kwargs)

    def get_description(self) -> str:
        return f"kvfabric(ParentBased, roots at {self.ratio} when exporting)"


_sampler = KvfSampler()
_provider: TracerProvider | None = None


def setup_tracing(
    service: str,
    instance_id: str,
    *,
    otlp_endpoint: str | None = None,
    trace_dir: Path | None = None,
    sample_ratio: float = 1.0,
    processor: SpanProcessor | None = None,
) -> TracerProvider:
    """Install the process-wide tracer provider once; later calls add span processors."""
    global _provider
    if _provider is None:
        resource = Resource.create({"service.name": service, "service.instance.id": instance_id})
        _provider = TracerProvider(resource=resource, sampler=_sampler)
        trace.set_tracer_provider(_provider)
    for added in span_processors(service, instance_id, otlp_endpoint, trace_dir):
        _provider.add_span_processor(added)
    if processor is not None:
        _provider.add_span_processor(processor)
    if otlp_endpoint or trace_dir is not None or processor is not None:
        _sampler.configure(is_exporting=True, ratio=sample_ratio)
    return _provider


def span_processors(
    service: str, instance_id: str, otlp_endpoint: str | None, trace_dir: Path | None
) -> list[SpanProcessor]:
    """The exporters configured: OTLP/HTTP (protobuf) and the trace directory's file."""
    processors: list[SpanProcessor] = []
    if otlp_endpoint:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        processors.append(BatchSpanProcessor(OTLPSpanExporter(endpoint=otlp_endpoint)))
    if trace_dir is not None:
        exporter = JsonLinesSpanExporter(trace_file(trace_dir, service, instance_id))
        processors.append(BatchSpanProcessor(exporter, schedule_delay_millis=FILE_EXPORT_DELAY_MS))
    return processors


def shutdown_tracing() -> None:
    if _provider is not None:
        _provider.force_flush(timeout_millis=2000)


def is_exporting() -> bool:
    return _sampler.is_exporting


# -- the trace directory -----------------------------------------------------------------
def trace_file(trace_dir: Path, service: str, instance_id: str) -> Path:
    """`<dir>/<instance>.jsonl`, the service's name in front unless the id starts with it."""
    name = instance_id if instance_id.startswith(f"{service}-") else f"{service}-{instance_id}"
    return Path(trace_dir) / f"{name}.jsonl"


def span_record(span: ReadableSpan) -> dict[str, Any]:
    """One finished span as a JSON-ready dict (a line of a trace file)."""
    ctx, parent = span.context, span.parent
    resource = span.resource.attributes
    return {
        "trace_id": format(ctx.trace_id, "032x"),
        "span_id": format(ctx.span_id, "016x"),
        "parent_span_id": format(parent.span_id, "016x") if parent is not None else None,
        "name": span.name,
        "service": resource.get("service.name", ""),
        "instance_id": resource.get("service.instance.id", ""),
        "kind": span.kind.name,
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "attributes": {k: _jsonable(v) for k, v in (span.attributes or {}).items()},
        "status": {"code": span.status.status_code.name, "description": span.status.description},
    }


def _jsonable(value: Any) -> Any:
    return list(value) if isinstance(value, Sequence) and not isinstance(value, str) else value


class JsonLinesSpanExporter(SpanExporter):
    """Appends each finished span to one file as a line of JSON (the batch processor's thread
    calls `export`; one write per batch, flushed, so a reader sees whole lines)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file = path.open("a", encoding="utf-8")
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = "".join(json.dumps(span_record(s), separators=(",", ":")) + "\n" for s in spans)
        with self._lock:
            if self._file.closed:
                return SpanExportResult.FAILURE
            self._file.write(lines)
            self._file.flush()
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            self._file.close()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


# -- spans -------------------------------------------------------------------------------
# A proxy that binds to the provider once one is installed; fetching a tracer per request
# cost ~30 us (measured in the bus benchmark's profile).
_tracer = trace.get_tracer("kvfabric")


def tracer() -> trace.Tracer:
    return _tracer


def current_span() -> Span:
    return trace.get_current_span()


class _Untraced:
    """What `span` returns when nothing is traced: the parent, without a generator-based
    context manager's cost (an untraced step measured 0.55-0.65x of that one's, side by
    side, ~2 us here)."""

    __slots__ = ("span",)

    def __init__(self, span: Span) -> None:
        self.span = span

    def __enter__(self) -> Span:
        return self.span

    def __exit__(self, *exc_info: object) -> None:
        return None


class _UnsampledCurrent:
    """What `span` returns under a parent that was not sampled but is not the current span
    (a request's span kept on its job, stepped from a scheduler task): nothing is made, but
    the parent is current inside the block, so a message sent there carries its traceparent
    with the "not sampled" flag, and the next hop makes no root of its own. Without it, a
    request left out at 1% would start a stray one-span trace at 1% of its later hops."""

    __slots__ = ("span", "_token")

    def __init__(self, span: Span) -> None:
        self.span = span

    def __enter__(self) -> Span:
        self._token = otel_context.attach(trace.set_span_in_context(self.span))
        return self.span

    def __exit__(self, *exc_info: object) -> None:
        otel_context.detach(self._token)


def span(name: str, *, parent: Span | None = None) -> contextlib.AbstractContextManager[Span]:
    """A span for one step of a request, current inside the block: a child of `parent` (by
    default the current span) when that one is sampled -- ended or not: a task it started
    may run after it ended; a root when there is none and spans are exported; else nothing
    is made and the (non-recording) parent is what the block gets, current inside it."""
    current = trace.get_current_span()
    parent = current if parent is None else parent
    parent_context = parent.get_span_context()
    if parent_context.trace_flags.sampled:
        context = trace.set_span_in_context(parent)
    elif not parent_context.is_valid and _sampler.is_exporting:
        context = None
    elif parent_context.is_valid and parent is not current:
        return _UnsampledCurrent(parent)
    else:
        return _Untraced(parent)
    return _tracer.start_as_current_span(name, context=context, record_exception=False)


def child_span(parent: Span, name: str, *, start_ns: int | None = None) -> Span:
    """A child of `parent` begun at `start_ns` (now), not made current, for a step that ends
    in another task; the caller ends it. INVALID_SPAN (ending it is a no-op) when `parent`
    is not sampled."""
    if not parent.get_span_context().trace_flags.sampled:
        return INVALID_SPAN
    return _tracer.start_span(name, context=trace.set_span_in_context(parent), start_time=start_ns)


def ns_ago(perf_counter_s: float) -> int:
    """The wall-clock time (epoch ns) of an earlier `time.perf_counter()` reading."""
    return time.time_ns() - round((time.perf_counter() - perf_counter_s) * 1e9)


def inject(headers: MutableMapping[str, str]) -> None:
    """Write the current context's `traceparent` (and `tracestate`) into `headers`."""
    if trace.get_current_span().get_span_context().is_valid:
        propagate.inject(headers)


@contextlib.contextmanager
def incoming_span(name: str, headers: Mapping[str, str]) -> Iterator[Span]:
    """The span of one request taken from outside (a NATS request, an HTTP request),
    continuing the caller's trace when its headers carry one.

    A request without `traceparent` gets a span only when spans are exported: otherwise it
    would be a non-recording span, and skipping it saves ~60 us per request (a third of the
    bus's overhead over raw nats-py in the bus benchmark)."""
    if TRACEPARENT not in headers and not _sampler.is_exporting:
        yield INVALID_SPAN
        return
    with _tracer.start_as_current_span(
        name, context=propagate.extract(headers), kind=trace.SpanKind.SERVER
    ) as made:
        yield made


@contextlib.contextmanager
def server_span(
    name: str, subject: str, headers: Mapping[str, str], request_id: str = ""
) -> Iterator[None]:
    """The bus's span of one handled request (see `incoming_span`)."""
    with incoming_span(name, headers) as made:
        if made.is_recording():
            made.set_attribute("messaging.destination.name", subject)
            if request_id:
                made.set_attribute(REQUEST_ID, request_id)
        yield


def remote_parent(headers: Mapping[str, str]) -> Span:
    """The span a message's headers name as its sender's (INVALID_SPAN without one)."""
    return trace.get_current_span(propagate.extract(headers))


def current_trace_id() -> str | None:
    span = trace.get_current_span()
    if span is trace.INVALID_SPAN:
        return None
    ctx = span.get_span_context()
    return format(ctx.trace_id, "032x") if ctx.is_valid else None


# -- a context for a message another task sends later --------------------------------------
_kept: OrderedDict[str, dict[str, str]] = OrderedDict()


def keep_context(key: str) -> None:
    """Remember the current (sampled) span's context under `key`, for a message that
    another task sends later on this request's behalf: a usage record, which the durable
    outbox publishes from its own task. Each is taken once, by the first publish; the oldest
    beyond MAX_KEPT_CONTEXTS are dropped. A record sent again (after a failed publish, or by
    the next process) goes untraced, never unbilled."""
    if not trace.get_current_span().get_span_context().trace_flags.sampled:
        return
    headers: dict[str, str] = {}
    propagate.inject(headers)
    _kept[key] = headers
    if len(_kept) > MAX_KEPT_CONTEXTS:
        _kept.popitem(last=False)


def take_context(key: str) -> dict[str, str] | None:
    """The trace headers kept under `key` (once), for the message's own headers."""
    return _kept.pop(key, None)
