"""kv-index against NVIDIA Dynamo's KV indexer (ai-dynamo-runtime 1.6.1, `RadixTree`), side
by side: the same stored-block events and the same 1,200-block (77K-token) match queries,
each side decoding its own wire format from bytes, at 240K and at 10M indexed blocks.

    python -m loadtest.bench_kv_index [--quick] [--no-peer] [--sizes 240000 10000000]

The workload (seeded; written to files both sides read): 8 prefill writers storing 64-block
events round-robin, each continuing its own chain (a new one 1 time in 8); within them two
1,200-block prefixes, one stored by one event (as a long prompt's prefill stores it) and one
stored in 40 turns of 30 blocks by one writer between the others' events (as an agent's
conversation grows). Each is then matched whole, over and over.

- Ours: KvIndex in this process, fed our `KvEventBatch` as the service receives it (msgpack
  bytes -> shared.schema decode -> `apply`); a match from a `MatchRequest`'s bytes to the
  per-tier `TierResult`s with every block's location (decode, unpack, `match`).
- Dynamo's: loadtest/peers/dynamo_indexer.py in Dynamo's own venv (built on demand under
  ~/.cache/kvfabric/peers/dynamo), fed JSON `KvCacheEvent` bytes (`apply_event`, then one
  `find_matches` to wait for its worker thread), matching from the same packed u64 bytes to
  its per-worker scores.

Both build file by file (a sixteenth of the run each) and match in 20 rounds, one side then
the other, so drift in this shared machine's load falls on both. Wall-clock figures are the
targets' (match p99 ours/Dynamo <= 0.5, ingest ratio >= 1, at both sizes; <= 32 bytes per
indexed block at 10M, tracemalloc on a separate build). Beside them: CPU time (the whole
process, so Dynamo's worker thread counts), and how often a busy loop loses the CPU here
before and after. On a loaded 2-core machine every tail carries those stalls (a ~20 us timer
tick every ~1 ms at the least), and wall-clock ingest favours the side with more threads
(the scheduler shares the cores per thread; ours is one, Dynamo's tree has its own).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import struct
import subprocess
import tempfile
import time
import tracemalloc
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from loadtest.peers import dynamo_indexer  # its resident_bytes: the same measure on both sides
from loadtest.results import BenchResult
from services.kv_index import native
from services.kv_index.index import KvIndex
from shared.schema import BlocksStored, KvEventBatch, StoredBlock, pack_block_hashes
from shared.schema.base import decode, encode
from shared.schema.kv_index import MatchRequest
from shared.schema.tokens import unpack_block_hashes
from shared.venvs import VenvUnavailable, ensure_venv

DYNAMO = "ai-dynamo-runtime==1.6.1"
PEER_SCRIPT = Path(__file__).with_name("peers") / "dynamo_indexer.py"
SIZES = (240_000, 10_000_000)
QUICK_SIZES = (24_000, 96_000)
BLOCKS_PER_EVENT = 64  # one 4K-token prefill's worth of blocks per event
PREFIX_BLOCKS = 1200  # 77K tokens at 64 tokens per block
NUM_TURNS = 40
NUM_FILLER_WRITERS = 8
# Events per file: a sixteenth of the run, 16K to 256K blocks. Each side ingests a file in
# turn, so a burst of load on this shared machine lands on both sides, not one.
MIN_CHUNK_BLOCKS, MAX_CHUNK_BLOCKS = 1 << 14, 1 << 18
NUM_BYTES = 64 * 6_144  # a 64-token block at the reference deployment's 6 KiB per token
NOW = 1_000_000.0
HEADER = struct.Struct("<IIQ")  # writer, num_blocks, parent hash (0: none); the peer's too
WRITERS = [*(f"prefill-{w}" for w in range(NUM_FILLER_WRITERS)), "decode-0", "decode-1"]
ONE_EVENT, TURNS = NUM_FILLER_WRITERS, NUM_FILLER_WRITERS + 1  # the prefixes' writers
PREFIXES = {ONE_EVENT: "stored by one event", TURNS: f"stored in {NUM_TURNS} turns"}


@dataclass
class Workload:
    """The event files (chunks of ~1M blocks) and each prefix's query (packed u64 hashes)."""

    chunks: list[Path] = field(default_factory=list)
    queries: dict[int, Path] = field(default_factory=dict)  # prefix writer -> its hashes
    num_blocks: int = 0


