"""Usage records on a real nats-server: the publisher creates the log on a miss and JetStream
keeps one record per request id; the outbox keeps records through a server outage and
publishes them once it is back, and publishes at once what a full volume refuses; the e2e
helper sees a duplicate instead of hiding it."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from shared.bus import Bus
from shared.natsd import NatsServer
from shared.schema import Unavailable, UsageRecord, UsageStatus
from shared.subjects import DECODE
from shared.testing import unique_root
from shared.testing.fixtures import BusFactory
from shared.testing.volumes import fill, tmpfs
from shared.usage import adopt_orphans, open_usage_outbox, usage_publisher
from shared.usage_outbox import UsageOutbox
from tests.e2e.cluster_helpers import usage_records

pytestmark = pytest.mark.nats


def record(request_id: str, num_output_tokens: int = 3) -> UsageRecord:
    return UsageRecord(
        request_id=request_id,
        api_key_id="key-1",
        model="m",
        num_cache_hit_tokens=64,
        num_cache_miss_tokens=10,
        num_output_tokens=num_output_tokens,
        status=UsageStatus.COMPLETED,
        finish_reason="length",
        started_ms=1,
        finished_ms=2,
    )


async def test_the_log_is_made_on_a_miss_and_keeps_one_record_per_request(
    bus_factory: BusFactory,
) -> None:
    bus = await bus_factory("decode", "decode-0")
    publish = usage_publisher(bus, DECODE)
    await publish(record("r-1"))  # no stream yet: created, then stored
    await publish(record("r-1", num_output_tokens=99))  # a replay: the message id dedupes it
    await publish(record("r-2"))
    found = await usage_records(bus, {"r-1", "r-2"}, timeout_s=5)
    assert found["r-1"].num_output_tokens == 3


async def test_the_e2e_helper_fails_on_a_second_record_for_a_request(
    bus_factory: BusFactory,
) -> None:
    bus = await bus_factory("decode", "decode-0")
    await usage_publisher(bus, DECODE)(record("r-1"))
    # A producer bug: the same request under another message id is a second record.
    await bus.js.publish(bus.subjects.usage(DECODE), record("r-1"), msg_id="r-1-again")
    with pytest.raises(AssertionError, match=r"exactly one: \{'r-1': 2\}"):
        await usage_records(bus, {"r-1"}, timeout_s=5)


async def test_the_outbox_keeps_records_through_a_server_outage(tmp_path: Path) -> None:
    server = NatsServer(tmp_path / "nats").start()
    port, root = server.port, unique_root()
    bus = await Bus.connect(server.url, service="decode", instance_id="decode-0", root=root)
    outbox = await open_usage_outbox(bus, DECODE, tmp_path / "outbox", "decode-0")
    try:
        await outbox.add(record("before"))
        assert await outbox.flush(timeout_s=10)
        server.stop()  # JetStream gone: the next records are only on disk
        for i in range(3):
            await outbox.add(record(f"during-{i}"))
        await asyncio.sleep(0.5)
        assert outbox.num_pending == 3
        server = NatsServer(tmp_path / "nats", port=port).start()  # same store: same log
        assert await outbox.flush(timeout_s=30)
        found = await usage_records(bus, {"before", "during-0", "during-1", "during-2"}, 10)
        assert {r.request_id for r in found.values()} == set(found)
    finally:
        await outbox.close(timeout_s=1)
        await bus.close()
        server.stop()


async def test_a_dead_worker_s_outbox_is_adopted_and_removed(
    bus_factory: BusFactory, tmp_path: Path
) -> None:
    """A worker that comes back under another id never reopens its old outbox: another one
    sharing the directory sends what it left, then removes it; a live one is left alone."""
    bus = await bus_factory("decode", "decode-new")
    directory = tmp_path / "outbox"

    async def unreachable(_: UsageRecord) -> None:
        raise Unavailable("JetStream down")

    dead = UsageOutbox(directory / "decode-old.usage", unreachable)
    await dead.open()
    for i in range(3):
        await dead.add(record(f"left-{i}"))
    await dead.close(timeout_s=0.1)  # the process ends with the three still pending
    live = await open_usage_outbox(bus, DECODE, directory, "decode-new")
    try:
        assert await adopt_orphans(bus, DECODE, directory, timeout_s=10) == 3
        found = await usage_records(bus, {f"left-{i}" for i in range(3)}, timeout_s=10)
        assert len(found) == 3
        assert sorted(p.name for p in directory.iterdir()) == [
            "decode-new.usage",
            "decode-new.usage.lock",
        ]
        assert await adopt_orphans(bus, DECODE, directory, timeout_s=1) == 0  # ours: locked
    finally:
        await live.close()


@pytest.fixture
def full_volume(tmp_path: Path) -> Iterator[Path]:
    """A 256 KiB tmpfs, filled: every write on it fails with ENOSPC, as on a full volume."""
    with tmpfs(tmp_path / "full", "256k") as mount_point:
        fill(mount_point)
        yield mount_point


async def test_a_record_the_full_volume_refuses_goes_straight_to_jetstream(
    bus_factory: BusFactory, full_volume: Path
) -> None:
    bus = await bus_factory("decode", "decode-0")
    outbox = await open_usage_outbox(bus, DECODE, full_volume, "decode-0")
    try:
        await outbox.add(record("r-full"))  # returns: JetStream has it
        assert outbox.counters()["num_bypassed"] == 1
        assert outbox.counters()["num_added"] == 0 and outbox.num_pending == 0
        found = await usage_records(bus, {"r-full"}, timeout_s=5)
        assert found["r-full"].num_output_tokens == 3

        await bus.close()  # and with JetStream out of reach too, the caller is told
        with pytest.raises(OSError, match="No space left"):
            await outbox.add(record("r-lost"))
    finally:
        await outbox.close()
