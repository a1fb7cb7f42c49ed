"""KV data-plane benchmark: the SSD store against raw sequential file I/O on the same disk,
and prefill -> decode NIXL (UCX) transfer between two processes against an in-process
memcpy, side by side in one run (this machine is shared and noisy: only ratios mean much).

    python -m loadtest.bench_kv [--dir DIR] [--small-blocks 2000] [--big-blocks 100]

Store: blocks are written with `KvStore.write_blocks` in batches of `--batch` (100) and the
files fsync'ed (later rounds rewrite the slots freed with `free_slots`), then read back in
the same order with `read_blocks(into=...)` (header and checksum verified, payload copied
into a reused pool, as decode would into its KV pages). Raw: the same number of payload
bytes written to a plain file with os.write in 8 MiB chunks and fsync'ed; raw read: the
store's own slot file (headers and padding included), read sequentially with readinto into a
reused 8 MiB buffer just before the store reads it: the same bytes on the same disk (a
separately written raw file read up to 1.5x faster or slower in single runs, from where it
landed on the virtual disk). The page cache is dropped (`echo 1 >
/proc/sys/vm/drop_caches`, needs root) before every read; the output says whether that
worked. Raw and store alternate for `--rounds` rounds and the medians are compared: single
runs on this shared machine varied 3x. Store GB/s count payload bytes only, so its 64-byte
headers and 4 KiB slot padding count against it. Target: store read >= 0.8x raw.

Transfer: a receiver process serves its NIXL metadata over a real nats-server; a sender
process writes `--batch` blocks into it (scattered: block i to the peer's block n-1-i, so
NIXL cannot merge them into one run) with a notification, repeated; GB/s from `transfer` to
DONE. The baseline, interleaved with the transfers in the sender, copies the same blocks
between two buffers of one process. Run with UCX_TLS=tcp,cma and with UCX's default
transports (quick: tcp,cma only). Target: >= 0.5x memcpy.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import xxhash

from loadtest.results import BenchResult, bench_options
from shared.bus import Bus
from shared.natsd import NatsServer
from shared.schema import StoredBlock
from worker.kvstore import KvStore, KvStoreConfig, SlotRef
from worker.transfer import ByteRange, KvTransferAgent

SMALL_BLOCK_NBYTES = 98_304  # 64 tokens x 3 full layers x K,V x 2 kv heads x 64 dim x bf16
BIG_BLOCK_NBYTES = 2 << 20  # a big model's block (e.g. 64 tokens x 61 layers x MLA 576 dims)
RAW_CHUNK_NBYTES = 8 << 20
RECEIVER_SERVICE = "decode"
TLS_SETTINGS = ("tcp,cma", None)  # UCX_TLS of each transfer run (None: UCX's default)


def say(message: str) -> None:
    print(message, flush=True)


def drop_caches() -> str | None:
    """Drop the page cache; the reason it could not be, or None."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def fsync_tree(directory: Path) -> None:
    for path in directory.rglob("*.kvs"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def raw_write(path: Path, data: np.ndarray) -> float:
    started = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        for start in range(0, data.nbytes, RAW_CHUNK_NBYTES):
            os.write(fd, view[start : start + RAW_CHUNK_NBYTES])
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - started


def raw_read(path: Path, nbytes: int) -> float:
    buffer = bytearray(RAW_CHUNK_NBYTES)
    started = time.perf_counter()
    total = 0
    with open(path, "rb", buffering=0) as f:
        while (n := f.readinto(buffer)) and total < nbytes:
            total += n
    return time.perf_counter() - started


class StoreRun:
    """One store (one backend) holding the benchmark's blocks, rewritten and reread per round."""

    def __init__(
        self, workdir: Path, backend: str, block_nbytes: int, num_blocks: int, batch: int
    ) -> None:
        self.root = workdir / f"store-{backend.replace(':', '-')}-{block_nbytes}"
        self.store = KvStore.open(
            KvStoreConfig(
                self.root,
                "bench",
                block_nbytes,
                capacity_bytes=(num_blocks + 8) * (block_nbytes + 8192),
                backend=backend,
                staging_nbytes=batch * (block_nbytes + 4096),
            )
        )
        self.block_nbytes, self.num_blocks, self.batch = block_nbytes, num_blocks, batch
        self.stored: list[StoredBlock] = []
        self.pool = np.ones((batch, block_nbytes), dtype=np.uint8)  # reused, like KV pages

    async def write(self, data: np.ndarray) -> float:
        """Seconds to write every block (into the slots freed from the last round) + fsync."""
        self.store.free_slots(self.stored)
        n = self.block_nbytes
        blocks = [(i + 1, data[i * n : (i + 1) * n]) for i in range(self.num_blocks)]
        started = time.perf_counter()
        stored = []
        for start in range(0, self.num_blocks, self.batch):
            stored += await self.store.write_blocks(blocks[start : start + self.batch])
        fsync_tree(self.root)
        elapsed_s = time.perf_counter() - started
        self.stored = [b for b in stored if b is not None]
        if len(self.stored) != self.num_blocks:
            raise RuntimeError(f"only {len(self.stored)} blocks stored: {self.store.stats()}")
        return elapsed_s

    async def read(self) -> float:
        """Seconds to read every block back into the reused pool (page cache dropped)."""
        refs = [
            SlotRef(b.block_hash, "bench", b.file_id, b.slot, b.generation) for b in self.stored
        ]
        pages = [memoryview(self.pool[i]) for i in range(self.batch)]
        drop_caches()
        started = time.perf_counter()
        num_hits = 0
        for start in range(0, self.num_blocks, self.batch):
            chunk = refs[start : start + self.batch]
            got = await self.store.read_blocks(chunk, into=pages[: len(chunk)])
            num_hits += sum(g is not None for g in got)
        elapsed_s = time.perf_counter() - started
        if num_hits != self.num_blocks:
            raise RuntimeError(f"{self.num_blocks - num_hits} misses: {self.store.stats()}")
        return elapsed_s


async def run_store(
    workdir: Path,
    block_nbytes: int,
    num_blocks: int,
    batch: int,  # noqa: PLR0913
    backends: list[str],
    rounds: int,
    result: BenchResult,
) -> None:
    nbytes = block_nbytes * num_blocks
    say(
        f"\n== store: {num_blocks} blocks x {block_nbytes} B = {nbytes / 1e6:.0f} MB, "
        f"batches of {batch}, median of {rounds} interleaved rounds =="
    )
    data = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    raw_path = workdir / f"raw-{block_nbytes}.bin"
    runs = {b: StoreRun(workdir, b, block_nbytes, num_blocks, batch) for b in backends}
    file_nbytes = num_blocks * runs[backends[0]].store.slot_nbytes
    times: dict[str, list[float]] = {}
    try:
        for round_index in range(rounds):
            say(
                f"  round {round_index + 1}/{rounds}: write + fsync, then per backend: drop "
                "cache, raw read of its slot file, drop cache, store read ..."
            )
            times.setdefault("raw write", []).append(raw_write(raw_path, data))
            for backend, run in runs.items():
                times.setdefault(f"{backend} write", []).append(await run.write(data))
            for backend, run in runs.items():
                drop_caches()
                slot_file = run.root / "bench" / "00000000.kvs"
                times.setdefault(f"{backend} raw read", []).append(raw_read(slot_file, file_nbytes))
                times.setdefault(f"{backend} read", []).append(await run.read())
    finally:
        for run in runs.values():
            run.store.close()
        raw_path.unlink(missing_ok=True)
    median = {name: statistics.median(values) for name, values in times.items()}
    size = f"{block_nbytes // 1024} KiB blocks"
    for backend in backends:
        write_s, read_s = median[f"{backend} write"], median[f"{backend} read"]
        result.ratio(
            f"store write + fsync, {backend}, {size}",
            gbps(nbytes, write_s),
            gbps(nbytes, median["raw write"]),
            "raw file write",
            "GB/s",
        )
        result.ratio(
            f"store read (payload), {backend}, {size}",
            gbps(nbytes, read_s),
            gbps(file_nbytes, median[f"{backend} raw read"]),
            "raw read of its slot file",
            "GB/s",
        )


def memcpy_s(src: np.ndarray, dst: np.ndarray, ranges: list[ByteRange], repeats: int) -> float:
    started = time.perf_counter()
    for _ in range(repeats):
        for r in ranges:
            dst[r.remote_offset : r.remote_offset + r.nbytes] = src[
                r.local_offset : r.local_offset + r.nbytes
            ]
    return time.perf_counter() - started


def scatter(block_nbytes: int, batch: int) -> list[ByteRange]:
    return [
        ByteRange(i * block_nbytes, (batch - 1 - i) * block_nbytes, block_nbytes)
        for i in range(batch)
    ]


def peer(role: str, env: dict[str, str], *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "loadtest.bench_kv", role, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )


async def run_transfer(
    url: str,
    block_nbytes: int,
    batch: int,
    repeats: int,
    tls_settings: tuple[str | None, ...],
    result: BenchResult,
) -> None:
    nbytes = block_nbytes * batch
    say(
        f"\n== NIXL UCX write between 2 processes: {batch} scattered blocks x {block_nbytes} B "
        f"= {nbytes / 1e6:.1f} MB per transfer, x{repeats}, memcpy interleaved =="
    )
    # UCX picks its transports from UCX_TLS at start-up. On one host its default moved RMA
    # over TCP here; tcp,cma (cross-memory attach: process_vm_writev) is the fast path.
    for tls in tls_settings:
        env = dict(os.environ)
        env.pop("UCX_TLS", None)
        if tls:
            env["UCX_TLS"] = tls
        root = f"bench{len(tls or '')}.kvf.v1"
        args = (url, root, str(block_nbytes), str(batch), str(repeats))
        # Both start at once (their imports overlap); the sender writes once told to.
        receiver = peer("--receiver", env, *args)
        sender = peer("--sender", env, *args)
        try:
            ready = await asyncio.to_thread(receiver.stdout.readline)  # type: ignore[union-attr]
            if ready.strip() != "ready":
                raise RuntimeError(f"receiver did not start: {ready!r}")
            sender.stdin.write("go\n")  # type: ignore[union-attr]
            sender.stdin.flush()  # type: ignore[union-attr]
            line = await asyncio.to_thread(sender.stdout.readline)  # type: ignore[union-attr]
            digest = await asyncio.to_thread(receiver.stdout.readline)  # type: ignore[union-attr]
            ucx_gbps, copy_gbps, sent_digest = line.split()
            what = f"{batch} x {block_nbytes // 1024} KiB, UCX_TLS={tls or '(default)'}"
            result.ratio(
                f"NIXL write between processes, {what}",
                float(ucx_gbps),
                float(copy_gbps),
                "memcpy in one process",
                "GB/s",
            )
            result.figure(
                f"bytes at the peer equal the sent bytes, {what}",
                float(digest.strip() == sent_digest),
                "bool",
                1.0,
            )
        finally:
            for proc in (sender, receiver):
                proc.stdin.close()  # type: ignore[union-attr]
                proc.wait(timeout=60)


async def sender_main(url: str, root: str, block_nbytes: int, batch: int, repeats: int) -> None:
    """Alternate one NIXL write of the batch to the peer and one in-process copy of the same
    blocks, so that both see the same machine load; print GB/s of each and a digest. Starts
    once a line on stdin says the receiver is up; gone without a word if stdin closes first
    (the receiver did not start)."""
    if (await asyncio.to_thread(sys.stdin.readline)).strip() != "go":
        return
    bus = await Bus.connect(url, service="prefill", root=root)
    src = np.random.default_rng(1).integers(0, 256, block_nbytes * batch, dtype=np.uint8)
    dst = np.zeros_like(src)
    agent = KvTransferAgent(bus, src, service="prefill")
    ranges = scatter(block_nbytes, batch)
    await agent.write(RECEIVER_SERVICE, "receiver", ranges, notification=b"warm")
    memcpy_s(src, dst, ranges, 1)  # warm-up: faults in dst
    ucx_s = copy_s = 0.0
    for i in range(repeats):
        started = time.perf_counter()
        await agent.write(RECEIVER_SERVICE, "receiver", ranges, notification=b"kv:%d" % i)
        ucx_s += time.perf_counter() - started
        copy_s += memcpy_s(src, dst, ranges, 1)
    await agent.write(RECEIVER_SERVICE, "receiver", ranges, notification=b"done")
    digest = format(xxhash.xxh3_64_intdigest(dst), "x")
    total = src.nbytes * repeats
    print(f"{gbps(total, ucx_s):.4f} {gbps(total, copy_s):.4f} {digest}", flush=True)
    agent.close()
    await bus.close()


async def receiver_main(url: str, root: str, block_nbytes: int, batch: int, repeats: int) -> None:
    bus = await Bus.connect(url, service=RECEIVER_SERVICE, root=root, instance_id="receiver")
    buffer = np.zeros(block_nbytes * batch, dtype=np.uint8)
    agent = KvTransferAgent(bus, buffer, service=RECEIVER_SERVICE)
    await agent.serve()
    await bus.flush()
    print("ready", flush=True)
    for i in range(repeats):
        await agent.wait_notification(b"kv:%d" % i, timeout_s=600)
    await agent.wait_notification(b"done", timeout_s=600)
    print(format(xxhash.xxh3_64_intdigest(buffer), "x"), flush=True)
    await asyncio.to_thread(sys.stdin.read)
    agent.close()
    await bus.stop_serving(1.0)
    await bus.close()


async def measure(args: argparse.Namespace, result: BenchResult) -> None:
    workdir = (
        Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="bench-kv-", dir="/var/tmp"))
    )
    workdir.mkdir(parents=True, exist_ok=True)
    result.note(f"workdir {workdir} (same filesystem for raw and store)")
    why_not = drop_caches()
    if why_not is None:
        result.note("page cache: dropped before every read (echo 1 > /proc/sys/vm/drop_caches)")
    else:
        result.note(f"page cache NOT dropped ({why_not}; needs root): reads may be from memory")
    try:
        for block_nbytes, num_blocks in (
            (SMALL_BLOCK_NBYTES, args.small_blocks),
            (BIG_BLOCK_NBYTES, args.big_blocks),
        ):
            await run_store(
                workdir,
                block_nbytes,
                num_blocks,
                args.batch,
                args.backends.split(","),
                args.rounds,
                result,
            )
    finally:
        subprocess.run(["rm", "-rf", str(workdir)], check=False)
    with tempfile.TemporaryDirectory() as nats_dir, NatsServer(Path(nats_dir)) as server:
        for block_nbytes, repeats in (
            (SMALL_BLOCK_NBYTES, args.small_repeats),
            (BIG_BLOCK_NBYTES, args.big_repeats),
        ):
            await run_transfer(
                server.url,
                block_nbytes,
                args.batch,
                repeats,
                TLS_SETTINGS[: args.tls_settings],
                result,
            )