def write_workload(directory: Path, num_filler_blocks: int, seed: int) -> Workload:
    rng = np.random.default_rng(seed)
    events: list[tuple[int, int, np.ndarray]] = []
    last_hash = [0] * len(WRITERS)  # each writer's chain so far
    workload = Workload()

    def add(writer: int, hashes: np.ndarray, new_chain: bool) -> None:
        events.append((writer, 0 if new_chain else last_hash[writer], hashes))
        last_hash[writer] = int(hashes[-1])

    def flush() -> None:
        path = directory / f"events-{len(workload.chunks):03d}.bin"
        with path.open("wb") as out:
            for writer, parent, block_hashes in events:
                out.write(HEADER.pack(writer, len(block_hashes), parent))
                out.write(block_hashes.astype("<u8").tobytes())
        workload.chunks.append(path)
        workload.num_blocks += sum(len(h) for _, _, h in events)
        events.clear()

    # Every hash drawn up front (1 to 2**64 - 1: 0 means "no parent" in the files).
    filler = rng.integers(1, 1 << 64, num_filler_blocks, dtype=np.uint64, endpoint=False)
    new_chains = rng.random(-(-num_filler_blocks // BLOCKS_PER_EVENT)) < 1 / 8
    prefixes = {
        writer: rng.integers(1, 1 << 64, PREFIX_BLOCKS, dtype=np.uint64, endpoint=False)
        for writer in PREFIXES
    }
    turns = np.array_split(prefixes[TURNS], NUM_TURNS)
    chunk_blocks = min(MAX_CHUNK_BLOCKS, max(MIN_CHUNK_BLOCKS, num_filler_blocks // 16))
    num_events, in_chunk = len(new_chains), 0
    for event in range(num_events):
        if event == num_events // 2:
            add(ONE_EVENT, prefixes[ONE_EVENT], new_chain=True)
        while turns and event >= (NUM_TURNS - len(turns)) * num_events // NUM_TURNS:
            add(TURNS, turns.pop(0), new_chain=len(turns) == NUM_TURNS - 1)
        start = event * BLOCKS_PER_EVENT
        add(
            event % NUM_FILLER_WRITERS,
            filler[start : start + BLOCKS_PER_EVENT],
            new_chain=bool(new_chains[event]),
        )
        in_chunk += BLOCKS_PER_EVENT
        if in_chunk >= chunk_blocks:
            flush()
            in_chunk = 0
    if events:
        flush()
    for writer, prefix in prefixes.items():
        workload.queries[writer] = directory / f"query-{writer}.bin"
        workload.queries[writer].write_bytes(pack_block_hashes(prefix))
    return workload


def read_events(path: Path) -> list[tuple[int, int, np.ndarray]]:
    data = path.read_bytes()
    events, offset = [], 0
    while offset < len(data):
        writer, num_blocks, parent = HEADER.unpack_from(data, offset)
        offset += HEADER.size
        events.append((writer, parent, np.frombuffer(data, "<u8", num_blocks, offset)))
        offset += 8 * num_blocks
    return events


class Ours:
    """Our side: KvIndex fed our wire format."""

    def __init__(self) -> None:
        self.index = KvIndex(capacity_bytes={"ssd": 1 << 62})
        self.seq = [0] * len(WRITERS)
        self.slot = [0] * len(WRITERS)

    def payloads(self, path: Path) -> list[bytes]:
        """The chunk's events as writers publish them: encoded KvEventBatches."""
        out = []
        for writer, parent, hashes in read_events(path):
            first = self.slot[writer]
            self.slot[writer] += len(hashes)
            self.seq[writer] += 1
            blocks = tuple(
                StoredBlock(h, writer, first + i, 1, NUM_BYTES)
                for i, h in enumerate(hashes.tolist())
            )
            event = BlocksStored(tier="ssd", blocks=blocks, parent_block_hash=parent or None)
            batch = KvEventBatch(
                writer_id=WRITERS[writer], seq=self.seq[writer], ts_ms=0, events=(event,)
            )
            out.append(encode(batch))
        return out

    def ingest(self, path: Path) -> tuple[float, float]:
        payloads = self.payloads(path)
        gc.collect()
        apply, wall, cpu = self.index.apply, time.perf_counter(), time.process_time()
        for payload in payloads:
            apply(decode(payload, KvEventBatch), NOW)
        return time.perf_counter() - wall, time.process_time() - cpu

    def match(self, path: Path, count: int, writer: int) -> tuple[list[float], list[float]]:
        payload = encode(MatchRequest(block_hashes=path.read_bytes()))
        match, walls, cpus = self.index.match, [], []
        for i in range(count):
            wall, cpu = time.perf_counter(), time.process_time()
            request = decode(payload, MatchRequest)
            [result] = match(unpack_block_hashes(request.block_hashes), NOW + i)
            cpus.append(time.process_time() - cpu)
            walls.append(time.perf_counter() - wall)
            if result.first_miss_index != PREFIX_BLOCKS or result.locations.writer_ids != (
                WRITERS[writer],
            ):
                raise RuntimeError(f"our match found {result.first_miss_index} blocks")
        return walls, cpus


class Dynamo:
    """Dynamo's side: the peer script in its venv, one JSON command a line."""

    def __init__(self, python: Path) -> None:
        self.process = subprocess.Popen(
            [str(python), str(PEER_SCRIPT)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def ask(self, **command: object) -> dict:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the Dynamo indexer exited ({self.process.wait()})")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"the Dynamo indexer: {reply['error']}")
        return reply

    def ingest(self, path: Path) -> tuple[float, float]:
        reply = self.ask(op="ingest", path=str(path))
        return reply["wall_s"], reply["cpu_s"]

    def match(self, path: Path, count: int, writer: int) -> tuple[list[float], list[float]]:
        reply = self.ask(
            op="match", path=str(path), count=count, worker=writer, expect=PREFIX_BLOCKS
        )
        return reply["wall_s"], reply["cpu_s"]

    def resident_bytes(self) -> int:
        return self.ask(op="memory")["resident_bytes"]

    def close(self) -> None:
        assert self.process.stdin is not None
        if self.process.poll() is None:
            self.process.stdin.write(json.dumps({"op": "quit"}) + "\n")
            self.process.stdin.close()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def bytes_per_block(workload: Workload) -> float:
    """Our index's memory per indexed block: a separate build under tracemalloc (tracing
    slows allocation, so the timed build runs without it)."""
    ours = Ours()
    gc.collect()
    tracemalloc.start()
    base, _ = tracemalloc.get_traced_memory()
    for chunk in workload.chunks:
        for payload in ours.payloads(chunk):
            ours.index.apply(decode(payload, KvEventBatch), NOW)
    gc.collect()
    used, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return (used - base) / len(ours.index.tables["ssd"])


def machine_stalls(duration_s: float = 0.5) -> tuple[float, float]:
    """How often this machine takes the CPU away from a busy loop for more than 10 us, and
    for how long (the median): what every tail latency here carries. On this 2-core VM a
    timer tick costs ~20 us every ~1 ms, so a 25 us match meets one 1 time in 40."""
    clock, stalls = time.perf_counter, []
    last = clock()
    end = last + duration_s
    while last < end:
        now = clock()
        if now - last > 10e-6:
            stalls.append(now - last)
        last = now
    return len(stalls) / duration_s, statistics.median(stalls) if stalls else 0.0


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def measure_size(
    result: BenchResult,
    size: int,
    dynamo_python: Path | None,
    num_matches: int,
    rounds: int,
    seed: int,
    memory: bool,
) -> None:
    label = f"{size / 1e6:g}M" if size >= 1_000_000 else f"{size / 1e3:g}K"
    with tempfile.TemporaryDirectory(prefix="bench-kv-index-") as tmp:
        workload = write_workload(Path(tmp), size, seed)
        ours = Ours()
        dynamo = Dynamo(dynamo_python) if dynamo_python else None
        try:
            peer_base = dynamo.resident_bytes() if dynamo else 0
            our_base = dynamo_indexer.resident_bytes()
            timing = {"ours": [0.0, 0.0], "dynamo": [0.0, 0.0]}
            sides = [("ours", ours), ("dynamo", dynamo)]
            for i, chunk in enumerate(workload.chunks):  # file by file, each side in turn
                for side, runner in sides[:: 1 if i % 2 else -1]:  # who goes first alternates
                    if runner is not None:
                        wall, cpu = runner.ingest(chunk)
                        timing[side][0] += wall
                        timing[side][1] += cpu
            num_indexed = len(ours.index.tables["ssd"])
            our_resident = (dynamo_indexer.resident_bytes() - our_base) / num_indexed
            latencies: dict[tuple[str, int], tuple[list[float], list[float]]] = {}
            per_round = max(1, num_matches // rounds)
            for i in range(rounds):
                for writer, query in workload.queries.items():
                    for side, runner in sides[:: 1 if i % 2 else -1]:
                        if runner is not None:
                            walls, cpus = runner.match(query, per_round, writer)
                            done = latencies.setdefault((side, writer), ([], []))
                            done[0].extend(walls)
                            done[1].extend(cpus)
            peer_resident = (dynamo.resident_bytes() - peer_base) / num_indexed if dynamo else 0
        finally:
            if dynamo is not None:
                dynamo.close()
        report(result, label, workload.num_blocks, timing, latencies, our_resident, peer_resident)
        if memory:  # the target is at 10M blocks; a smaller table pays its growth steps
            result.figure(
                f"memory per indexed block, {label} blocks (tracemalloc)",
                bytes_per_block(workload),
                "bytes",
                32 if size >= 10**7 else None,
                lower_is_better=True,
            )


def report(
    result: BenchResult,
    label: str,
    num_blocks: int,
    timing: dict,
    latencies: dict,
    our_resident: float,
    peer_resident: float,
) -> None:
    """Ratios where Dynamo was measured (figures of ours alone where not)."""
    peer = "Dynamo RadixTree"
    has_peer = timing["dynamo"][0] > 0

    def compare(
        name: str,
        ours: float,
        theirs: float,
        unit: str,
        target: float | None = None,
        lower: bool = False,
    ) -> None:
        if has_peer:
            result.ratio(name, ours, theirs, peer, unit, target, lower_is_better=lower)
        else:
            result.figure(name, ours, unit)

    (our_wall, our_cpu), (peer_wall, peer_cpu) = timing["ours"], timing["dynamo"]
    compare(
        f"ingest, {label} blocks",
        num_blocks / our_wall,
        num_blocks / peer_wall if has_peer else 0,
        "blocks/s",
        1.0,
    )
    compare(
        f"ingest per CPU-second, {label} blocks",
        num_blocks / our_cpu,
        num_blocks / peer_cpu if has_peer else 0,
        "blocks/s",
    )
    for writer, how in PREFIXES.items():
        name = f"match {PREFIX_BLOCKS} blocks {how}, {label} blocks"
        walls, cpus = latencies[("ours", writer)]
        peer_walls, peer_cpus = latencies.get(("dynamo", writer), ([0.0], [0.0]))
        compare(
            f"{name}: p99",
            percentile(walls, 0.99) * 1e6,
            percentile(peer_walls, 0.99) * 1e6,
            "us",
            0.5,
            lower=True,
        )
        compare(
            f"{name}: p50",
            statistics.median(walls) * 1e6,
            statistics.median(peer_walls) * 1e6,
            "us",
            lower=True,
        )
        compare(
            f"{name}: CPU p99",
            percentile(cpus, 0.99) * 1e6,
            percentile(peer_cpus, 0.99) * 1e6,
            "us",
            lower=True,
        )
    compare(
        f"resident memory growth per indexed block, {label} blocks",
        our_resident,
        peer_resident,
        "bytes",
        lower=True,
    )


def run(
    quick: bool = False,
    peer: bool = True,
    sizes: tuple[int, ...] | None = None,
    num_matches: int | None = None,
    rounds: int = 20,
    seed: int = 1,
) -> BenchResult:
    sizes = tuple(sizes or (QUICK_SIZES if quick else SIZES))
    num_matches = num_matches or (200 if quick else 2000)
    result = BenchResult("kv-index", quick)
    result.note(f"our index: {'C' if native.available() else 'dict (no C compiler)'} row index")
    dynamo_python = None
    if peer:
        try:
            dynamo_python = ensure_venv("dynamo", [DYNAMO])
        except VenvUnavailable as exc:
            result.note(f"Dynamo not measured: its venv could not be built: {exc}")
    else:
        result.note("ours alone (--no-peer): no ratios against Dynamo")
    stalls = [machine_stalls()]
    for size in sizes:  # memory at the largest size: the target's 10M in a full run
        measure_size(result, size, dynamo_python, num_matches, rounds, seed, size == max(sizes))
    stalls.append(machine_stalls())
    for when, (per_s, median_s) in zip(("before", "after"), stalls, strict=True):
        result.figure(f"machine {when}: stalls > 10 us a busy loop sees", per_s, "per s")
        result.figure(f"machine {when}: median stall", median_s * 1e6, "us")
    result.note(
        "latencies are wall clock from the query's bytes to each side's answer (ours: every "
        "block's location per tier; Dynamo's: per-worker block counts); CPU p99 counts the "
        "whole process (Dynamo's tree works in a thread of its own)"
    )
    return result.finish()


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (CI)")
    parser.add_argument("--no-peer", action="store_true", help="ours alone, no Dynamo venv")
    parser.add_argument("--sizes", type=int, nargs="+", help="indexed blocks per run")
    parser.add_argument("--num-matches", type=int, help="matches per prefix and side")
    parser.add_argument("--rounds", type=int, default=20, help="rounds the matches alternate in")
    parser.add_argument("--json", type=Path, help="also write the result here")
    args = parser.parse_args()
    result = run(
        args.quick,
        not args.no_peer,
        tuple(args.sizes) if args.sizes else None,
        args.num_matches,
        args.rounds,
    )
    result.print()
    if args.json:
        result.write_json(args.json)


if __name__ == "__main__":
    main()
