"""The router's CPU time per request for agent-sized prompts, measured on its own process.

    python -m loadtest.bench_router [--tokens 77000] [--requests 100] [--memcaches 150]
                                    [--before REV] [--rounds 2]

Runs a real router process (`python -m services.router`) against fakes in this process that
answer at once: one kv-index shard (a 96% hit, with the locations of every hit block), 8
prefill workers, one decode worker and `--memcaches` swa-memcache instances heartbeating on
their own nodes (the reference deployment has ~150 prefill nodes, each with a memcache; they
answer `contains` for a router that still asks). Each request is a fresh 77K-token prompt
(1,203 blocks of 64) with the block hashes its caller computed. The router's CPU time
(utime + stime from /proc, its idle rate -- heartbeats -- subtracted) divided by the
requests is its cost per request.

`--before REV` runs the router of another revision of this repository too (a temporary git
worktree; the wire protocol is the same), alternating with this one for `--rounds` rounds on
the same fakes, and prints the ratio. Also printed, in this process: the block-hash check
alone, a rehash of the whole prompt against `RequestBlocks.check`; and the decision time
(`decision_times`): in this process, from a match's reply to the job sent -- the request's
facts with every candidate's own hit, `RoutePolicy.choose`, the in-flight accounting and the
encoded PrefillJob -- p50 and p99 for a 100K-token prompt over 8 and 1,200 prefill candidates
(`--decisions-only` runs just that).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import numpy as np

from services.router.policy import PolicyConfig, RequestFacts, RoutePolicy
from shared.block_hashing import BlockHasher
from shared.blocks import RequestBlocks
from shared.bus import Bus, Context, Endpoint
from shared.client import build_request
from shared.kv_index_client import to_wire
from shared.load_table import LoadTable
from shared.natsd import NatsServer
from shared.schema import (
    BlockLocations,
    DecodeJob,
    GenerateRequest,
    JobAccepted,
    LoadReport,
    PrefillDone,
    PrefillJob,
    RouteDecision,
    SwaContains,
    SwaContainsReply,
    unpack_block_hashes,
)
from shared.schema.kv_index import MatchReply, MatchRequest
from shared.subjects import DECODE, PREFILL, SWA_MEMCACHE
from shared.testing import unique_root

REPO = Path(__file__).resolve().parents[1]
BLOCK = 64
MODEL = "tiny-coder"
HIT = 0.96
CLOCK_TICK_S = 1 / os.sysconf("SC_CLK_TCK")


class Fakes:
    """Everything the router talks to, answering at once; counts `contains` questions."""

    def __init__(self, url: str, root: str, num_memcaches: int) -> None:
        self.url, self.root, self.num_memcaches = url, root, num_memcaches
        self.buses: list[Bus] = []
        self.beats: list[asyncio.Task[None]] = []
        self.num_contains = 0

    async def start(self) -> None:
        index = await self._bus("kv-index", "kv-index-0")
        await index.serve(
            Endpoint("match", index.subjects.kv_index_match_shard(0), MatchRequest, self._match)
        )
        decode = await self._bus(DECODE, "decode-0")
        await decode.serve(Endpoint("run", decode.subjects.decode_run, DecodeJob, self._accept))
        self._beat(decode, DECODE, "node-d", num_kv_pages_total=10**6, num_kv_pages_free=10**6)
        for i in range(8):
            prefill = await self._bus(PREFILL, f"prefill-{i}")
            run = Endpoint("run", prefill.subjects.prefill_run, PrefillJob, self._prefill)
            await prefill.serve(run)
            self._beat(prefill, PREFILL, f"node-{i}")
        for i in range(self.num_memcaches):
            memcache = await self._bus(SWA_MEMCACHE, f"swa-memcache-node-{i}")
            contains = Endpoint(
                "contains", memcache.subjects.swa_contains, SwaContains, self._contains
            )
            await memcache.serve(contains)
            self._beat(memcache, SWA_MEMCACHE, f"node-{i}")
        for bus in self.buses:
            await bus.flush()

    async def stop(self) -> None:
        for task in self.beats:
            task.cancel()
        await asyncio.gather(*self.beats, return_exceptions=True)
        for bus in self.buses:
            await bus.stop_serving(0.5)
            await bus.close()

    async def _bus(self, service: str, instance_id: str) -> Bus:
        bus = await Bus.connect(self.url, service=service, instance_id=instance_id, root=self.root)
        self.buses.append(bus)
        return bus

    def _beat(self, bus: Bus, service: str, node_id: str, **load: int) -> None:
        async def beat() -> None:
            seq = 0
            while True:
                seq += 1
                report = LoadReport(
                    service=service,
                    instance_id=bus.instance_id,
                    seq=seq,
                    ts_ms=0,
                    node_id=node_id,
                    **load,
                )
                await bus.publish(bus.subjects.load(service, bus.instance_id), report)
                await asyncio.sleep(1.0)

        self.beats.append(asyncio.create_task(beat()))

    async def _match(self, request: MatchRequest, ctx: Context) -> MatchReply:
        hashes = unpack_block_hashes(request.block_hashes)
        num_hit = int(len(hashes) * HIT)
        zeros = np.zeros(num_hit, np.uint32)
        columns = {
            "block_hash": hashes[:num_hit],
            "writer": np.zeros(num_hit, np.uint16),
            "file_id": zeros,
            "slot": np.arange(num_hit, dtype=np.uint32),
            "generation": zeros + 1,
            "num_bytes": zeros + 98_304,
        }
        locations = BlockLocations.from_columns("ssd", ("prefill-0",), columns)
        tier = to_wire("ssd", num_hit, list(range(num_hit)), locations)
        return MatchReply(shard_id=0, num_shards=1, tiers=(tier,))

    async def _accept(self, job: DecodeJob, ctx: Context) -> JobAccepted:
        return JobAccepted(request_id=job.request.request_id, instance_id="decode-0")

    async def _prefill(self, job: PrefillJob, ctx: Context) -> PrefillDone:
        return PrefillDone(request_id=job.request.request_id)

    async def _contains(self, request: SwaContains, ctx: Context) -> SwaContainsReply:
        self.num_contains += 1
        return SwaContainsReply(found=b"\x00")


def routable(request: GenerateRequest, inbox: str) -> GenerateRequest:
    """The router forwards the caller's inbox to decode (the fake one streams nothing)."""
    return msgspec.structs.replace(request, stream_inbox=inbox)


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * CLOCK_TICK_S  # utime, stime


