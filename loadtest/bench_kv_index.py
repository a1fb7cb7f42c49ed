"""kv-index benchmark (in process): match latency for a 77K-token (1,200-block) prefix, memory
per indexed block, and events ingested per second.

    python -m loadtest.bench_kv_index [--num-blocks 1000000]

Targets (issue 4): match p99 < 1 ms, <= 200 bytes per indexed block.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import time
import tracemalloc

from services.kv_index.index import KvIndex
from shared.kvstore.hashing import BlockHasher
from shared.schema import BlocksStored, KvEventBatch, StoredBlock

BLOCKS_PER_BATCH = 64  # one 4K-token prefill's worth of blocks per event batch
PREFIX_BLOCKS = 1200  # 77K tokens at 64 tokens per block


def batches(num_blocks: int, seed: int) -> list[KvEventBatch]:
    """Random hashes in batches of 64, round-robin over 8 writers, each in sequence."""
    rng = random.Random(seed)
    out = []
    for batch_index, start in enumerate(range(0, num_blocks, BLOCKS_PER_BATCH), start=1):
        count = min(BLOCKS_PER_BATCH, num_blocks - start)
        blocks = tuple(
            StoredBlock(rng.getrandbits(64), start // 65536, start % 65536 + i, 1, 98_304)
            for i in range(count)
        )
        event = BlocksStored(tier="ssd", blocks=blocks)
        writer = f"prefill-{batch_index % 8}"
        out.append(
            KvEventBatch(writer_id=writer, seq=batch_index // 8 + 1, ts_ms=0, events=(event,))
        )
    return out


def match_latencies(index: KvIndex, num_matches: int) -> tuple[list[float], list[float]]:
    """The agent's prompt: a 1,200-block chain, all of it cached (the heaviest match)."""
    prefix = BlockHasher("bench", block_size_tokens=64).hashes(range(64 * PREFIX_BLOCKS))
    blocks = tuple(StoredBlock(h, 9, i, 1, 98_304) for i, h in enumerate(prefix))
    stored = KvEventBatch(
        writer_id="decode-0", seq=1, ts_ms=0, events=(BlocksStored("ssd", blocks),)
    )
    index.apply(stored, now=0.0)
    wall, cpu = [], []
    for i in range(num_matches):
        started, started_cpu = time.perf_counter(), time.thread_time()
        [result] = index.match(prefix, now=float(i))
        wall.append(time.perf_counter() - started)
        cpu.append(time.thread_time() - started_cpu)
        assert result.first_miss_index == PREFIX_BLOCKS
    return sorted(wall), sorted(cpu)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-blocks", type=int, default=1_000_000)
    parser.add_argument("--num-matches", type=int, default=2000)
    args = parser.parse_args()

    print(f"building {args.num_blocks:,} blocks of events ...", flush=True)
    events = batches(args.num_blocks, seed=1)
    gc.collect()
    index = KvIndex(capacity_bytes={"ssd": 1 << 62})
    started = time.perf_counter()
    for batch in events:
        index.apply(batch, now=0.0)
    ingest_s = time.perf_counter() - started
    num_indexed, num_batches = len(index.tables["ssd"]), len(events)
    # As in the service, decoded batches do not outlive their ingestion: 1M live GC-tracked
    # structs would put full collections (~4 ms) into the match tail (measured).
    del events
    gc.collect()
    latencies, cpu_times = match_latencies(index, args.num_matches)
    del index
    gc.collect()

    # Memory last, on a second index built under tracemalloc (tracing slows allocation).
    events = batches(args.num_blocks, seed=1)
    gc.collect()
    tracemalloc.start()
    measured = KvIndex(capacity_bytes={"ssd": 1 << 62})
    base, _ = tracemalloc.get_traced_memory()
    for batch in events:
        measured.apply(batch, now=0.0)
    used, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()

    p50, p99 = statistics.median(latencies), latencies[int(0.99 * len(latencies))]
    cpu_p99 = cpu_times[int(0.99 * len(cpu_times))]
    bytes_per_block = (used - base) / num_indexed
    print(f"indexed blocks            {num_indexed:,}")
    print(f"events ingested           {num_indexed / ingest_s:,.0f} blocks/s "
          f"({num_batches / ingest_s:,.0f} batches/s of {BLOCKS_PER_BATCH})")  # fmt: skip
    print(f"memory per indexed block  {bytes_per_block:.0f} bytes (target <= 200: "
          f"{'met' if bytes_per_block <= 200 else 'NOT met'})")  # fmt: skip
    print(f"match {PREFIX_BLOCKS} blocks p50    {p50 * 1e3:.3f} ms")
    print(f"match {PREFIX_BLOCKS} blocks p99    {p99 * 1e3:.3f} ms wall (target < 1 ms: "
          f"{'met' if p99 < 1e-3 else 'NOT met'}), {cpu_p99 * 1e3:.3f} ms of CPU")  # fmt: skip
    # On a loaded machine the wall-clock tail is the scheduler's time slice (~4 ms) landing
    # on 1% of matches; the CPU-time p99 is what the index itself costs.
    print(f"load average during the run: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
