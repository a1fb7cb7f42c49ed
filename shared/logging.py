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


def configure_cli_logging(level: str = "warning") -> None:
    """A command's own log lines: readable, on stderr, warnings and worse, so what a command
    prints on stdout (a table, JSON) is never mixed with them. A service it runs (`kvfabric
    serve`) configures its JSON logs over this."""
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="%Y-%m-%d %H:%M:%S", utc=True),
            structlog.dev.ConsoleRenderer(colors=False),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        # sys.stderr as it is when a line is written, not when this ran: a command run
        # in-process (typer's test runner) swaps it for a buffer it closes afterwards.
        logger_factory=lambda *_: structlog.PrintLogger(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    logging.basicConfig(level=_LEVELS[level], handlers=[_StderrNow()], force=True)


class _StderrNow(logging.StreamHandler):  # type: ignore[type-arg]
    """A handler writing to whatever sys.stderr is at the time."""

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


def get_logger(name: str) -> Any:
    return structlog.get_logger(name)


def bind_request(request_id: str, trace_id: str | None) -> None:
    """Bind ids to every log line of the current task (each request runs in its own task,
    so the binding ends with it)."""
    if request_id:
        structlog.contextvars.bind_contextvars(request_id=request_id)
    if trace_id:
        structlog.contextvars.bind_contextvars(trace_id=trace_id)
