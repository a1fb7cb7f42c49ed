"""The bus: the only package that imports `nats` (docs/design.md, 'Services'). Re-exports:
`core` (the `Bus`), `endpoints` (serving requests), `jetstream` (`bus.js`), `connection`,
`wire` (headers, typed errors, deadlines)."""

from shared.bus.core import Bus, Inbox
from shared.bus.endpoints import Context, Endpoint, EndpointStats, Handler
from shared.bus.jetstream import JetStream, NoStream, PullConsumer, PulledMessage
from shared.bus.wire import (
    ERROR_CODE_HEADER,
    ERROR_HEADER,
    HEADER_DEADLINE_MS,
    HEADER_FINAL,
    HEADER_REQUEST_ID,
    HEADER_SCHEMA,
    HEADER_SEQ,
    NO_RESPONDERS_STATUS,
    STATUS_HEADER,
    RawMessage,
    effective_timeout_s,
    error_headers,
    now_ms,
    raise_if_error,
)

__all__ = [
    "ERROR_CODE_HEADER",
    "ERROR_HEADER",
    "HEADER_DEADLINE_MS",
    "HEADER_FINAL",
    "HEADER_REQUEST_ID",
    "HEADER_SCHEMA",
    "HEADER_SEQ",
    "NO_RESPONDERS_STATUS",
    "STATUS_HEADER",
    "Bus",
    "Context",
    "Endpoint",
    "EndpointStats",
    "Handler",
    "Inbox",
    "JetStream",
    "NoStream",
    "PullConsumer",
    "PulledMessage",
    "RawMessage",
    "effective_timeout_s",
    "error_headers",
    "now_ms",
    "raise_if_error",
]
