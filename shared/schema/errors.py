"""Typed errors: one code table, one exception per code, one error payload.

On the wire an error is a reply (or a final stream message) carrying the headers
`Nats-Service-Error: <message>` and `Nats-Service-Error-Code: <numeric code>` (the NATS micro
convention, so any NATS tool shows it) and an `ErrorReply` body with the symbolic code and,
for OVERLOADED, a retry-after. The caller's bus raises the matching `ServiceError` subclass.
"""

from __future__ import annotations

from enum import StrEnum

from shared.schema.base import Message


class ErrorCode(StrEnum):
    BAD_REQUEST = "BAD_REQUEST"
    UNAUTHORIZED = "UNAUTHORIZED"
    NOT_FOUND = "NOT_FOUND"
    CANCELLED = "CANCELLED"
    OVERLOADED = "OVERLOADED"
    INTERNAL = "INTERNAL"
    UNAVAILABLE = "UNAVAILABLE"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"


# Numeric codes follow HTTP where one fits, so ingress maps them to statuses without a table.
NUMERIC_CODES: dict[ErrorCode, int] = {
    ErrorCode.BAD_REQUEST: 400,
    ErrorCode.UNAUTHORIZED: 401,
    ErrorCode.NOT_FOUND: 404,
    ErrorCode.CANCELLED: 499,
    ErrorCode.OVERLOADED: 429,
    ErrorCode.INTERNAL: 500,
    ErrorCode.UNAVAILABLE: 503,
    ErrorCode.DEADLINE_EXCEEDED: 504,
}
_BY_NUMBER = {number: code for code, number in NUMERIC_CODES.items()}


class ErrorReply(Message, tag="error"):
    code: ErrorCode
    message: str
    request_id: str = ""
    retry_after_s: float | None = None


class ServiceError(Exception):
    """An expected failure with a code a caller can act on. Never carries a traceback."""

    code: ErrorCode = ErrorCode.INTERNAL

    def __init__(self, message: str, *, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after_s = retry_after_s

    @property
    def numeric_code(self) -> int:
        return NUMERIC_CODES[self.code]

    def to_reply(self, request_id: str = "") -> ErrorReply:
        return ErrorReply(
            code=self.code,
            message=self.message,
            request_id=request_id,
            retry_after_s=self.retry_after_s,
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r})"


class BadRequest(ServiceError):
    code = ErrorCode.BAD_REQUEST


class Unauthorized(ServiceError):
    code = ErrorCode.UNAUTHORIZED


class NotFound(ServiceError):
    code = ErrorCode.NOT_FOUND


class Cancelled(ServiceError):
    code = ErrorCode.CANCELLED


class Overloaded(ServiceError):
    code = ErrorCode.OVERLOADED


class InternalError(ServiceError):
    code = ErrorCode.INTERNAL


class Unavailable(ServiceError):
    code = ErrorCode.UNAVAILABLE


class NoResponders(Unavailable):
    """Nobody subscribes to the subject (no instance of the service is up)."""


class StreamGap(Unavailable):
    """A stream lost a chunk (sequence numbers jumped): the producer or the link failed."""


class StreamStalled(Unavailable):
    """No chunk arrived within the stream's idle timeout: the producer is gone or stuck."""


class DeadlineExceeded(ServiceError):
    code = ErrorCode.DEADLINE_EXCEEDED


_BY_CODE: dict[ErrorCode, type[ServiceError]] = {
    cls.code: cls
    for cls in (
        BadRequest,
        Unauthorized,
        NotFound,
        Cancelled,
        Overloaded,
        InternalError,
        Unavailable,
        DeadlineExceeded,
    )
}


def error_from_wire(
    numeric_code: str | None, description: str, reply: ErrorReply | None = None
) -> ServiceError:
    """Rebuild the typed exception from error headers (and the body, when it decoded)."""
    if reply is not None:
        return _BY_CODE[reply.code](reply.message, retry_after_s=reply.retry_after_s)
    code = None
    if numeric_code is not None and numeric_code.isdigit():
        code = _BY_NUMBER.get(int(numeric_code))
    return _BY_CODE[code or ErrorCode.INTERNAL](description)
