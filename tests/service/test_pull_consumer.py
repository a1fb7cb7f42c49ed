"""The durable pull consumer billing replicas share, on a real nats-server: each message goes
to one puller, an unacknowledged one comes back (to anyone), an acknowledged one never does,
and a batch returns what there is once its wait expires."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from shared.bus import Bus
from shared.natsd import NatsServer
from shared.schema import UsageRecord, decode
from shared.subjects import DECODE
from shared.testing.fixtures import BusFactory
from shared.testing.waits import eventually
from shared.usage import ensure_usage_stream

pytestmark = pytest.mark.nats


def record(i: int) -> UsageRecord:
    return UsageRecord(
        request_id=f"r-{i}",
        api_key_id="k",
        model="m",
        num_cache_hit_tokens=i,
        num_cache_miss_tokens=1,
        num_output_tokens=1,
    )


async def test_replicas_share_a_durable_and_unacked_messages_come_back(
    bus_factory: BusFactory,
) -> None:
    bus_a, bus_b = await bus_factory("billing", "billing-0"), await bus_factory("billing", "b-1")
    await ensure_usage_stream(bus_a)
    s = bus_a.subjects
    for i in range(300):
        await bus_a.js.publish(s.usage(DECODE), record(i), msg_id=f"r-{i}")
    a = await bus_a.js.pull(s.usage_stream, s.usage_all, "billing", ack_wait_s=1.0)
    b = await bus_b.js.pull(s.usage_stream, s.usage_all, "billing", ack_wait_s=1.0)
    got_a, got_b = await asyncio.gather(a.fetch(100, 2.0), b.fetch(100, 2.0))
    assert len(got_a) == len(got_b) == 100  # a full batch returns at once
    ids_a = {decode(m.data, UsageRecord).request_id for m in got_a}
    ids_b = {decode(m.data, UsageRecord).request_id for m in got_b}
    assert not ids_a & ids_b  # each message to one puller
    for m in got_a + got_b:
        await m.ack()
    rest = await a.fetch(500, 0.5)  # fewer than asked: what there is, once the wait expires
    assert len(rest) == 100 and all(m.num_delivered == 1 for m in rest)
    # never acknowledged: delivered again after ack_wait, to whoever pulls
    again = await b.fetch(500, 3.0)
    assert {m.stream_seq for m in again} == {m.stream_seq for m in rest}
    assert all(m.num_delivered >= 2 for m in again)  # (again at each ack_wait while unacked)
    for m in again:
        await m.ack()
    assert await a.fetch(10, 0.3) == []  # everything acknowledged: nothing comes back
    await a.close()
    await b.close()


async def test_streams_and_consumers_set_up_while_the_server_restarts_wait_for_it(
    tmp_path: Path,
) -> None:
    """A service starting beside a NATS restart (its JetStream calls unanswered for a while)
    sets up its stream and consumer once the server is back, instead of dying."""
    server = NatsServer(tmp_path / "nats").start()
    bus = await Bus.connect(server.url, service="billing", root="restart")
    try:
        server.stop()
        with capture_logs() as events:
            setup = asyncio.create_task(ensure_usage_stream(bus))
            await eventually(lambda: any("did not answer" in str(e["event"]) for e in events))
            server.start()  # the same port and store
            await asyncio.wait_for(setup, 60)
        s = bus.subjects
        consumer = await bus.js.pull(s.usage_stream, s.usage_all, "billing")
        await bus.js.publish(s.usage(DECODE), record(1), msg_id="r-1")
        (msg,) = await consumer.fetch(1, 5.0)
        assert decode(msg.data, UsageRecord).request_id == "r-1"
    finally:
        await bus.close()
        server.stop()