async def measure(
    tree: Path, url: str, root: str, fakes: Fakes, client: Bus, prompts: list[list[int]]
) -> tuple[float, float, int]:
    """(router CPU ms per request, wall ms per request, contains asked per request)."""
    router = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.router",
            "--nats-url",
            url,
            "--root",
            root,
            "--instance-id",
            "router-bench",
            "--ttft-objective-s",
            "0",
            "--max-queued-tokens",
            str(10**12),
            "--heartbeat-timeout-s",
            "30",
            "--log-level",
            "warning",
        ],
        cwd=tree,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    inbox = await client.open_inbox()
    try:
        probe = build_request(prompts[0][:128], model=MODEL, block_size_tokens=BLOCK)
        probe = routable(probe, inbox.subject)
        for _ in range(200):  # until it serves and knows the workers
            try:
                await client.request(
                    client.subjects.router_generate, probe, RouteDecision, timeout_s=2.0
                )
                break
            except Exception:  # noqa: BLE001 - not up yet: no responders, unavailable
                await asyncio.sleep(0.1)
        # Hashed by the caller (here), before the router's clock starts.
        requests = [
            routable(build_request(p, model=MODEL, block_size_tokens=BLOCK), inbox.subject)
            for p in prompts
        ]
        await asyncio.sleep(1.0)
        idle_started, idle_cpu = time.monotonic(), cpu_s(router.pid)
        await asyncio.sleep(2.0)
        idle_rate = (cpu_s(router.pid) - idle_cpu) / (time.monotonic() - idle_started)
        contains_before = fakes.num_contains
        started, cpu_before = time.monotonic(), cpu_s(router.pid)
        for request in requests:
            await client.request(
                client.subjects.router_generate, request, RouteDecision, timeout_s=30.0
            )
        wall_s = time.monotonic() - started
        used_s = cpu_s(router.pid) - cpu_before - idle_rate * wall_s
        num = len(requests)
        return (
            used_s / num * 1000,
            wall_s / num * 1000,
            (fakes.num_contains - contains_before) // num,
        )
    finally:
        await inbox.close()
        router.terminate()
        router.wait(timeout=30)


def check_costs(prompt: list[int]) -> tuple[float, float]:
    """(ms to rehash the whole prompt and compare, ms for RequestBlocks.check)."""
    request = build_request(prompt, model=MODEL, block_size_tokens=BLOCK)
    hasher = BlockHasher(MODEL, block_size_tokens=BLOCK)
    rounds = 20
    started = time.process_time()
    expected = unpack_block_hashes(request.block_hashes).tolist()
    for _ in range(rounds):
        if hasher.hashes(request.prompt_token_ids) != expected:
            raise AssertionError("the caller's hashes differ from a rehash")
    rehash_ms = (time.process_time() - started) / rounds * 1000
    started = time.process_time()
    for _ in range(rounds * 50):
        RequestBlocks.of_request(request).check(request.prompt_token_ids)
    check_ms = (time.process_time() - started) / (rounds * 50) * 1000
    return rehash_ms, check_ms


