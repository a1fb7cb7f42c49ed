"""swa-memcache as a real process with large snapshots moving over NIXL (UCX) and small ones
inline: put then get byte-identical, a lease honoured through a flood of puts, an expired
lease read as a miss, and failed pulls (dead caller, silent caller, bad checksum) leaving
nothing stored while the memcache keeps serving."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import numpy as np
import pytest
import pytest_asyncio
import xxhash

from shared.bus import Bus, Context, Endpoint
from shared.discovery import discover
from shared.natsd import NatsServer
from shared.schema import NoResponders
from shared.schema.swa import SwaNixlRef, SwaPut, SwaPutReply
from shared.schema.transfer import NixlAgentInfo, NixlMetadataRequest
from shared.testing.fixtures import BusFactory, unique_root
from tests.service.test_kv_transfer import read_line, stop
from worker.swa_client import SwaClient, SwaLease
from worker.transfer import KvTransferAgent

pytestmark = [pytest.mark.nats, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[3]
MEMCACHE = "swa-memcache-node0"
BIG = 2 << 20  # a sliding-window snapshot is megabytes
LEASE_S = 2.0


@pytest.fixture(scope="module")
def module_root() -> str:
    return unique_root()


@pytest.fixture
def subject_root(module_root: str) -> str:
    """Both tests talk to one memcache process (a NIXL process takes seconds to start)."""
    return module_root


@pytest.fixture(scope="module")
def memcache(nats_server: NatsServer, module_root: str) -> Iterator[subprocess.Popen[bytes]]:
    # Room for three big snapshots and a little: the fourth evicts.
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.swa_memcache",
            "--nats-url",
            nats_server.url,
            "--root",
            module_root,
            "--instance-id",
            MEMCACHE,
            "--capacity-bytes",
            str(3 * BIG + (64 << 10)),
            "--inline-max-bytes",
            str(256 << 10),
            "--lease-s",
            str(LEASE_S),
            "--transfer-timeout-s",
            "1.0",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=REPO,
    )
    try:
        yield process
    finally:
        process.terminate()
        process.wait(timeout=30)


async def wait_until_serving(client: SwaClient) -> None:
    for _ in range(300):
        try:
            await client.get(0)
            return
        except NoResponders:
            await asyncio.sleep(0.1)
    raise AssertionError("swa-memcache did not come up")


def snapshot(seed: int, nbytes: int = BIG) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8).tobytes()


@pytest_asyncio.fixture
async def prefill(
    bus_factory: BusFactory, memcache: subprocess.Popen[bytes]
) -> AsyncIterator[tuple[Bus, SwaClient]]:
    bus = await bus_factory("prefill", "prefill-0")
    agent = KvTransferAgent(bus, np.zeros(BIG, np.uint8), service="prefill")
    await agent.serve()
    client = SwaClient(bus, agent, memcache_instance_id=MEMCACHE, transfer_timeout_s=2.0)
    await wait_until_serving(client)
    yield bus, client
    agent.close()


STORED, FAILED, MISMATCHED = (
    f'pulls_total{{outcome="{o}"}}' for o in ("stored", "failed", "mismatched")
)


async def memcache_metrics(bus: Bus) -> dict[str, float]:
    """The memcache's metrics (discovery's snapshot), without their common prefix."""
    [instance] = await discover(bus, service="swa-memcache")
    prefix = "kvfabric_swa_memcache_"
    return {k.removeprefix(prefix): v for k, v in instance.metrics.items() if k.startswith(prefix)}


async def test_big_over_nixl_small_inline_and_leases(prefill: tuple[Bus, SwaClient]) -> None:
    bus, client = prefill
    before = await memcache_metrics(bus)
    big, small = snapshot(1), b"s" * 1000
    assert await client.put(10, big) and await client.put(11, small)
    assert await client.get(10) == big and await client.get(11) == small
    assert await client.lookup(11) == small  # inline: no lease

    lease = await client.lookup(10)
    assert isinstance(lease, SwaLease)
    flood = {key: snapshot(key) for key in (20, 21, 22, 23)}
    for key, data in flood.items():  # without the pin, 10 (least recent) would go
        assert await client.put(key, data)
    assert await client.pull(lease) == big
    assert await client.get(10) == big and await client.get(20) is None

    late = await client.lookup(10)
    assert isinstance(late, SwaLease)
    await asyncio.sleep(LEASE_S + 0.2)  # the reader stalls past its lease...
    for key in (30, 31, 32):  # ...and the flood reuses 10's range
        assert await client.put(key, snapshot(key))
    assert await client.pull(late) is None  # too late: a miss, not stale bytes
    optimistic = SwaLease(late.location, late.lease_id, time.monotonic() + 10)
    assert await client.pull(optimistic) is None  # even ignoring the clock: checksum

    after = await memcache_metrics(bus)
    assert after[STORED] - before[STORED] == 1 + 4 + 3
    assert after["leased_gets_total"] - before["leased_gets_total"] == 4
    assert after["leases_released_total"] - before["leases_released_total"] >= 3
    assert after["pinned_entries"] == 0 and after["used_bytes"] == 3 * BIG


async def test_failed_pulls_store_nothing_and_memcache_keeps_serving(
    nats_server: NatsServer,
    module_root: str,
    bus_factory: BusFactory,
    prefill: tuple[Bus, SwaClient],
) -> None:
    bus, client = prefill
    caller = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.service.swa_memcache.swa_peer",
            nats_server.url,
            module_root,
            "prefill-doomed",
            MEMCACHE,
            str(BIG),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=REPO,
    )
    silent = await bus_factory("prefill", "prefill-silent")

    async def never_answers(request: NixlMetadataRequest, ctx: Context) -> NixlAgentInfo:
        await asyncio.sleep(30)
        raise AssertionError("unreachable")

    subject = silent.subjects.nixl_metadata("prefill")
    await silent.serve(Endpoint("nixl-metadata", subject, NixlMetadataRequest, never_answers))
    put_subject = bus.subjects.instance(bus.subjects.swa_put, MEMCACHE)

    async def put_from(instance_id: str, key: int, checksum: int) -> SwaPutReply:
        source = SwaNixlRef("prefill", instance_id, 0, BIG, checksum)
        message = SwaPut(block_hash=key, snapshot=b"", source=source)
        return await bus.request(put_subject, message, SwaPutReply, timeout_s=10.0)

    try:
        before = await memcache_metrics(bus)
        first = json.loads(await asyncio.to_thread(read_line, caller))
        assert first["stored"]  # its metadata and UCX connection are cached now
        stop(caller)  # the caller dies before the memcache pulls its next snapshot
        dead = await put_from("prefill-doomed", 2, first["checksum"])
        assert not dead.stored and dead.reason.startswith("pull failed")
        stuck = await put_from("prefill-silent", 3, first["checksum"])  # times out, no hang
        assert not stuck.stored and stuck.reason.startswith("pull failed")

        data = snapshot(7)
        client.agent.buffer[:] = np.frombuffer(data, np.uint8)  # type: ignore[union-attr]
        # prefill-0's agent is new (the first test closed its own under the same instance
        # id): the memcache's cached metadata is stale and its retry asks afresh.
        wrong = await put_from("prefill-0", 4, xxhash.xxh3_64_intdigest(data) ^ 1)
        assert not wrong.stored and wrong.reason == "checksum mismatch"

        assert await client.put(5, data) and await client.get(5) == data  # still serving
        assert await client.get(1) is not None  # the dead caller's first put was whole
        for key in (2, 3, 4):
            assert await client.get(key) is None
        after = await memcache_metrics(bus)
        assert after[FAILED] - before[FAILED] == 2
        assert after[MISMATCHED] - before[MISMATCHED] == 1
        # No reservation of a failed pull is left behind: only whole entries hold bytes.
        assert after["used_bytes"] == after["entries"] * BIG and after["pinned_entries"] == 0
    finally:
        stop(caller)
