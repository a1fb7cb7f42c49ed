"""OpenTelemetry tracing: W3C `traceparent` in NATS headers, OTLP export when configured.

A real SDK tracer provider is always installed (with no exporter unless `otlp_endpoint` is
set), so every hop creates valid span contexts and a trace continues across processes even
where nothing is exported.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

_provider: TracerProvider | None = None


def setup_tracing(
    service: str,
    instance_id: str,
    *,
    otlp_endpoint: str | None = None,
    processor: SpanProcessor | None = None,
) -> TracerProvider:
    """Install the process-wide tracer provider once; later calls add span processors."""
    global _provider
    if _provider is None:
        resource = Resource.create({"service.name": service, "service.instance.id": instance_id})
        _provider = TracerProvider(resource=resource)
        trace.set_tracer_provider(_provider)
        if otlp_endpoint:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            _provider.add_span_processor(
                BatchSpanProcessor(OTLPSpanExporter(endpoint=otlp_endpoint))
            )
    if processor is not None:
        _provider.add_span_processor(processor)
    return _provider


def shutdown_tracing() -> None:
    if _provider is not None:
        _provider.force_flush(timeout_millis=2000)


def tracer() -> trace.Tracer:
    return trace.get_tracer("kvfabric")


def inject(headers: MutableMapping[str, str]) -> None:
    """Write the current context's `traceparent` (and `tracestate`) into `headers`."""
    propagate.inject(headers)


def extract(headers: Mapping[str, str] | None) -> otel_context.Context:
    return propagate.extract(headers or {})


def current_trace_id() -> str | None:
    ctx = trace.get_current_span().get_span_context()
    return format(ctx.trace_id, "032x") if ctx.is_valid else None
