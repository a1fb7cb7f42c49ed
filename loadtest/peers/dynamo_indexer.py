"""NVIDIA Dynamo's KV indexer (`dynamo.llm.RadixTree`, ai-dynamo-runtime) driven the way
loadtest/bench_kv_index.py drives ours: the same stored-block events and the same match
queries, read from files that benchmark writes. Runs in Dynamo's own venv (stdlib + dynamo):

    <dynamo venv>/bin/python loadtest/peers/dynamo_indexer.py

One JSON command a line on stdin, one JSON reply a line on stdout:

- {"op": "ingest", "path": P}: the events in file P, each turned into the bytes
  `RadixTree.apply_event` takes (a serialized `KvCacheEvent`: {"event_id", "data": {"stored":
  {"parent_hash", "blocks": [{"block_hash", "tokens_hash"}]}}}) before the clock starts, then
  applied; a `find_matches` call at the end waits for the tree's worker thread to have
  applied them all (apply_event only queues). Reply: num_events, num_blocks, wall_s, cpu_s.
- {"op": "match", "path": P, "count": N, "worker": W, "expect": E}: N longest-prefix matches
  of the packed u64 hashes in P (what our MatchRequest carries), each timed from those bytes
  to the scores: array('Q') -> list -> find_matches -> .scores. Worker W must score E.
  Reply: wall_s and cpu_s, one per match (process CPU: the tree works in its own thread).
- {"op": "memory"}: the process's anonymous resident bytes (after gc and malloc_trim).
- {"op": "quit"}.

The event file: records of a little-endian (worker u32, num_blocks u32, parent u64; 0 for
none) header and num_blocks u64 block hashes. A block's `tokens_hash` is its block hash:
kvfabric's hashes are chained, so each already names its whole prefix.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import os
import struct
import sys
import time
from array import array

HEADER = struct.Struct("<IIQ")


def read_events(path: str) -> list[tuple[int, int, array]]:
    with open(path, "rb") as events_file:
        data = events_file.read()
    events, offset = [], 0
    while offset < len(data):
        worker, num_blocks, parent = HEADER.unpack_from(data, offset)
        offset += HEADER.size
        hashes = array("Q")
        hashes.frombytes(data[offset : offset + 8 * num_blocks])
        if sys.byteorder != "little":
            hashes.byteswap()
        offset += 8 * num_blocks
        events.append((worker, parent, hashes))
    return events


class Indexer:
    def __init__(self) -> None:
        from dynamo.llm import RadixTree  # here: the event reader is importable without it

        self.tree = RadixTree()
        self.event_ids: dict[int, int] = {}

    def payloads(self, path: str) -> tuple[list[tuple[int, bytes]], int]:
        out, num_blocks = [], 0
        for worker, parent, hashes in read_events(path):
            num_blocks += len(hashes)
            event_id = self.event_ids[worker] = self.event_ids.get(worker, 0) + 1
            blocks = [{"block_hash": h, "tokens_hash": h} for h in hashes.tolist()]
            stored = {"parent_hash": parent or None, "blocks": blocks}
            event = {"event_id": event_id, "data": {"stored": stored}}
            out.append((worker, json.dumps(event, separators=(",", ":")).encode()))
        return out, num_blocks

    def ingest(self, path: str) -> dict:
        payloads, num_blocks = self.payloads(path)
        gc.collect()
        apply = self.tree.apply_event
        wall, cpu = time.perf_counter(), time.process_time()
        for worker, payload in payloads:
            apply(worker, payload)
        self.tree.find_matches([0])  # queued behind every event: returns once they are in
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        return {"num_events": len(payloads), "num_blocks": num_blocks, "wall_s": wall, "cpu_s": cpu}

    def match(self, path: str, count: int, worker: int, expect: int) -> dict:
        with open(path, "rb") as query_file:
            payload = query_file.read()
        find = self.tree.find_matches
        walls, cpus = [], []
        for _ in range(count):
            wall, cpu = time.perf_counter(), time.process_time()
            hashes = array("Q")
            hashes.frombytes(payload)
            scores = find(hashes.tolist()).scores
            cpus.append(time.process_time() - cpu)
            walls.append(time.perf_counter() - wall)
            got = max((s for (w, _), s in scores.items() if w == worker), default=0)
            if got != expect:
                raise RuntimeError(f"worker {worker} scored {got} blocks, expected {expect}")
        return {"wall_s": walls, "cpu_s": cpus}


def resident_bytes() -> int:
    """Anonymous resident memory once the allocator has handed back what it could (the
    events' JSON is freed by then, but glibc keeps freed heap until asked)."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # not glibc: what the heap kept counts
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    # Anonymous pages only (heap, private mappings): file-backed ones (libraries, mapped
    # files) come and go as the kernel reclaims them, which swamped the growth of a small index.
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    with open("/proc/self/statm") as statm:  # a kernel without RssAnon (before 4.5)
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main() -> None:
    indexer = Indexer()
    for line in sys.stdin:
        command = json.loads(line)
        op = command.get("op")
        try:
            if op == "ingest":
                reply = indexer.ingest(command["path"])
            elif op == "match":
                reply = indexer.match(
                    command["path"], command["count"], command["worker"], command["expect"]
                )
            elif op == "memory":
                reply = {"resident_bytes": resident_bytes()}
            elif op == "quit":
                return
            else:
                reply = {"error": f"unknown op {op!r}"}
        except Exception as exc:  # the benchmark reports it; the tree is still usable
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
