"""A replicated control plane: three clustered nats-servers, streams and buckets at R3, and a
client given every seed URL loses no record when the server leading its stream is killed."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
import pytest_asyncio

from shared.bus import Bus
from shared.config import ConfigError, ServiceConfig, load_config
from shared.natsd import NatsCluster
from shared.testing.fixtures import SESSION_STORE_BYTES, unique_root
from shared.testing.waits import eventually
from tests.service.messages import Echo

pytestmark = pytest.mark.faults  # the fault suite: `make faults`, after make test

NUM_RECORDS = 40  # before the kill, and as many after it


async def peers_current(bus: Bus, stream: str) -> bool:
    peers = await bus.js.stream_peers(stream)
    return len(peers) == 3 and all(peers.values())


async def wait_until(check: Callable[[], Awaitable[bool]], timeout_s: float = 30.0) -> None:
    """`eventually` for a check that asks the server."""
    deadline = time.monotonic() + timeout_s
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError("condition never became true")
        await asyncio.sleep(0.05)


@pytest_asyncio.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[NatsCluster]:
    cluster = NatsCluster(tmp_path, size=3, max_file_store_bytes=SESSION_STORE_BYTES)
    await asyncio.to_thread(cluster.start)
    try:
        yield cluster
    finally:
        await asyncio.to_thread(cluster.stop)


@pytest_asyncio.fixture
async def bus(cluster: NatsCluster) -> AsyncIterator[Bus]:
    assert len(cluster.url.split(",")) == 3
    bus = await Bus.connect(cluster.url, service="test", root=unique_root())
    try:
        yield bus
    finally:
        await bus.close()


@pytest.mark.nats
async def test_losing_the_stream_leader_loses_no_record(cluster: NatsCluster, bus: Bus) -> None:
    bus.js.replicas = 3
    stream, subject, bucket = "CLUSTER_TEST", f"{bus.subjects.root}.records", "cluster-test"
    await bus.js.ensure_stream(stream, [subject])
    await bus.js.ensure_kv(bucket)
    await bus.js.kv_put(bucket, "key", b"value")
    await wait_until(lambda: peers_current(bus, stream))
    await wait_until(lambda: peers_current(bus, f"KV_{bucket}"))

    live: list[str] = []  # a consumer reading through the loss (kv-index's kind)

    async def on_live(record: Echo, _seq: int) -> None:
        live.append(record.text)

    await bus.js.consume(stream, subject, Echo, on_live)
    for i in range(NUM_RECORDS):
        await bus.js.publish(subject, Echo(text=f"r{i}"), msg_id=f"r{i}")
    leader = next(iter(await bus.js.stream_peers(stream)))
    killed = [server.server_name for server in cluster.servers].index(leader)
    cluster.kill_member(killed)

    # Acknowledged through the election of a new leader (JetStream.publish retries).
    for i in range(NUM_RECORDS, 2 * NUM_RECORDS):
        await bus.js.publish(subject, Echo(text=f"r{i}"), msg_id=f"r{i}")
    assert await bus.js.kv_get(bucket, "key") == b"value"
    await bus.js.kv_put(bucket, "later", b"stored")

    received: list[str] = []

    async def on_record(record: Echo, _seq: int) -> None:
        received.append(record.text)

    await bus.js.consume(stream, subject, Echo, on_record)
    await eventually(lambda: len(received) >= 2 * NUM_RECORDS)
    expected = [f"r{i}" for i in range(2 * NUM_RECORDS)]
    assert received == expected  # none lost or doubled
    await eventually(lambda: len(live) >= 2 * NUM_RECORDS)
    assert live == expected
    assert await bus.js.stream_bounds(stream) == (1, 2 * NUM_RECORDS)

    # Back on its ports and store: it catches up with what it missed.
    await asyncio.to_thread(cluster.start_member, killed)
    await wait_until(lambda: peers_current(bus, stream))
    assert leader in await bus.js.stream_peers(stream)
    await wait_until(lambda: peers_current(bus, f"KV_{bucket}"))
    assert await bus.js.kv_get(bucket, "later") == b"stored"


@pytest.mark.nats
async def test_existing_streams_gain_replicas_and_never_lose_them(bus: Bus) -> None:
    subject = f"{bus.subjects.root}.records"
    await bus.js.ensure_stream("GROWS", [subject])  # made by a process without js_replicas
    await bus.js.ensure_kv("grows")
    assert len(await bus.js.stream_peers("GROWS")) == 1

    bus.js.replicas = 3
    await bus.js.ensure_stream("GROWS", [subject])
    await bus.js.ensure_kv("grows")
    await wait_until(lambda: peers_current(bus, "GROWS"))
    await wait_until(lambda: peers_current(bus, "KV_grows"))

    bus.js.replicas = 1
    await bus.js.ensure_stream("GROWS", [subject], max_age_s=600.0)  # an update, kept at R3
    assert len(await bus.js.stream_peers("GROWS")) == 3


def test_config_takes_a_seed_list_and_checks_js_replicas() -> None:
    seeds = "nats://10.0.0.1:4222, nats://10.0.0.2:4222,nats://10.0.0.3:4222"
    config = load_config(ServiceConfig, environ={"KVF_NATS_URL": seeds, "KVF_JS_REPLICAS": "3"})
    assert config.js_replicas == 3
    with pytest.raises(ConfigError, match="js_replicas must be 1-5"):
        load_config(ServiceConfig, environ={}, js_replicas=0)
    with pytest.raises(ConfigError, match="must start with nats://"):
        load_config(ServiceConfig, environ={}, nats_url="nats://a:4222,b:4222")


@pytest.mark.nats
async def test_a_call_made_while_its_server_is_gone_waits_for_the_next(
    cluster: NatsCluster, bus: Bus
) -> None:
    """A caller whose server died, calling before its connection has moved: the move to
    another seed takes milliseconds, and the call waits it out instead of failing."""
    from tests.service.messages import EchoReply
    from tests.service.test_bus import serve_echo

    def member(b: Bus) -> int:
        url = b._nc.connected_url
        assert url is not None
        return [s.url.split("//")[-1] for s in cluster.servers].index(url.netloc)

    index = member(bus)
    others = ",".join(s.url for i, s in enumerate(cluster.servers) if i != index)
    echo = await Bus.connect(others, service="echo-svc", root=bus.subjects.root)
    try:
        endpoint = await serve_echo(echo)
        assert (await bus.request(endpoint.subject, Echo(text="a"), EchoReply)).text == "a"
        cluster.kill_member(index)
        deadline = time.monotonic() + 10
        while bus.is_connected:  # each yield lets the client see the EOF; the move takes
            assert time.monotonic() < deadline  # several round trips, so this sees it gone
            await asyncio.sleep(0)
        reply = await bus.request(endpoint.subject, Echo(text="b"), EchoReply)
        assert reply.text == "b" and member(bus) != index
    finally:
        await echo.close()
