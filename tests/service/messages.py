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
