"""swa-memcache as a real process: get/put over NATS, TTL expiry, capacity, metrics."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shared.discovery import discover
from shared.natsd import NatsServer
from shared.schema import BadRequest, NoResponders, pack_block_hashes
from shared.schema.swa import (
    SwaContains,
    SwaContainsReply,
    SwaGet,
    SwaGetReply,
    SwaPut,
    SwaPutReply,
)
from shared.testing.fixtures import BusFactory

pytestmark = [pytest.mark.nats, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[3]


async def test_get_put_ttl_capacity_and_metrics(
    nats_server: NatsServer, subject_root: str, bus_factory: BusFactory
) -> None:
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.swa_memcache",
            "--nats-url",
            nats_server.url,
            "--root",
            subject_root,
            "--instance-id",
            "swa-memcache-node0",
            "--ttl-s",
            "1.0",
            "--capacity-bytes",
            "3000",
            "--expire-interval-s",
            "0.2",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=REPO,
    )
    try:
        bus = await bus_factory("prefill", "prefill-0")
        subjects = bus.subjects
        # The node's prefill workers address their own memcache by instance.
        put_subject = subjects.instance(subjects.swa_put, "swa-memcache-node0")
        for _ in range(300):
            try:
                await bus.request(
                    put_subject, SwaPut(block_hash=1, snapshot=b"w" * 1000), SwaPutReply
                )
                break
            except NoResponders:
                await asyncio.sleep(0.1)
        got = await bus.request(subjects.swa_get, SwaGet(block_hash=1), SwaGetReply)
        assert got.found and got.snapshot == b"w" * 1000
        assert not (await bus.request(subjects.swa_get, SwaGet(block_hash=2), SwaGetReply)).found

        for key in (2, 3, 4):  # 4 KB into 3 KB: the least recently used (1) goes
            assert (
                await bus.request(
                    subjects.swa_put, SwaPut(block_hash=key, snapshot=b"." * 1000), SwaPutReply
                )
            ).stored
        held = await bus.request(
            subjects.swa_contains,
            SwaContains(block_hashes=pack_block_hashes([1, 2, 3, 4, 5])),
            SwaContainsReply,
        )
        assert list(held.found) == [0, 1, 1, 1, 0]
        with pytest.raises(BadRequest):
            await bus.request(
                subjects.swa_contains, SwaContains(block_hashes=b"\x01\x02"), SwaContainsReply
            )

        # past the TTL the sweep drops everything
        deadline = time.monotonic() + 30
        while (await discover(bus, service="swa-memcache"))[0].metrics[
            "kvfabric_swa_memcache_entries"
        ]:
            assert time.monotonic() < deadline, "the TTL sweep never dropped the entries"
            await asyncio.sleep(0.1)
        assert not (await bus.request(subjects.swa_get, SwaGet(block_hash=3), SwaGetReply)).found
        [instance] = await discover(bus, service="swa-memcache")
        metrics = instance.metrics
        assert metrics["kvfabric_swa_memcache_hits_total"] == 1
        assert metrics["kvfabric_swa_memcache_evicted_total"] == 1
        assert metrics["kvfabric_swa_memcache_expired_total"] >= 3
        assert metrics["kvfabric_swa_memcache_entries"] == 0
        assert metrics["kvfabric_swa_memcache_misses_total"] == 2
    finally:
        process.terminate()
        process.wait(timeout=30)
