"""What travels beside a payload on the bus: header names, raw messages, typed errors in
the `Nats-Service-Error(-Code)` headers, and absolute deadlines."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import msgspec
from nats.aio.msg import Msg

from shared.schema import DeadlineExceeded, ErrorReply, ServiceError, decode, error_from_wire

HEADER_REQUEST_ID = "Kvf-Request-Id"
HEADER_DEADLINE_MS = "Kvf-Deadline-Ms"  # absolute, epoch milliseconds
HEADER_SCHEMA = "Kvf-Schema"
HEADER_SEQ = "Kvf-Seq"
HEADER_FINAL = "Kvf-Final"
ERROR_HEADER = "Nats-Service-Error"
ERROR_CODE_HEADER = "Nats-Service-Error-Code"
STATUS_HEADER = "Status"  # set by nats-py from the server's inline status line
NO_RESPONDERS_STATUS = "503"


def now_ms() -> int:
    return int(time.time() * 1000)


@dataclass(frozen=True)
class RawMessage:
    subject: str
    data: bytes
    reply: str | None
    headers: dict[str, str] = field(default_factory=dict)


def raw_message(msg: Msg) -> RawMessage:
    return RawMessage(
        subject=msg.subject, data=msg.data, reply=msg.reply or None, headers=dict(msg.headers or {})
    )


def error_headers(exc: ServiceError) -> dict[str, str]:
    return {ERROR_HEADER: exc.message, ERROR_CODE_HEADER: str(exc.numeric_code)}


def raise_if_error(msg: RawMessage) -> None:
    """Raise the typed error a reply or stream message carries, if any."""
    if ERROR_CODE_HEADER not in msg.headers:
        return
    reply: ErrorReply | None
    try:
        reply = decode(msg.data, ErrorReply) if msg.data else None
    except msgspec.DecodeError:
        reply = None  # a non-kvfabric micro service: the headers alone carry the error
    raise error_from_wire(
        msg.headers.get(ERROR_CODE_HEADER), msg.headers.get(ERROR_HEADER, ""), reply
    )


def effective_timeout_s(timeout_s: float, deadline_ms: int | None, subject: str) -> float:
    """`timeout_s`, cut to what is left before an absolute deadline."""
    if deadline_ms is None:
        return timeout_s
    remaining_s = (deadline_ms - now_ms()) / 1000
    if remaining_s <= 0:
        raise DeadlineExceeded(f"deadline passed before the request to {subject} was sent")
    return min(timeout_s, remaining_s)
