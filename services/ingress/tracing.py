"""One span per HTTP request: the root of the request's trace across every hop (or a child of
the client's own, when its `traceparent` header names one).

The span is named by method and route, carries the protocol and the response status, and
lasts until the last byte of a streamed answer; the pipeline adds the model and request id.
A traced request's response carries its trace id in `x-trace-id`, and the request's log
lines carry it too, so a client's complaint leads straight to `kvfabric trace`. /health and
/openapi.json are never traced: probes would bury the requests.
"""

from __future__ import annotations

import time

from opentelemetry.trace import StatusCode

from shared import telemetry
from shared.logging import bind_request, get_logger

log = get_logger(__name__)

TRACE_ID_HEADER = "x-trace-id"
UNTRACED_PATHS = frozenset({"/health", "/readyz", "/livez", "/openapi.json"})
_PROPAGATED = (b"traceparent", b"tracestate")


def protocol_of(path: str) -> str:
    """The API a path belongs to (C-05: OpenAI's routes also answer without /v1)."""
    route = path.removeprefix("/v1")
    if route.startswith("/chat/completions"):
        return "openai.chat_completions"
    if route.startswith("/responses"):
        return "openai.responses"
    if route.startswith("/messages"):
        return "anthropic.messages"
    return "kvfabric"


def route_of(path: str) -> str:
    """The path with a stored response's id replaced, so span names stay few."""
    for prefix in ("/v1/responses/", "/responses/"):
        if path.startswith(prefix) and len(path) > len(prefix):
            return prefix + "{response_id}"
    return path


class TraceRequests:
    """The ASGI middleware (outermost, so refusals of the body limit are traced as well)."""

    def __init__(self, app) -> None:  # noqa: ANN001
        self.app = app

    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001
        if scope["type"] != "http" or scope["path"] in UNTRACED_PATHS:
            return await self.app(scope, receive, send)
        headers = {
            k.decode("latin-1"): v.decode("latin-1")
            for k, v in scope["headers"]
            if k in _PROPAGATED
        }
        method, path = scope["method"], scope["path"]
        with telemetry.incoming_span(f"{method} {route_of(path)}", headers) as span:
            if not span.is_recording():
                return await self.app(scope, receive, send)
            trace_id = format(span.get_span_context().trace_id, "032x")
            bind_request("", trace_id)  # this request's task: every line it logs names the trace
            span.set_attributes(
                {
                    "http.request.method": method,
                    "url.path": path,
                    "kvfabric.protocol": protocol_of(path),
                }
            )
            status = 500  # what the client sees if the app fails before answering
            started = time.perf_counter()

            async def send_traced(message) -> None:  # noqa: ANN001
                nonlocal status
                if message["type"] == "http.response.start":
                    status = message["status"]
                    extra = [(TRACE_ID_HEADER.encode(), trace_id.encode())]
                    message = {**message, "headers": [*message.get("headers", ()), *extra]}
                await send(message)

            try:
                await self.app(scope, receive, send_traced)
            finally:
                span.set_attribute("http.response.status_code", status)
                if status >= 500:
                    span.set_status(StatusCode.ERROR, f"HTTP {status}")
                log.info(
                    "http request",
                    method=method,
                    path=path,
                    status=status,
                    duration_ms=round((time.perf_counter() - started) * 1000, 3),
                )
