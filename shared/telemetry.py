"""OpenTelemetry tracing: W3C `traceparent` in NATS headers, OTLP export when configured.

A real SDK tracer provider is always installed. Tracing is off by default: with no exporter
the sampler records only spans whose incoming parent was sampled (`ParentBased(ALWAYS_OFF)`),
so a request that carries a sampled `traceparent` is still traced through every hop, and one
that carries none costs no span. With an exporter (`otlp_endpoint`, or a processor given by
a test) every root is sampled.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import (
    ALWAYS_OFF,
    ALWAYS_ON,
    ParentBased,
    Sampler,
    SamplingResult,
)


class _Sampler(Sampler):
    """ParentBased, with roots sampled only once something exports spans."""

    def __init__(self) -> None:
        self.is_exporting = False
        self._on, self._off = ParentBased(ALWAYS_ON), ParentBased(ALWAYS_OFF)

    def should_sample(self, *args: Any, **kwargs: Any) -> SamplingResult:
        return (self._on if self.is_exporting else self._off).should_sample(*args, **kwargs)

    def get_description(self) -> str:
        return "kvfabric(ParentBased, roots sampled when exporting)"


_sampler = _Sampler()
TRACEPARENT = "traceparent"
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
        _provider = TracerProvider(resource=resource, sampler=_sampler)
        trace.set_tracer_provider(_provider)
        if otlp_endpoint:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            _provider.add_span_processor(
                BatchSpanProcessor(OTLPSpanExporter(endpoint=otlp_endpoint))
            )
    if processor is not None:
        _provider.add_span_processor(processor)
    if otlp_endpoint or processor is not None:
        _sampler.is_exporting = True
    return _provider


def shutdown_tracing() -> None:
    if _provider is not None:
        _provider.force_flush(timeout_millis=2000)


# A proxy that binds to the provider once one is installed; fetching a tracer per request
# cost ~30 us (measured in the bus benchmark's profile).
_tracer = trace.get_tracer("kvfabric")


def tracer() -> trace.Tracer:
    return _tracer


def inject(headers: MutableMapping[str, str]) -> None:
    """Write the current context's `traceparent` (and `tracestate`) into `headers`."""
    if trace.get_current_span().get_span_context().is_valid:
        propagate.inject(headers)


@contextlib.contextmanager
def server_span(name: str, subject: str, headers: Mapping[str, str]) -> Iterator[None]:
    """The span of one handled request, continuing the caller's trace.

    A request without `traceparent` gets a span only when spans are exported: otherwise it
    would be a non-recording span, and skipping it saves ~60 us per request (a third of the
    bus's overhead over raw nats-py in the bus benchmark)."""
    if TRACEPARENT not in headers and not _sampler.is_exporting:
        yield
        return
    with _tracer.start_as_current_span(
        name, context=propagate.extract(headers), kind=trace.SpanKind.SERVER
    ) as span:
        span.set_attribute("messaging.destination.name", subject)
        yield


def extract(headers: Mapping[str, str] | None) -> otel_context.Context:
    return propagate.extract(headers or {})


def current_trace_id() -> str | None:
    span = trace.get_current_span()
    if span is trace.INVALID_SPAN:
        return None
    ctx = span.get_span_context()
    return format(ctx.trace_id, "032x") if ctx.is_valid else None
