"""The router's map of sliding-window snapshots over a real nats-server: what it learns from
the memcaches' `SwaHeld` events, the resyncs it asks for, and what it forgets."""

from __future__ import annotations

import asyncio
import time

import pytest

from shared.schema import SwaHeld
from shared.subjects import SWA_MEMCACHE
from shared.testing.fixtures import BusFactory
from tests.service.router.fakes import FakeMemcache, StartRouter, eventually, known

pytestmark = [pytest.mark.nats]


async def memcache(bus_factory: BusFactory, node: str, held: set[int]) -> FakeMemcache:
    return FakeMemcache(await bus_factory(SWA_MEMCACHE, f"swa-memcache-{node}"), node, held)


async def test_a_router_started_after_the_memcaches_asks_every_one_for_its_state(
    bus_factory: BusFactory, start_router: StartRouter
) -> None:
    a, b = await memcache(bus_factory, "node-a", {1, 2}), await memcache(bus_factory, "node-b", {2})
    for m in (a, b):
        await m.start()  # their full states reach no router: none runs yet
    router = await start_router()
    await eventually(lambda: router.swa_map.holders(2) == {"node-a", "node-b"})
    assert router.swa_map.holders(1) == {"node-a"}
    assert [r.instance_id for r in a.resyncs + b.resyncs] == ["", ""]  # one broadcast
    await a.publish([3], [1])
    await eventually(lambda: router.swa_map.holders(3) == {"node-a"})
    assert router.swa_map.holders(1) == frozenset()
    metrics = router.metrics.snapshot()
    assert metrics["kvfabric_router_swa_memcaches"] == 2
    assert metrics["kvfabric_router_swa_gaps_total"] == 0


async def test_a_gap_gets_a_resync_naming_that_memcache_and_its_state_repairs_the_map(
    bus_factory: BusFactory, start_router: StartRouter
) -> None:
    router = await start_router()
    a, b = await memcache(bus_factory, "node-a", {1}), await memcache(bus_factory, "node-b", {5})
    for m in (a, b):
        await m.start()
    await eventually(lambda: router.swa_map.holders(1) == {"node-a"})
    a.held = {2}  # it stored 2 and dropped 1, but that batch was lost
    await a.publish([7], num_lost=1)
    await eventually(lambda: len(a.resyncs) == 1)
    assert a.resyncs[0].instance_id == "swa-memcache-node-a" and "missed" in a.resyncs[0].reason
    await eventually(lambda: router.swa_map.holders(2) == {"node-a"})
    assert router.swa_map.holders(1) == router.swa_map.holders(7) == frozenset()
    assert router.swa_map.holders(5) == {"node-b"}
    assert not b.resyncs  # the others are not asked
    assert router.metrics.snapshot()["kvfabric_router_swa_gaps_total"] == 1


async def test_a_memcache_that_arrives_unannounced_is_asked_and_one_that_goes_silent_is_forgotten(
    bus_factory: BusFactory, start_router: StartRouter
) -> None:
    router = await start_router(heartbeat_timeout_s=0.5)
    a = await memcache(bus_factory, "node-a", {4, 6})
    await a.start(announce=False)  # as if its full state was lost
    await a.publish([6])
    await eventually(lambda: router.swa_map.holders(4) == {"node-a"})  # its state, on request
    assert [r.instance_id for r in a.resyncs] == ["swa-memcache-node-a"]
    await known(router, "swa-memcache-node-a")
    # no heartbeat since: pruned once its timeout passes, and out of the map
    deadline = time.monotonic() + 10
    while len(router.swa_map):
        assert time.monotonic() < deadline, "the silent memcache was never pruned"
        await router.prune()
        await asyncio.sleep(0.05)
    assert router.swa_map.holders(4) == frozenset()


async def test_a_malformed_batch_is_dropped_and_shows_as_a_gap(
    bus_factory: BusFactory, start_router: StartRouter
) -> None:
    router = await start_router()
    a = await memcache(bus_factory, "node-a", {1})
    await a.start()
    await eventually(lambda: router.swa_map.holders(1) == {"node-a"})
    client = await bus_factory("test", "test-0")
    subject = client.subjects.swa_events(a.instance_id)
    await client.publish_raw(subject, b"\x00not msgpack")  # dropped by the bus, unread
    a.seq += 1
    bad = SwaHeld(instance_id=a.instance_id, node_id=a.node_id, seq=a.seq, added=b"\x01\x02")
    await client.publish(subject, bad)  # readable, but its hashes are not packed u64
    a.held = {9}
    await a.publish([8])
    await eventually(lambda: router.swa_map.holders(9) == {"node-a"})  # resynced
    assert [r.instance_id for r in a.resyncs] == [a.instance_id]
    assert router.swa_map.holders(1) == frozenset()