def run(quick: bool = False, **options: object) -> BenchResult:
    """Options: the CLI's (small_blocks, big_blocks, batch, rounds, backends, dir). Quick: 200
    small and 20 big blocks, one round, few transfers, UCX_TLS=tcp,cma only."""
    defaults = {
        "dir": None,
        "small_blocks": 2000,
        "big_blocks": 100,
        "batch": 100,
        "rounds": 3,
        "backends": "nixl:POSIX,aiofiles",
        "small_repeats": 50,
        "big_repeats": 5,
        "tls_settings": len(TLS_SETTINGS),
    }
    if quick:  # transfers with UCX_TLS=tcp,cma only: each run starts two processes (~10 s)
        defaults |= {
            "small_blocks": 200,
            "big_blocks": 20,
            "batch": 20,
            "rounds": 1,
            "small_repeats": 5,
            "big_repeats": 2,
            "tls_settings": 1,
        }
    result = BenchResult("kv", quick)
    asyncio.run(measure(bench_options(defaults, options), result))
    return result.finish()


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--dir", help="where to write (default: a new dir under /var/tmp)")
    parser.add_argument("--small-blocks", type=int, default=2000)
    parser.add_argument("--big-blocks", type=int, default=100)
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--backends", default="nixl:POSIX,aiofiles")
    parser.add_argument("--quick", action="store_true", help="small sizes (CI)")
    args = vars(parser.parse_args())
    quick = args.pop("quick")
    run(quick, **({"dir": args["dir"]} if quick else args)).print()


if __name__ == "__main__":
    if sys.argv[1:2] in (["--receiver"], ["--sender"]):
        role = receiver_main if sys.argv[1] == "--receiver" else sender_main
        url_arg, root_arg, *numbers = sys.argv[2:]
        asyncio.run(role(url_arg, root_arg, *map(int, numbers)))
        sys.exit(0)
    main()