def decision_times(
    num_candidates: int,
    num_holders: int = 8,
    num_tokens: int = 100_000,
    num_decisions: int = 400,
) -> tuple[float, float]:
    """(p50, p99) ms of one decision over `num_candidates` prefill workers, `num_holders` of
    them holding some of the prompt in their own memory (a session's workers), the store a
    96% hit."""
    rng = np.random.default_rng(2)
    table = LoadTable("bench-router", heartbeat_timeout_s=3600.0)
    beats = [
        LoadReport(
            service=PREFILL,
            instance_id=f"prefill-{i}",
            node_id=f"node-{i // 8}",
            num_queued_tokens=int(rng.integers(0, 200_000)),
            seq=1,
            ts_ms=0,
            model=MODEL,
        )
        for i in range(num_candidates)
    ]
    no_limit = 1 << 40  # decode pages: every decision fits
    beats += [
        LoadReport(
            service=DECODE,
            instance_id=f"decode-{i}",
            num_kv_pages_total=no_limit,
            num_kv_pages_free=no_limit,
            seq=1,
            ts_ms=0,
            model=MODEL,
        )
        for i in range(max(num_candidates // 8, 1))
    ]
    for beat in beats:
        table.observe(beat, 0.0)
    policy = RoutePolicy(
        config=PolicyConfig(
            ttft_objective_s=None, max_queued_tokens=1 << 40, store_read_bytes_per_s=10 * 2**40
        )
    )
    prompt = rng.integers(3, 32_000, num_tokens).tolist()
    request = build_request(prompt, model=MODEL, block_size_tokens=BLOCK)
    blocks = RequestBlocks.of_request(request)
    num_hit = int(0.96 * len(blocks.hashes))
    holders = rng.choice(num_candidates, min(num_holders, num_candidates), replace=False)
    local = {f"prefill-{i}": int(rng.integers(1, num_hit)) for i in holders}
    encoder = msgspec.msgpack.Encoder()
    times = []
    for k in range(num_decisions):
        now_s = k * 1e-3
        started = time.perf_counter()
        facts = RequestFacts.of(request, blocks, num_hit, local)
        decision = policy.choose(facts, table, (), now_s)
        if not isinstance(decision, RouteDecision):
            raise AssertionError(f"refused: {decision}")
        for delta in policy.inflight_deltas("bench-router", decision, facts):
            table.record_sent(delta, now_s)
        encoder.encode(PrefillJob(request=request, decision=decision))
        times.append(time.perf_counter() - started)
    times.sort()
    return times[len(times) // 2] * 1e3, times[int(0.99 * len(times))] * 1e3


async def run(args: argparse.Namespace) -> None:
    for candidates, holders in ((8, 8), (1200, 8), (1200, 1200)):
        p50, p99 = decision_times(candidates, holders)
        target = f" (target p99 <= 1 ms: {'met' if p99 <= 1.0 else 'NOT met'})"
        print(
            f"decision, 100K-token prompt, {candidates:,} prefill candidates, {holders:,} "
            f"holding some of it: p50 {p50:.3f} ms, p99 {p99:.3f} ms"
            + (target if holders < candidates or candidates == 8 else " (every one scored)")
        )
    if args.decisions_only:
        return
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 32_000, args.tokens).tolist() for _ in range(args.requests)]
    rehash_ms, check_ms = check_costs(prompts[0])
    print(
        f"{args.tokens}-token prompt, {args.tokens // BLOCK} blocks: rehash check "
        f"{rehash_ms:.2f} ms, RequestBlocks.check {check_ms:.3f} ms "
        f"({rehash_ms / check_ms:.0f}x less)"
    )
    trees = {"this tree": REPO}
    worktree = None
    if args.before:
        worktree = Path(tempfile.mkdtemp(prefix="kvf-before-"))
        subprocess.run(
            ["git", "-C", str(REPO), "worktree", "add", "--detach", str(worktree), args.before],
            check=True,
            capture_output=True,
        )
        trees = {f"before ({args.before})": worktree, "this tree": REPO}
    with NatsServer(Path(tempfile.mkdtemp(prefix="kvf-bench-nats-"))) as server:
        root = unique_root()
        fakes = Fakes(server.url, root, args.memcaches)
        await fakes.start()
        client = await Bus.connect(server.url, service="ingress", root=root)
        results: dict[str, list[tuple[float, float, int]]] = {name: [] for name in trees}
        try:
            for round_ in range(args.rounds):
                for name, tree in trees.items():
                    result = await measure(tree, server.url, root, fakes, client, prompts)
                    results[name].append(result)
                    print(
                        f"round {round_ + 1} {name}: router CPU {result[0]:.2f} ms/request, "
                        f"wall {result[1]:.2f} ms/request, contains asked {result[2]}"
                    )
        finally:
            await client.close()
            await fakes.stop()
            if worktree is not None:
                subprocess.run(
                    ["git", "-C", str(REPO), "worktree", "remove", "--force", str(worktree)],
                    check=False,
                    capture_output=True,
                )
    best = {name: min(r[0] for r in runs) for name, runs in results.items()}
    for name, cpu_ms in best.items():
        print(f"{name}: router CPU {cpu_ms:.2f} ms per {args.tokens}-token request (best round)")
    if len(best) == 2:
        before, after = best.values()
        print(f"router CPU per request, before / after: {before / after:.1f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=77_000)
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--memcaches", type=int, default=150)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--before", default="", help="git revision to compare with")
    parser.add_argument(
        "--decisions-only", action="store_true", help="only the in-process decision times"
    )
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
