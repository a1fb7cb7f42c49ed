"""structlog JSON logs on stderr, one line per event, with service, instance, request and
trace ids bound (the bus binds request_id/trace_id per handled request through contextvars)."""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog

_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}


def configure_logging(*, service: str, instance_id: str, level: str = "info") -> None:
    """Configure structlog and the stdlib root logger (third-party libraries) alike."""
    numeric = _LEVELS[level]
    processors: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
        structlog.processors.format_exc_info,
        structlog.processors.JSONRenderer(),
    ]
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(service=service, instance_id=instance_id)
    logging.basicConfig(level=max(numeric, logging.WARNING), stream=sys.stderr, force=True)


def get_logger(name: str) -> Any:
    return structlog.get_logger(name)


def bind_request(request_id: str, trace_id: str | None) -> None:
    """Bind ids to every log line of the current task (each request runs in its own task,
    so the binding ends with it)."""
    if request_id:
        structlog.contextvars.bind_contextvars(request_id=request_id)
    if trace_id:
        structlog.contextvars.bind_contextvars(trace_id=trace_id)
