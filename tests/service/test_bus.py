"""shared.bus against a real nats-server: replies, queue groups, addressing, errors, drain."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from shared.bus import ERROR_CODE_HEADER, ERROR_HEADER, Bus, Context, Endpoint, now_ms
from shared.schema import (
    BadRequest,
    DeadlineExceeded,
    InternalError,
    NoResponders,
    Overloaded,
    decode,
    encode,
)
from shared.schema.errors import ErrorReply
from shared.testing.fixtures import BusFactory
from shared.testing.waits import eventually
from tests.service.messages import Echo, EchoReply

pytestmark = pytest.mark.nats


async def serve_echo(bus: Bus, name: str = "echo") -> Endpoint:
    async def handle(request: Echo, ctx: Context) -> EchoReply:
        if request.delay_s:
            await asyncio.sleep(request.delay_s)
        if request.fail_with == "overloaded":
            raise Overloaded("queues full", retry_after_s=1.5)
        if request.fail_with == "crash":
            raise RuntimeError("secret internals")
        return EchoReply(text=request.text, instance_id=bus.instance_id)

    endpoint = Endpoint(name, bus.subjects.endpoint(bus.service, name), Echo, handle)
    await bus.serve(endpoint)
    await bus.flush()
    return endpoint


async def test_request_reply(bus_factory: BusFactory) -> None:
    server = await bus_factory("echo-svc")
    endpoint = await serve_echo(server)
    client = await bus_factory("client")
    reply = await client.request(endpoint.subject, Echo(text="hi"), EchoReply, request_id="r-1")
    assert reply == EchoReply(text="hi", instance_id=server.instance_id)


async def test_queue_group_shares_work(bus_factory: BusFactory) -> None:
    first, second = await bus_factory("echo-svc"), await bus_factory("echo-svc")
    endpoint = await serve_echo(first)
    await serve_echo(second)
    client = await bus_factory("client")
    replies = await asyncio.gather(
        *(client.request(endpoint.subject, Echo(text=str(i)), EchoReply) for i in range(200))
    )
    counts = Counter(r.instance_id for r in replies)
    assert set(counts) == {first.instance_id, second.instance_id}
    assert sum(counts.values()) == 200  # each request answered exactly once
    assert min(counts.values()) >= 40  # NATS picks randomly: 200 draws, 40 is far in the tail


async def test_instance_subject_addresses_one_worker(bus_factory: BusFactory) -> None:
    first, second = await bus_factory("echo-svc"), await bus_factory("echo-svc")
    endpoint = await serve_echo(first)
    await serve_echo(second)
    client = await bus_factory("client")
    subject = client.subjects.instance(endpoint.subject, second.instance_id)
    replies = [await client.request(subject, Echo(text="x"), EchoReply) for _ in range(20)]
    assert {r.instance_id for r in replies} == {second.instance_id}


async def test_typed_error_travels_in_headers(bus_factory: BusFactory) -> None:
    server = await bus_factory("echo-svc")
    endpoint = await serve_echo(server)
    client = await bus_factory("client")
    with pytest.raises(Overloaded) as caught:
        await client.request(endpoint.subject, Echo(text="x", fail_with="overloaded"), EchoReply)
    assert caught.value.message == "queues full"
    assert caught.value.retry_after_s == 1.5


async def test_error_headers_on_the_wire(bus_factory: BusFactory) -> None:
    server = await bus_factory("echo-svc")
    endpoint = await serve_echo(server)
    client = await bus_factory("client")
    inbox = await client.open_inbox()
    await client.publish_raw(
        endpoint.subject, encode(Echo(text="x", fail_with="overloaded")), reply=inbox.subject
    )
    msg = await inbox.next(5.0)
    assert msg is not None
    assert msg.headers[ERROR_CODE_HEADER] == "429"
    assert msg.headers[ERROR_HEADER] == "queues full"
    assert decode(msg.data, ErrorReply).retry_after_s == 1.5
    await inbox.close()


async def test_crash_becomes_internal_error_without_internals(bus_factory: BusFactory) -> None:
    server = await bus_factory("echo-svc")
    endpoint = await serve_echo(server)
    client = await bus_factory("client")
    with pytest.raises(InternalError) as caught:
        await client.request(endpoint.subject, Echo(text="x", fail_with="crash"), EchoReply)
    assert "secret" not in caught.value.message
    assert (await client.request(endpoint.subject, Echo(text="ok"), EchoReply)).text == "ok"


async def test_timeout(bus_factory: BusFactory) -> None:
    server = await bus_factory("echo-svc")
    endpoint = await serve_echo(server)
    client = await bus_factory("client")
    with pytest.raises(DeadlineExceeded):
        await client.request(
            endpoint.subject, Echo(text="x", delay_s=2.0), EchoReply, timeout_s=0.2
        )


async def test_deadline_header_stops_the_handler(bus_factory: BusFactory) -> None:
    server = await bus_factory("echo-svc")
    endpoint = await serve_echo(server)
    client = await bus_factory("client")
    with pytest.raises(DeadlineExceeded):
        # The caller waits up to 5 s, but the absolute deadline is 0.3 s away: the server
        # gives up at the deadline and says so, instead of the caller timing out blind.
        await client.request(
            endpoint.subject,
            Echo(text="x", delay_s=3.0),
            EchoReply,
            timeout_s=5.0,
            deadline_ms=now_ms() + 300,
        )

    def last_error() -> str:
        return {s.name: s for s in server.endpoint_stats()}["echo"].last_error

    # The caller's own deadline may fire before the server has counted the one it enforced.
    await eventually(lambda: "DEADLINE_EXCEEDED" in last_error(), timeout_s=10)
    with pytest.raises(DeadlineExceeded):  # already past: not even sent
        await client.request(endpoint.subject, Echo(text="x"), EchoReply, deadline_ms=now_ms() - 1)


async def test_no_responders(bus_factory: BusFactory) -> None:
    client = await bus_factory("client")
    with pytest.raises(NoResponders):
        await client.request(client.subjects.endpoint("nobody", "home"), Echo(text="x"), EchoReply)


async def test_malformed_payload_gets_bad_request_and_service_keeps_serving(
    bus_factory: BusFactory,
) -> None:
    server = await bus_factory("echo-svc")
    endpoint = await serve_echo(server)
    client = await bus_factory("client")
    with pytest.raises(BadRequest) as caught:
        await client.request(endpoint.subject, b"\xc1 not msgpack", EchoReply)
    assert "Echo" in caught.value.message
    with pytest.raises(BadRequest):  # valid msgpack, wrong type
        await client.request(
            endpoint.subject, encode(EchoReply(text="x", instance_id="y")), EchoReply
        )
    assert (
        await client.request(endpoint.subject, Echo(text="still here"), EchoReply)
    ).text == "still here"


async def test_drain_completes_the_request_in_flight(bus_factory: BusFactory) -> None:
    server = await bus_factory("echo-svc")
    endpoint = await serve_echo(server)
    client = await bus_factory("client")
    pending = asyncio.create_task(
        client.request(endpoint.subject, Echo(text="slow", delay_s=0.5), EchoReply)
    )
    while server.num_inflight == 0:
        await asyncio.sleep(0.01)
    await server.stop_serving(grace_s=5.0)
    assert (await pending).text == "slow"
    # It took no new work after the drain began.
    with pytest.raises(NoResponders):
        await client.request(endpoint.subject, Echo(text="late"), EchoReply)
    await server.stop_serving(grace_s=5.0)  # safe to repeat
    await server.close()
    await server.close()


async def test_drain_cancels_what_outlives_the_grace_period(bus_factory: BusFactory) -> None:
    server = await bus_factory("echo-svc")
    endpoint = await serve_echo(server)
    client = await bus_factory("client")
    pending = asyncio.create_task(
        client.request(endpoint.subject, Echo(text="x", delay_s=30), EchoReply)
    )
    while server.num_inflight == 0:
        await asyncio.sleep(0.01)
    await server.stop_serving(grace_s=0.2)
    assert server.num_inflight == 0
    pending.cancel()


async def test_events_are_decoded_and_malformed_ones_skipped(bus_factory: BusFactory) -> None:
    publisher, consumer = await bus_factory("pub"), await bus_factory("sub")
    received: list[Echo] = []
    done = asyncio.Event()

    async def on_event(event: Echo) -> None:
        received.append(event)
        if event.text == "last":
            done.set()

    subject = consumer.subjects.endpoint("events", "test")
    await consumer.subscribe(subject, Echo, on_event)
    await consumer.flush()
    await publisher.publish(subject, Echo(text="first"))
    await publisher.publish_raw(subject, b"\xc1garbage")
    await publisher.publish(subject, Echo(text="last"))
    await asyncio.wait_for(done.wait(), 5.0)
    assert [e.text for e in received] == ["first", "last"]
