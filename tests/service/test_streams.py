"""The stream pattern over a real nats-server: order, final marker, gaps, stalls, errors.

As on the request path, the request names the caller's inbox and the chunks come from
whoever the request was handed to (`StreamWriter`); the caller reads them with `ChunkReader`.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from shared.bus import HEADER_SEQ, Bus, Context, Endpoint
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
from shared.streams import ChunkReader, StreamWriter
from shared.testing.fixtures import BusFactory
from tests.service.messages import StreamOrder

pytestmark = pytest.mark.nats


async def serve_counter(front: Bus, producer: Bus) -> str:
    """`front` takes the order and answers at once; `producer` streams one TokenChunk per
    character of its text to the order's inbox (router -> decode worker)."""
    tasks: set[asyncio.Task[None]] = set()

    async def produce(order: StreamOrder, request_id: str) -> None:
        writer = StreamWriter(producer, order.inbox, request_id=request_id)
        for seq, char in enumerate(order.text):
            if order.fail_after is not None and seq == order.fail_after:
                await writer.fail(BadRequest(f"refusing {char!r}"))
                return
            ids = pack_token_ids([ord(char)])
            await writer.send(TokenChunk(request_id=request_id, seq=seq, token_ids=ids, text=char))
            await asyncio.sleep(order.delay_s)
        await writer.finish()

    async def take(order: StreamOrder, ctx: Context) -> None:
        if not order.inbox:
            raise BadRequest("an inbox is required")
        task = asyncio.create_task(produce(order, ctx.request_id))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    subject = front.subjects.endpoint(front.service, "count")
    await front.serve(Endpoint("count", subject, StreamOrder, take))
    await front.flush()
    return subject


async def read_all(reader: ChunkReader[TokenChunk]) -> list[TokenChunk]:
    chunks = []
    while (chunk := await reader.next()) is not None:
        chunks.append(chunk)
    return chunks


async def start(
    client: Bus, subject: str, text: str, *, idle_timeout_s: float = 30.0, **order: Any
) -> ChunkReader[TokenChunk]:
    """Send an order naming a fresh inbox; the reader of that inbox."""
    inbox = await client.open_inbox()
    await client.request(
        subject, StreamOrder(inbox=inbox.subject, text=text, **order), bytes, request_id="r-9"
    )
    return ChunkReader(inbox, TokenChunk, subject, idle_timeout_s=idle_timeout_s)


async def test_chunks_arrive_in_order_then_end(bus_factory: BusFactory) -> None:
    client = await bus_factory("client")
    subject = await serve_counter(await bus_factory("front"), await bus_factory("producer"))
    reader = await start(client, subject, "hello")
    received = await read_all(reader)
    assert "".join(c.text for c in received) == "hello"
    assert [int(unpack_token_ids(c.token_ids)[0]) for c in received] == [ord(c) for c in "hello"]
    assert {c.request_id for c in received} == {"r-9"}
    assert reader.has_final and reader.num_received == 6  # five chunks and the empty final
    assert await reader.next() is None  # ended: no more reads


async def test_error_mid_stream_is_raised_typed(bus_factory: BusFactory) -> None:
    client = await bus_factory("client")
    subject = await serve_counter(await bus_factory("front"), await bus_factory("producer"))
    reader = await start(client, subject, "hello", fail_after=2)
    received = []
    with pytest.raises(BadRequest, match="refusing 'l'"):
        while (chunk := await reader.next()) is not None:
            received.append(chunk.text)
    assert received == ["h", "e"]
    assert reader.has_final


async def test_gap_is_detected(bus_factory: BusFactory) -> None:
    producer, client = await bus_factory("producer"), await bus_factory("client")
    inbox = await client.open_inbox()
    await client.flush()  # the producer is another connection: make the server know the inbox
    reader = ChunkReader(inbox, TokenChunk, "a producer that loses chunk 1")
    writer = StreamWriter(producer, inbox.subject, request_id="r")
    await writer.send(TokenChunk(request_id="r", seq=0, text="a"))
    await producer.publish_raw(
        inbox.subject, encode(TokenChunk(request_id="r", seq=2, text="c")), {HEADER_SEQ: "2"}
    )
    first = await reader.next()
    assert first is not None and first.text == "a"
    with pytest.raises(StreamGap, match="expected chunk 1, got 2"):
        await reader.next()
    await inbox.close()


async def test_stall_is_detected(bus_factory: BusFactory) -> None:
    client = await bus_factory("client")
    subject = await serve_counter(await bus_factory("front"), await bus_factory("producer"))
    reader = await start(client, subject, "ab", delay_s=3.0, idle_timeout_s=0.3)
    received = []
    with pytest.raises(StreamStalled):
        while (chunk := await reader.next()) is not None:
            received.append(chunk.text)
    assert received == ["a"]


async def test_no_responders_from_a_producer_that_is_gone(bus_factory: BusFactory) -> None:
    """A message whose reply subject is our inbox and nobody serves it comes back as the
    server's 503 status: the reader raises NoResponders instead of waiting out its timeout."""
    client = await bus_factory("client")
    inbox = await client.open_inbox()
    reader = ChunkReader(inbox, TokenChunk, "nobody", first_chunk_timeout_s=5)
    await client.publish_raw(client.subjects.endpoint("nobody", "home"), b"", reply=inbox.subject)
    with pytest.raises(NoResponders):
        await reader.next()
    await inbox.close()


async def test_the_front_s_own_failure_reaches_the_caller(bus_factory: BusFactory) -> None:
    client = await bus_factory("client")
    subject = await serve_counter(await bus_factory("front"), await bus_factory("producer"))
    with pytest.raises(BadRequest, match="inbox is required"):
        await client.request(subject, StreamOrder(inbox="", text="x"), bytes)
