"""The stream pattern over a real nats-server: order, final marker, gaps, stalls, errors."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from shared.bus import HEADER_SEQ, Context, Endpoint, ReplyMode
from shared.schema import (
    BadRequest,
    NoResponders,
    StreamGap,
    StreamStalled,
    TokenChunk,
    encode,
    pack_token_ids,
    unpack_token_ids,
)
from shared.streams import Stream, StreamWriter
from shared.testing.fixtures import BusFactory
from tests.service.messages import Echo

pytestmark = pytest.mark.nats


async def serve_counter(bus, *, fail_after: int | None = None) -> str:  # noqa: ANN001
    """Streams one TokenChunk per character of the request's text."""

    async def count(request: Echo, ctx: Context) -> AsyncIterator[TokenChunk]:
        for seq, char in enumerate(request.text):
            if fail_after is not None and seq == fail_after:
                raise BadRequest(f"refusing {char!r}")
            yield TokenChunk(
                request_id=ctx.request_id, seq=seq, token_ids=pack_token_ids([ord(char)]), text=char
            )
            await asyncio.sleep(request.delay_s)

    subject = bus.subjects.endpoint(bus.service, "count")
    await bus.serve(Endpoint("count", subject, Echo, count, ReplyMode.STREAM))
    await bus.flush()
    return subject


async def test_chunks_arrive_in_order_then_end(bus_factory: BusFactory) -> None:
    subject = await serve_counter(await bus_factory("streamer"))
    client = await bus_factory("client")
    async with Stream(client, subject, Echo(text="hello"), TokenChunk, request_id="r-9") as chunks:
        received = [chunk async for chunk in chunks]
    assert "".join(c.text for c in received) == "hello"
    assert [int(unpack_token_ids(c.token_ids)[0]) for c in received] == [ord(c) for c in "hello"]
    assert {c.request_id for c in received} == {"r-9"}


async def test_error_mid_stream_is_raised_typed(bus_factory: BusFactory) -> None:
    subject = await serve_counter(await bus_factory("streamer"), fail_after=2)
    client = await bus_factory("client")
    received = []
    with pytest.raises(BadRequest, match="refusing 'l'"):
        async with Stream(client, subject, Echo(text="hello"), TokenChunk) as chunks:
            async for chunk in chunks:
                received.append(chunk.text)
    assert received == ["h", "e"]


async def test_gap_is_detected(bus_factory: BusFactory) -> None:
    producer, client = await bus_factory("producer"), await bus_factory("client")
    stream = Stream(
        client,
        client.subjects.endpoint("nobody", "listens"),
        b"",
        TokenChunk,
        first_chunk_timeout_s=5,
    )
    # Nobody serves the subject; open the inbox by hand and play a producer that loses chunk 1.
    inbox = await client.open_inbox()
    await client.flush()  # the producer is another connection: make the server know the inbox
    stream._inbox = inbox  # noqa: SLF001 - drive the reader without a request
    writer = StreamWriter(producer, inbox.subject, request_id="r")
    await writer.send(TokenChunk(request_id="r", seq=0, text="a"))
    await producer.publish_raw(
        inbox.subject, encode(TokenChunk(request_id="r", seq=2, text="c")), {HEADER_SEQ: "2"}
    )
    assert (await stream.__anext__()).text == "a"
    with pytest.raises(StreamGap, match="expected chunk 1, got 2"):
        await stream.__anext__()
    await inbox.close()


async def test_stall_is_detected(bus_factory: BusFactory) -> None:
    subject = await serve_counter(await bus_factory("streamer"))
    client = await bus_factory("client")
    received = []
    with pytest.raises(StreamStalled):
        async with Stream(
            client, subject, Echo(text="ab", delay_s=3.0), TokenChunk, idle_timeout_s=0.3
        ) as chunks:
            async for chunk in chunks:
                received.append(chunk.text)
    assert received == ["a"]


async def test_no_responders(bus_factory: BusFactory) -> None:
    client = await bus_factory("client")
    with pytest.raises(NoResponders):
        async with Stream(
            client, client.subjects.endpoint("nobody", "home"), Echo(text="x"), TokenChunk
        ) as chunks:
            async for _ in chunks:
                pass


async def test_a_third_party_can_write_the_stream(bus_factory: BusFactory) -> None:
    """The request goes to one service, the chunks come from another (router -> decode)."""
    front, worker, client = (
        await bus_factory("front"),
        await bus_factory("worker"),
        await bus_factory("client"),
    )

    async def hand_off(request: Echo, ctx: Context) -> None:
        # The front answers nothing itself: it passes the caller's inbox on to the worker.
        writer = StreamWriter(worker, ctx.reply or "", request_id=ctx.request_id)
        await writer.send(TokenChunk(request_id=ctx.request_id, seq=0, text=request.text.upper()))
        await writer.finish()

    subject = front.subjects.endpoint("front", "go")
    await front.serve(Endpoint("go", subject, Echo, hand_off, ReplyMode.HANDOFF))
    await front.flush()
    async with Stream(client, subject, Echo(text="ok"), TokenChunk) as chunks:
        received = [c.text async for c in chunks]
    assert received == ["OK"]
    with pytest.raises(BadRequest):  # the front's own failure still reaches the caller
        async with Stream(client, subject, b"\xc1", TokenChunk) as chunks:
            [c async for c in chunks]
