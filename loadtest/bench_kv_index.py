"""kv-index benchmark (in process): match latency for a 77K-token (1,200-block) prefix, memory
per indexed block, and events ingested per second.

    python -m loadtest.bench_kv_index [--num-blocks 1000000]

Targets (issue 4): match p99 < 1 ms, <= 200 bytes per indexed block.
"""

from __future__ import annotations

import argparse
import gc
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-blocks", type=int, default=1_000_000)
    parser.add_argument("--num-matches", type=int, default=2000)
    args = parser.parse_args()

    print(f"building {args.num_blocks:,} blocks of events ...", flush=True)
    events = batches(args.num_blocks, seed=1)
    gc.collect()
    tracemalloc.start()
    index = KvIndex(capacity_bytes={"ssd": 1 << 62})
    base, _ = tracemalloc.get_traced_memory()
    started = time.perf_counter()
    for batch in events:
        index.apply(batch, now=0.0)
    ingest_s = time.perf_counter() - started
    used, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    num_indexed = len(index.tables["ssd"])

    # The agent's prompt: a 1,200-block chain, all of it cached (the heaviest match).
    hasher = BlockHasher("bench", block_size_tokens=64)
    prefix = hasher.hashes(range(64 * PREFIX_BLOCKS))
    index.apply(KvEventBatch(writer_id="decode-0", seq=1, ts_ms=0, events=(BlocksStored(
        tier="ssd", blocks=tuple(StoredBlock(h, 9, i, 1, 98_304) for i, h in enumerate(prefix))),)),
        now=0.0)  # fmt: skip
    latencies = []
    for i in range(args.num_matches):
        started = time.perf_counter()
        [result] = index.match(prefix, now=float(i))
        latencies.append(time.perf_counter() - started)
        assert result.first_miss_index == PREFIX_BLOCKS
    latencies.sort()
    p50, p99 = statistics.median(latencies), latencies[int(0.99 * len(latencies))]
    bytes_per_block = (used - base) / num_indexed
    print(f"indexed blocks            {num_indexed:,}")
    print(f"events ingested           {num_indexed / ingest_s:,.0f} blocks/s "
          f"({len(events) / ingest_s:,.0f} batches/s of {BLOCKS_PER_BATCH})")  # fmt: skip
    print(f"memory per indexed block  {bytes_per_block:.0f} bytes (target <= 200: "
          f"{'met' if bytes_per_block <= 200 else 'NOT met'})")  # fmt: skip
    print(f"match {PREFIX_BLOCKS} blocks p50    {p50 * 1e3:.3f} ms")
    print(f"match {PREFIX_BLOCKS} blocks p99    {p99 * 1e3:.3f} ms (target < 1 ms: "
          f"{'met' if p99 < 1e-3 else 'NOT met'})")  # fmt: skip


if __name__ == "__main__":
    main()
