"""swa-memcache's `SwaHeld` events: from a real process, what it tells the routers as puts,
evictions, expiry and resync requests change what it holds, and across a restart; in process,
a state larger than one batch and the goodbye at shutdown."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.router.swa_map import SwaMap
from services.swa_memcache import events
from services.swa_memcache.cache import SnapshotCache
from services.swa_memcache.events import SwaEventPublisher
from shared.bus import Bus
from shared.natsd import NatsServer
from shared.schema import NoResponders, pack_block_hashes, unpack_block_hashes
from shared.schema.swa import SwaContains, SwaContainsReply, SwaHeld, SwaPut, SwaPutReply, SwaResync
from shared.subjects import Subjects
from shared.testing.fixtures import BusFactory
from shared.testing.waits import eventually

pytestmark = [pytest.mark.nats, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[3]
INSTANCE = "swa-memcache-node0"


def start_memcache(url: str, root: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.swa_memcache",
            "--nats-url",
            url,
            "--root",
            root,
            "--instance-id",
            INSTANCE,
            "--node-id",
            "node0",
            "--ttl-s",
            "2.0",
            "--capacity-bytes",
            "3000",
            "--expire-interval-s",
            "0.2",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=REPO,
    )


async def put(bus: Bus, block_hash: int) -> None:
    subject = bus.subjects.instance(bus.subjects.swa_put, INSTANCE)
    reply = await bus.request(
        subject, SwaPut(block_hash=block_hash, snapshot=b"." * 1000), SwaPutReply
    )
    assert reply.stored


def hashes(data: bytes) -> list[int]:
    return unpack_block_hashes(data).tolist()


def test_event_subjects() -> None:
    subjects = Subjects("t1.kvf.v1")
    assert subjects.swa_events("swa-memcache-0") == "t1.kvf.v1.swa-memcache.events.swa-memcache-0"
    assert subjects.swa_events_all == "t1.kvf.v1.swa-memcache.events.*"
    assert subjects.swa_resync == "t1.kvf.v1.swa-memcache.resync"
    with pytest.raises(ValueError):
        subjects.swa_events("a.b")


async def test_events_follow_puts_evictions_expiry_resyncs_and_a_restart(
    nats_server: NatsServer, subject_root: str, bus_factory: BusFactory
) -> None:
    bus = await bus_factory("router", "router-0")
    subjects = bus.subjects
    batches: list[SwaHeld] = []

    async def on_batch(batch: SwaHeld) -> None:
        batches.append(batch)

    await bus.subscribe(subjects.swa_events_all, SwaHeld, on_batch)
    await bus.flush()
    started_us = time.time_ns() // 1000
    process = start_memcache(nats_server.url, subject_root)
    try:
        await eventually(lambda: batches)
        hello = batches[0]  # a fresh instance announces that it holds nothing
        assert (hello.instance_id, hello.node_id, hello.is_full) == (INSTANCE, "node0", True)
        assert hello.added == b"" and hello.seq > started_us  # counted from the clock

        for _ in range(300):  # serving a moment after its first batch
            try:
                await put(bus, 1)
                break
            except NoResponders:
                await asyncio.sleep(0.1)
        for key in (2, 3, 4):  # 4 KB into 3 KB: the least recently used (1) goes
            await put(bus, key)
        await eventually(lambda: any(4 in hashes(b.added) for b in batches))
        changes = [b for b in batches[1:] if b.added or b.removed]
        assert [(hashes(b.added), hashes(b.removed)) for b in changes] == [
            ([1], []),
            ([2], []),
            ([3], []),
            ([4], [1]),
        ]

        num_before = len(batches)
        await bus.publish(subjects.swa_resync, SwaResync(instance_id="swa-memcache-other"))
        await bus.publish(subjects.swa_resync, SwaResync(instance_id=INSTANCE, reason="gap"))
        await eventually(lambda: any(b.is_full for b in batches[num_before:]))
        [full] = [b for b in batches[num_before:] if b.is_full]  # the other's ignored
        assert sorted(hashes(full.added)) == [2, 3, 4]

        def expired() -> list[int]:  # past the 2 s TTL, maybe over two sweeps
            return sorted(k for b in batches[num_before:] for k in hashes(b.removed))

        await eventually(lambda: len(expired()) == 3)
        assert expired() == [2, 3, 4]
        num_sweeps = len(batches)
        await eventually(lambda: len(batches) >= num_sweeps + 2)  # sweeps confirm the sequence
        assert all(not b.added and not b.removed for b in batches[num_sweeps:])

        # Every batch in sequence; replayed into a router's map they say what `contains` says.
        assert [b.seq - hello.seq for b in batches] == list(range(len(batches)))
        swa = SwaMap()
        assert not any(swa.apply(b, now_s=0) for b in batches)
        await put(bus, 5)
        await eventually(lambda: 5 in hashes(batches[-1].added))
        swa.apply(batches[-1], now_s=0)
        asked = SwaContains(block_hashes=pack_block_hashes([2, 5]))
        reply = await bus.request(subjects.swa_contains, asked, SwaContainsReply)
        assert list(reply.found) == [0, 1]
        assert (swa.holders(2), swa.holders(5)) == (frozenset(), frozenset({"node0"}))
    finally:
        process.terminate()
        process.wait(timeout=30)
    await eventually(lambda: batches[-1].is_full)  # stopping: it holds nothing any more
    assert batches[-1].added == b""
    last_seq = batches[-1].seq

    num_before = len(batches)
    process = start_memcache(nats_server.url, subject_root)  # the same id again
    try:
        await eventually(lambda: len(batches) > num_before)
        restarted = batches[num_before]
        assert restarted.is_full and restarted.seq > last_seq  # a jump, and a full state
    finally:
        process.terminate()
        process.wait(timeout=30)


async def test_a_large_state_goes_in_several_batches_and_stop_empties_it(
    bus_factory: BusFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(events, "MAX_HASHES_PER_BATCH", 2)
    listener = await bus_factory("router", "router-0")
    batches: list[SwaHeld] = []

    async def on_batch(batch: SwaHeld) -> None:
        batches.append(batch)

    await listener.subscribe(listener.subjects.swa_events_all, SwaHeld, on_batch)
    await listener.flush()
    cache = SnapshotCache(capacity_bytes=100, ttl_s=60)
    publisher = SwaEventPublisher(await bus_factory("swa-memcache", INSTANCE), cache, node_id="n0")
    await publisher.start()
    for key in range(1, 6):
        cache.put(key, b"x", now=time.monotonic())
    await publisher.publish_state()
    await publisher.stop()
    await eventually(lambda: len(batches) == 5)

    hello, *state, goodbye = batches
    assert hello.is_full and hello.added == b""
    assert [(b.is_full, hashes(b.added)) for b in state] == [
        (True, [1, 2]),
        (False, [3, 4]),
        (False, [5]),
    ]
    assert goodbye.is_full and goodbye.added == b""
    assert [b.seq - hello.seq for b in batches] == [0, 1, 2, 3, 4]
    swa = SwaMap()
    assert not any(swa.apply(b, now_s=0) for b in batches[:4])
    assert [swa.holders(k) for k in (1, 5, 6)] == [{"n0"}, {"n0"}, frozenset()]
    swa.apply(goodbye, now_s=0)
    assert swa.holders(1) == frozenset()
