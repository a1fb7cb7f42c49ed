"""Server-sent events as the official SDKs read them (docs/design.md, 'HTTP APIs': C-01,
C-02, AN-S-01).

`data:` carries compact JSON, never empty; Anthropic's events also need their `event:` line
(its SDK dispatches on it); keep-alives are SSE comments, which both SDKs skip.
"""

from __future__ import annotations

from typing import Any

import msgspec

KEEPALIVE_COMMENT = b": keep-alive\n\n"
DONE = b"data: [DONE]\n\n"
HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}
MEDIA_TYPE = "text/event-stream"

_encode = msgspec.json.Encoder().encode


def data(payload: dict[str, Any]) -> bytes:
    return b"data: " + _encode(payload) + b"\n\n"


def event(name: str, payload: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + _encode(payload) + b"\n\n"


def json_bytes(payload: dict[str, Any]) -> bytes:
    return _encode(payload)
