"""Small request/reply types for bus tests (test-only, not part of the wire contract)."""

from __future__ import annotations

from shared.schema import Message


class Echo(Message, tag="test_echo"):
    text: str
    delay_s: float = 0.0
    fail_with: str = ""


class EchoReply(Message, tag="test_echo_reply"):
    text: str
    instance_id: str


class StreamOrder(Message, tag="test_stream_order"):
    """Stream one chunk per character of `text` to `inbox` (the `GenerateRequest` shape:
    the request names the inbox its chunks go to)."""

    inbox: str
    text: str
    delay_s: float = 0.0
    fail_after: int | None = None
