"""The writer's side against a real kv-index process: stored blocks become matchable and
readable by another worker, a restarted writer re-announces its slots, eviction frees them."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from shared import kv_index_client as index_client
from shared.block_hashing import BlockHasher
from shared.bus import Bus
from shared.natsd import NatsServer
from shared.schema.kv_index import CacheCommand, CacheStats
from shared.testing.fixtures import BusFactory
from tests.service.kv_index.test_kv_index_service import (
    _true,
    eventually,
    prefix,
    start_index,
    stop,
    wait_ready,
)
from worker.kvstore import KvStore, KvStoreConfig, SlotRef
from worker.kvstore.writer import KvEventPublisher

pytestmark = [pytest.mark.nats, pytest.mark.slow]
PAYLOAD_NBYTES = 4096
HASHES = BlockHasher("m", block_size_tokens=16).hashes(range(16 * 10))


def payload(block_hash: int) -> bytes:
    return block_hash.to_bytes(8, "little") * (PAYLOAD_NBYTES // 8)


def open_store(root: Path, writer_id: str) -> KvStore:
    config = KvStoreConfig(
        root_dir=root,
        writer_id=writer_id,
        payload_nbytes=PAYLOAD_NBYTES,
        capacity_bytes=64 * 8192,
        file_nbytes=16 * 8192,
        backend="aiofiles",
    )
    return KvStore.open(config)


async def test_store_match_read_restart_evict(
    nats_server: NatsServer, subject_root: str, bus_factory: BusFactory, tmp_path: Path
) -> None:
    index = start_index(nats_server, subject_root)
    store = reader = None
    try:
        writer_bus = await bus_factory("prefill", "prefill-0")
        await wait_ready(writer_bus)
        store = open_store(tmp_path, "prefill-0")
        publisher = KvEventPublisher(writer_bus, store)
        await publisher.start()
        stored = await publisher.store_blocks([(h, payload(h)) for h in HASHES])
        assert all(stored)
        assert await eventually(lambda: _is_prefix(writer_bus, 10))

        # Another worker reads the blocks where the index says they are.
        match = await index_client.match(writer_bus, HASHES, num_shards=1)
        reader = open_store(tmp_path, "decode-0")
        refs = [SlotRef.from_location(loc) for loc in match["ssd"].locations.rows()]
        assert await reader.read_blocks(refs) == [payload(h) for h in HASHES]

        # The writer restarts: it adopts its slots and announces them; the index, seeing its
        # sequence jump, asks for a resync; the answers stay the same.
        store.close()
        store = open_store(tmp_path, "prefill-0")
        assert len(store.adopted) == 10
        restarted = KvEventPublisher(writer_bus, store)
        await restarted.start()
        stats = await writer_bus.request(
            writer_bus.subjects.kv_index_admin(0), CacheCommand(action="stats"), CacheStats
        )
        assert await eventually(lambda: _gaps(writer_bus, 1))
        assert await prefix(writer_bus, HASHES) == 10

        # Evict half: the writer frees the slots and logs the removal.
        await writer_bus.request(
            writer_bus.subjects.kv_index_admin(0),
            CacheCommand(action="evict", fraction=0.5),
            CacheStats,
        )
        assert await eventually(lambda: _true(store.stats()["num_slots_freed"] == 5))
        assert stats.tiers["ssd"]["num_blocks"] == 10
        # The removal is in the log: an index rebuilt from it does not bring the blocks back.
        stop(index, signal.SIGKILL)
        index = start_index(nats_server, subject_root)
        await wait_ready(writer_bus)
        after = await writer_bus.request(
            writer_bus.subjects.kv_index_admin(0), CacheCommand(action="stats"), CacheStats
        )
        assert after.tiers["ssd"]["num_blocks"] == 5
    finally:
        for s in (store, reader):
            if s is not None:
                s.close()
        stop(index)


async def _is_prefix(bus, expected: int) -> bool:  # noqa: ANN001
    return await prefix(bus, HASHES) == expected


async def _counters(bus) -> dict[str, int]:  # noqa: ANN001
    stats = await bus.request(
        bus.subjects.kv_index_admin(0), CacheCommand(action="stats"), CacheStats
    )
    return stats.counters


async def _gaps(bus, expected: int) -> bool:  # noqa: ANN001
    return (await _counters(bus))["num_gaps"] >= expected


async def test_cache_rebuild_from_slot_headers(
    nats_server: NatsServer, subject_root: str, bus_factory: BusFactory, tmp_path: Path
) -> None:
    """Blocks written under one cluster's log; a fresh index with an empty log (the log is
    lost) learns them back from the store's headers, and keeps them across a restart."""
    store = open_store(tmp_path, "prefill-7")
    first_index = start_index(nats_server, subject_root)
    try:
        bus = await bus_factory("prefill", "prefill-7")
        await wait_ready(bus)
        publisher = KvEventPublisher(bus, store)
        await publisher.start()
        await publisher.store_blocks([(h, payload(h)) for h in HASHES[:6]])
    finally:
        stop(first_index)
        store.close()

    lost_root = "lost" + subject_root  # a new log: nothing in it
    index = start_index(nats_server, lost_root)
    try:
        fresh = await Bus.connect(nats_server.url, service="admin", root=lost_root)
        await wait_ready(fresh)
        assert await prefix(fresh, HASHES) == 0
        kvfabric = str(Path(sys.executable).parent / "kvfabric")
        done = await asyncio.to_thread(
            subprocess.run,
            [
                kvfabric,
                "cache",
                "rebuild",
                "--store-dir",
                str(tmp_path),
                "--nats-url",
                nats_server.url,
                "--root",
                lost_root,
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        assert "6 valid slots found, 6 blocks indexed" in done.stdout
        assert await prefix(fresh, HASHES) == 6
        stop(index, signal.SIGKILL)  # the rebuild was snapshotted: it survives a restart
        index = start_index(nats_server, lost_root)
        await wait_ready(fresh)
        assert await prefix(fresh, HASHES) == 6
        await fresh.close()
    finally:
        stop(index)
