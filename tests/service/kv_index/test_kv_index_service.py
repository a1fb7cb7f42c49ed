"""kv-index as real processes on a real nats-server: match, shards, gaps, eviction notices,
restart recovery from the JetStream log (kill -9, start again, same answers)."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO

import pytest

from shared import kv_index_client as index_client
from shared.block_hashing import BlockHasher
from shared.bus import Bus
from shared.natsd import NatsServer
from shared.schema import (
    BlocksRemoved,
    BlocksStored,
    KvEventBatch,
    NoResponders,
    StoredBlock,
    unpack_block_hashes,
)
from shared.schema.kv_index import HOLD_DEVICE, HOLD_HOST, CacheCommand, CacheStats, ResyncRequest
from shared.tasks import cancel_and_wait
from shared.testing.fixtures import BusFactory
from worker.serving.holdings import Holdings, HoldingsPublisher

pytestmark = [pytest.mark.nats, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[3]
HASHES = BlockHasher("m", block_size_tokens=4).hashes(range(4 * 30))
LONG_PREFIX = BlockHasher("m", block_size_tokens=4).hashes(range(4 * 256))


# Each index process's stderr, read back when an index never answers: a service that failed
# to start says why instead of leaving a bare timeout.
_STDERR: dict[subprocess.Popen[bytes], IO[bytes]] = {}
READY_WAIT_S = 60.0


def start_index(
    server: NatsServer,
    root: str,
    shard: int = 0,
    num_shards: int = 1,
    *extra: str,
) -> subprocess.Popen[bytes]:
    stderr = tempfile.TemporaryFile()  # noqa: SIM115 - closed by stop(), read if it fails
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.kv_index",
            "--nats-url",
            server.url,
            "--root",
            root,
            "--instance-id",
            f"kv-index-{shard}",
            "--shard-id",
            str(shard),
            "--num-shards",
            str(num_shards),
            "--shutdown-grace-s",
            "2",
            *extra,
        ],
        stdout=subprocess.DEVNULL,
        stderr=stderr,
        cwd=REPO,
    )
    _STDERR[process] = stderr
    return process


def _failed() -> str:
    """Each index process started and not stopped by `stop` that has exited, with the tail
    of its stderr ('' when none has)."""
    lines = []
    for process, stderr in _STDERR.items():
        if process.poll() is not None:
            stderr.seek(0)
            tail = stderr.read()[-3000:].decode(errors="replace")
            lines.append(f"kv-index pid {process.pid} exited {process.returncode}:\n{tail}")
    return "\n".join(lines)


async def wait_ready(bus: Bus, num_shards: int = 1) -> None:
    deadline = time.monotonic() + READY_WAIT_S
    while time.monotonic() < deadline:
        try:
            await index_client.match(bus, HASHES[:1], num_shards=num_shards)
            return
        except NoResponders:
            if failed := _failed():
                raise AssertionError(f"kv-index failed to start\n{failed}") from None
            await asyncio.sleep(0.1)
    raise AssertionError(f"kv-index never answered in {READY_WAIT_S:.0f} s\n{_failed()}")


def stop(process: subprocess.Popen[bytes], sig: int = signal.SIGTERM) -> None:
    if process.poll() is None:
        process.send_signal(sig)
        process.wait(timeout=30)
    stderr = _STDERR.pop(process, None)
    if stderr is not None:
        stderr.close()


def batch(
    writer: str, seq: int, hashes: list[int], first_slot: int = 0, num_bytes: int = 1000
) -> KvEventBatch:
    blocks = tuple(
        StoredBlock(block_hash=h, file_id=1, slot=first_slot + i, generation=1, num_bytes=num_bytes)
        for i, h in enumerate(hashes)
    )
    return KvEventBatch(
        writer_id=writer, seq=seq, ts_ms=0, events=(BlocksStored(tier="ssd", blocks=blocks),)
    )


async def publish(bus: Bus, *batches: KvEventBatch) -> None:
    for b in batches:
        await bus.js.publish(bus.subjects.kv_events(b.writer_id), b)


async def prefix(bus: Bus, hashes: list[int], num_shards: int = 1) -> int:
    result = await index_client.match(bus, hashes, num_shards=num_shards)
    return result["ssd"].num_blocks if "ssd" in result else 0


async def eventually(check, timeout_s: float = 10.0):  # noqa: ANN001, ANN201
    for _ in range(int(timeout_s / 0.05)):
        value = await check()
        if value:
            return value
        await asyncio.sleep(0.05)
    return await check()


def logged(process: subprocess.Popen[bytes]) -> str:
    """What an index process has logged so far (its JSON lines go to stderr)."""
    stderr = _STDERR[process]
    stderr.seek(0)
    return stderr.read().decode(errors="replace")


async def test_match_and_restart_recovery(
    nats_server: NatsServer, subject_root: str, bus_factory: BusFactory
) -> None:
    index = start_index(nats_server, subject_root)
    try:
        writer = await bus_factory("prefill", "prefill-0")
        await wait_ready(writer)
        await publish(
            writer, batch("prefill-0", 1, HASHES[:10]), batch("prefill-0", 2, HASHES[10:12], 10)
        )
        assert await eventually(lambda: _is(prefix(writer, HASHES), 12))
        before = await index_client.match(writer, HASHES, num_shards=1)
        assert [loc.slot for loc in before["ssd"].locations.rows()] == list(range(12))

        stop(index, signal.SIGKILL)  # no goodbye snapshot: recovery must come from the log
        index = start_index(nats_server, subject_root)
        await wait_ready(writer)
        after = await index_client.match(writer, HASHES, num_shards=1)
        assert after == before

        # A clean stop saves a snapshot; the next start restores it and replays only what
        # follows (forced: a log this small would otherwise be replayed whole, being faster).
        stop(index)
        await publish(writer, batch("prefill-0", 3, HASHES[12:14], 12))
        index = start_index(nats_server, subject_root, 0, 1, "--replay-whole-log-bytes", "0")
        await wait_ready(writer)
        assert await prefix(writer, HASHES) == 14
        assert '"snapshot loaded"' in logged(index)
    finally:
        stop(index)


async def _is(value, expected) -> bool:  # noqa: ANN001
    return (await value) == expected


async def test_shards_answer_together(
    nats_server: NatsServer, subject_root: str, bus_factory: BusFactory
) -> None:
    shards = [start_index(nats_server, subject_root, s, 2) for s in range(2)]
    try:
        writer = await bus_factory("prefill", "prefill-0")
        await wait_ready(writer, num_shards=2)
        await publish(writer, batch("prefill-0", 1, HASHES[:8] + HASHES[9:15]))
        assert await eventually(lambda: _is(prefix(writer, HASHES, 2), 8))
        stats = [
            await writer.request(
                writer.subjects.kv_index_admin(s), CacheCommand(action="stats"), CacheStats
            )
            for s in range(2)
        ]
        assert sum(s.tiers["ssd"]["num_blocks"] for s in stats) == 14  # each kept its own half
        assert all(0 < s.tiers["ssd"]["num_blocks"] < 14 for s in stats)
    finally:
        for shard in shards:
            stop(shard)


async def test_gap_asks_the_writer_to_resync_and_eviction_notifies_it(
    nats_server: NatsServer, subject_root: str, bus_factory: BusFactory
) -> None:
    index = start_index(
        nats_server, subject_root, 0, 1, "--capacity", "ssd=10000", "--evict-interval-s", "0.1"
    )
    try:
        writer = await bus_factory("prefill", "prefill-0")
        resyncs: list[ResyncRequest] = []
        evicted: list[int] = []

        async def on_resync(request: ResyncRequest) -> None:
            resyncs.append(request)

        async def on_evict(notice: BlocksRemoved) -> None:
            evicted.extend(unpack_block_hashes(notice.block_hashes).tolist())

        await writer.subscribe(writer.subjects.kv_resync("prefill-0"), ResyncRequest, on_resync)
        await writer.subscribe(writer.subjects.kv_evict("prefill-0"), BlocksRemoved, on_evict)
        await writer.flush()
        await wait_ready(writer)
        await publish(
            writer, batch("prefill-0", 1, HASHES[:2]), batch("prefill-0", 4, HASHES[2:4], 2)
        )
        assert await eventually(lambda: _true(len(resyncs) == 1))
        assert (resyncs[0].expected_seq, resyncs[0].received_seq) == (2, 4)

        # 10 blocks of 1000 bytes in a 10000-byte tier: over 90%, evicted down to 80%.
        await publish(writer, batch("prefill-0", 5, HASHES[4:10], 4))
        assert await eventually(lambda: _true(len(evicted) >= 2))
        assert set(evicted) <= set(HASHES[:10])
        stats = await writer.request(
            writer.subjects.kv_index_admin(0), CacheCommand(action="stats"), CacheStats
        )
        assert stats.tiers["ssd"]["used_bytes"] <= 8000
        assert stats.counters["num_gaps"] == 1
        flushed = await writer.request(
            writer.subjects.kv_index_admin(0), CacheCommand(action="flush"), CacheStats
        )
        assert flushed.tiers["ssd"]["num_blocks"] == 0
    finally:
        stop(index)


async def _true(value: bool) -> bool:
    return value


async def test_cache_cli_stats_evict_flush(
    nats_server: NatsServer, subject_root: str, bus_factory: BusFactory
) -> None:
    shards = [start_index(nats_server, subject_root, s, 2) for s in range(2)]
    kvfabric = str(Path(sys.executable).parent / "kvfabric")
    target = ["--nats-url", nats_server.url, "--root", subject_root]
    try:
        writer = await bus_factory("prefill", "prefill-0")
        await wait_ready(writer, num_shards=2)
        for shard in range(2):  # discovery registers after the endpoints answer
            await eventually(lambda s=shard: _discovered(writer, s))
        await publish(writer, batch("prefill-0", 1, HASHES[:20]))
        assert await eventually(lambda: _is(prefix(writer, HASHES, 2), 20))

        def cli(*args: str) -> str:
            done = subprocess.run(
                [kvfabric, "cache", *args, *target],
                capture_output=True,
                text=True,
                timeout=60,
                check=True,
            )
            return done.stdout

        def ssd_blocks(out: str) -> list[int]:
            rows = [line.split() for line in out.splitlines()[1:]]
            return [
                int(row[2].replace(",", "")) for row in rows if len(row) > 2 and row[1] == "ssd"
            ]

        out = await asyncio.to_thread(cli, "stats")
        assert len(ssd_blocks(out)) == 2 and sum(ssd_blocks(out)) == 20
        assert "num_blocks_stored=20" in out
        await asyncio.to_thread(cli, "evict", "--fraction", "0.5")
        assert await prefix(writer, HASHES, 2) < 20
        out = await asyncio.to_thread(cli, "flush")
        assert ssd_blocks(out) == [0, 0]
        assert await prefix(writer, HASHES, 2) == 0
    finally:
        for shard in shards:
            stop(shard)


async def _discovered(bus: Bus, shard: int) -> bool:
    from shared.discovery import discover

    return any(
        i.metadata.get("shard") == f"{shard}/2" for i in await discover(bus, service="kv-index")
    )


async def test_a_batch_that_cannot_be_applied_is_counted_and_its_writer_resynced(
    nats_server: NatsServer, subject_root: str, bus_factory: BusFactory
) -> None:
    """Nothing in the log is skipped silently: garbage bytes, and a well-formed batch whose
    content the index rejects (a removal of hashes that are not packed u64), each count as a
    bad batch and ask their writer for its whole state; what follows is still applied."""
    index = start_index(nats_server, subject_root)
    try:
        writer = await bus_factory("prefill", "prefill-0")
        resyncs: list[ResyncRequest] = []

        async def on_resync(request: ResyncRequest) -> None:
            resyncs.append(request)

        await writer.subscribe(writer.subjects.kv_resync("prefill-0"), ResyncRequest, on_resync)
        await writer.flush()
        await wait_ready(writer)
        subject = writer.subjects.kv_events("prefill-0")
        await publish(writer, batch("prefill-0", 1, HASHES[:4]))
        await writer.js.publish(subject, b"\xc1 not msgpack")
        unappliable = KvEventBatch(
            writer_id="prefill-0",
            seq=2,
            ts_ms=0,
            events=(BlocksRemoved(tier="ssd", block_hashes=b"\x01\x02\x03"),),
        )
        await writer.js.publish(subject, unappliable)
        await publish(writer, batch("prefill-0", 3, HASHES[4:6], 4))
        assert await eventually(lambda: _true(len(resyncs) == 2))
        assert resyncs[1].received_seq == 2  # the rejected batch's own seq
        assert await eventually(lambda: _is(prefix(writer, HASHES), 6))
        stats = await writer.request(
            writer.subjects.kv_index_admin(0), CacheCommand(action="stats"), CacheStats
        )
        assert stats.counters["num_bad_batches"] == 2
    finally:
        stop(index)


async def test_an_index_that_has_not_replayed_its_log_says_it_is_not_ready(
    nats_server: NatsServer, subject_root: str, bus_factory: BusFactory
) -> None:
    """With no time to replay the log at start-up (catch_up_timeout_s 0) the index serves at
    once, but discovery says STARTING, and why, until it has caught up. (/health answers
    from the same state: tests/service/test_health.py.)"""
    from shared.discovery import discover

    writer = await bus_factory("prefill", "prefill-0")
    await writer.js.ensure_stream(writer.subjects.kv_events_stream, [writer.subjects.kv_events_all])
    # 256 blocks a batch: a replay long enough that the index answers discovery before it
    # ends (with one block a batch it once replayed all 10,000 during its own set-up, and
    # with 30, one run in six).
    batches = [batch("prefill-0", s, LONG_PREFIX) for s in range(1, 10_001)]
    for start in range(0, len(batches), 500):
        await asyncio.gather(*(publish(writer, b) for b in batches[start : start + 500]))
    index = start_index(nats_server, subject_root, 0, 1, "--catch-up-timeout-s", "0")
    try:
        found = await eventually(lambda: discover(writer, service="kv-index", timeout_s=0.2))
        assert found, "kv-index never registered"
        assert found[0].load["state"] == "starting"
        assert "replaying the event log up to 10000" in (found[0].not_ready or "")

        async def serving() -> bool:
            now = await discover(writer, service="kv-index", timeout_s=0.2)
            return bool(now) and now[0].load["state"] == "serving"

        assert await eventually(serving, timeout_s=30)
        again = await discover(writer, service="kv-index", timeout_s=0.3)
        assert again[0].not_ready is None
        assert again[0].metrics["kvfabric_kv_index_event_batches_total"] == 10_000
        assert again[0].metrics["kvfabric_kv_index_log_position"] == 10_000
        assert await prefix(writer, LONG_PREFIX) == len(LONG_PREFIX)
    finally:
        stop(index)


async def test_an_event_log_jetstream_cannot_reserve_stops_start_up_with_the_reason(
    tmp_path: Path, subject_root: str
) -> None:
    """JetStream reserves a stream's max_bytes from the server's max_file_store: an index
    whose event log does not fit exits 1 saying so (not a traceback, not a silent hang)."""
    with NatsServer(tmp_path / "nats", max_file_store_bytes=512 * 2**20) as small:
        index = start_index(small, subject_root)  # its log: 1 GiB
        try:
            index.wait(timeout=60)
            failed = _failed()
        finally:
            stop(index)
    assert index.returncode == 1
    assert "service failed to start" in failed
    assert "JetStream refused stream" in failed
    assert "insufficient storage resources available" in failed
    assert "max_bytes 1073741824 is reserved from the server's max_file_store" in failed
    assert "Traceback" not in failed


async def test_workers_own_memory_is_answered_with_the_match(
    nats_server: NatsServer, subject_root: str, bus_factory: BusFactory
) -> None:
    """A worker's holdings reach both shards over core NATS and come back with a match, per
    worker, in one query; an update lost in flight is repaired by a sync; a worker that says
    goodbye is forgotten at once, one that falls silent after --holder-ttl-s."""
    shards = [start_index(nats_server, subject_root, s, 2, "--holder-ttl-s", "1") for s in range(2)]
    try:
        worker = await bus_factory("prefill", "prefill-0")
        await wait_ready(worker, num_shards=2)
        holdings = Holdings("prefill-0")
        publisher = HoldingsPublisher(worker, holdings, interval_s=0.05, keepalive_s=0.2)
        await publisher.start()
        for block_hash in HASHES[:6]:
            holdings.set(block_hash, HOLD_DEVICE, True)
        for block_hash in HASHES[6:9]:
            holdings.set(block_hash, HOLD_HOST, True)

        async def own() -> dict[str, index_client.MemoryHit]:
            _, hits = await index_client.match_with_holders(worker, HASHES, num_shards=2)
            return hits

        async def hit_is(expected: index_client.MemoryHit) -> bool:
            return (await own()).get("prefill-0") == expected

        assert await eventually(lambda: hit_is(index_client.MemoryHit(9, 6)))
        holdings.set(HASHES[9], HOLD_HOST, True)
        holdings.take_update()  # lost in flight: the next one shows the gap
        assert await eventually(lambda: hit_is(index_client.MemoryHit(10, 6)))
        await publisher.stop()  # goodbye
        assert await eventually(lambda: _is(own(), {}))

        other = Holdings("decode-0")
        other.set(HASHES[0], HOLD_DEVICE, True)
        silent = HoldingsPublisher(worker, other, interval_s=0.05, keepalive_s=0.2)
        await silent.start()
        assert await eventually(lambda: _is(own(), {"decode-0": index_client.MemoryHit(1, 1)}))
        await cancel_and_wait(silent._task)  # its process frozen or cut off: no goodbye
        assert await eventually(lambda: _is(own(), {}))  # forgotten after 1 s
        stats = [
            await worker.request(
                worker.subjects.kv_index_admin(s), CacheCommand(action="stats"), CacheStats
            )
            for s in range(2)
        ]
        assert sum(s.counters["num_holder_syncs"] for s in stats) >= 4  # 2 first, 2 after gaps
    finally:
        for shard in shards:
            stop(shard)
