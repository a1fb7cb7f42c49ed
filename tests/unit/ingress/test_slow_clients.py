"""Clients too slow to serve: a body trickled in past its deadline is a 408, and a stream
whose client stopped reading ends (its generation closed, as at a disconnect) once a write
has not gone out for the write timeout. The ASGI pieces of services/ingress/app.py, driven
by hand-made receive and send callables."""

from __future__ import annotations

import asyncio

import pytest
from starlette.exceptions import HTTPException

from services.ingress.app import BodyLimit, _StreamingResponse

SCOPE = {"type": "http", "path": "/v1/chat/completions", "headers": []}


async def test_a_trickled_body_is_a_408_and_a_whole_one_passes() -> None:
    read: list[bytes] = []

    async def app(scope, receive, send) -> None:  # noqa: ANN001
        while True:
            message = await receive()
            read.append(message.get("body", b""))
            if not message.get("more_body"):
                return

    async def trickle() -> dict:
        await asyncio.sleep(0.05)
        return {"type": "http.request", "body": b"x", "more_body": True}

    with pytest.raises(HTTPException) as refused:
        await BodyLimit(app, max_body_bytes=1000, body_timeout_s=0.3)(SCOPE, trickle, None)
    assert refused.value.status_code == 408
    assert 3 <= len(read) <= 7  # what came in before the deadline

    async def whole() -> dict:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    read.clear()
    await BodyLimit(app, max_body_bytes=1000, body_timeout_s=0.3)(SCOPE, whole, None)
    assert read == [b"{}"]


async def test_a_stream_nobody_reads_ends_after_the_write_timeout() -> None:
    closed = asyncio.Event()

    async def frames():  # noqa: ANN202
        try:
            while True:
                yield b"data: {}\n\n"
                await asyncio.sleep(0)
        finally:
            closed.set()  # where the request is cancelled downstream

    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)
        if message["type"] == "http.response.body" and len(sent) > 3:
            await asyncio.Event().wait()  # the client's socket is full: never goes out

    async def receive() -> dict:
        await asyncio.Event().wait()  # no disconnect either
        return {}

    response = _StreamingResponse(frames(), media_type="text/event-stream")
    response.write_timeout_s = 0.3
    async with asyncio.timeout(5):
        await response(SCOPE, receive, send)
    assert closed.is_set()
    assert sent[0]["type"] == "http.response.start" and len(sent) == 4
