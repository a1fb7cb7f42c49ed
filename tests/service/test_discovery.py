"""Discovery through the NATS micro API: `$SRV.PING|INFO|STATS` answered in micro's format."""

from __future__ import annotations

import json

import pytest

from shared.discovery import PING_TYPE, STATS_TYPE, DiscoveryResponder, discover
from shared.schema import LoadReport
from shared.subjects import discovery
from shared.testing.fixtures import BusFactory
from tests.service.test_bus import serve_echo

pytestmark = pytest.mark.nats


def _load(bus) -> LoadReport:  # noqa: ANN001
    return LoadReport(
        service=bus.service, instance_id=bus.instance_id, seq=1, ts_ms=0, num_queued=3
    )


async def test_instances_answer_discovery_in_micro_format(bus_factory: BusFactory) -> None:
    first, second = await bus_factory("echo-svc"), await bus_factory("echo-svc")
    for bus in (first, second):
        await serve_echo(bus)
        responder = DiscoveryResponder(
            bus,
            version="1.2.3",
            description="echo",
            metadata={},
            load_report=lambda b=bus: _load(b),
        )
        await responder.start()
        await bus.flush()
    client = await bus_factory("client")

    pings = [
        json.loads(m.data)
        async for m in client.scatter(discovery("PING", "echo-svc"), b"", timeout_s=0.5)
    ]
    ours = [p for p in pings if p["metadata"].get("root") == client.subjects.root]
    assert {p["id"] for p in ours} == {first.instance_id, second.instance_id}
    assert all(p["type"] == PING_TYPE and p["version"] == "1.2.3" for p in ours)

    one = [
        json.loads(m.data)
        async for m in client.scatter(
            discovery("STATS", "echo-svc", first.instance_id), b"", timeout_s=0.5
        )
    ]
    assert len(one) == 1 and one[0]["type"] == STATS_TYPE
    assert one[0]["endpoints"][0]["queue_group"] == "echo-svc"
    assert one[0]["load"]["num_queued"] == 3

    instances = await discover(client, timeout_s=0.5)
    assert [(i.service, i.instance_id) for i in instances] == sorted(
        [("echo-svc", first.instance_id), ("echo-svc", second.instance_id)]
    )


async def test_discovery_ignores_other_roots(bus_factory: BusFactory, nats_server) -> None:  # noqa: ANN001
    from shared.bus import Bus

    other = await Bus.connect(nats_server.url, service="echo-svc", root="elsewhere.kvf.v1")
    try:
        responder = DiscoveryResponder(
            other, version="0.0.1", description="", metadata={}, load_report=lambda: _load(other)
        )
        await responder.start()
        await other.flush()
        client = await bus_factory("client")
        assert await discover(client, timeout_s=0.3) == []
        await responder.stop()
    finally:
        await other.close()


async def test_a_stall_timer_ends_the_round_when_replies_pause(bus_factory: BusFactory) -> None:
    import asyncio
    import time

    prompt = await bus_factory("echo-svc")
    responder = DiscoveryResponder(
        prompt, version="1", description="", metadata={}, load_report=lambda: _load(prompt)
    )
    await responder.start()
    late = await bus_factory("late-svc")

    async def answer_late(msg) -> None:  # noqa: ANN001
        await asyncio.sleep(3.0)
        await late.publish_raw(msg.reply, b"late")

    await late.subscribe_raw(discovery("PING"), answer_late)
    await prompt.flush()
    await late.flush()
    client = await bus_factory("client")

    started = time.monotonic()
    replies = [
        m.data async for m in client.scatter(discovery("PING"), b"", timeout_s=10, stall_s=0.2)
    ]
    stalled_s = time.monotonic() - started
    assert b"late" not in replies and len(replies) >= 1  # the prompt one only
    assert stalled_s < 3.0  # ended by the stall, not by the late reply or the window

    replies = [m.data async for m in client.scatter(discovery("PING"), b"", timeout_s=6.0)]
    assert b"late" in replies  # without the stall timer the window waits for it
