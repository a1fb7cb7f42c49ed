"""What each fault costs a supervised cluster under agent load, and how fast the control plane
comes back.

    kvfabric bench faults [--quick] [--set kv-index-blocks=2300000]

A mock cluster on this machine (`kvfabric up`'s launcher with its supervisor; three NATS
servers in a JetStream cluster, R3; two ingresses, routers, prefill and decode workers)
serves agents through the official SDKs (loadtest/fault_load.py) while each fault is made in
turn. Per fault: the requests sent and failed (every failure is a retryable protocol error,
or the suite would say otherwise: tests/faults), the time from the fault until every instance
serves again and both ingresses answer, and the usage lost (answered requests the ledger does
not hold, or holds twice; must be 0). Beside them, each killed router's and ingress's time
from SIGKILL to serving again (target 3 s) and kv-index's restart at `kv_index_blocks`
indexed blocks (target 5 s at 2.3M; Dynamo's router needed 45-50 s to replay 2.27M events
after a rollout, as its authors report), against replaying its whole event log without a
snapshot in the same run.

Then the resume gap (loadtest/failover_gap.py): a decode worker killed mid-stream, the time
until its client's next token, against the same failover recomputing the context; tiny-coder
at 448 tokens and (not quick) SmolLM2 at its 8K context.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from loadtest.failover_gap import run_failover_gap
from loadtest.fault_load import (
    AgentLoad,
    billing,
    outside_protocol,
    time_to_full_service,
)
from loadtest.results import BenchResult
from services.admin.launcher import Cluster, ClusterSpec
from services.admin.supervisor import NATS_SERVER, RestartPolicy
from shared.bus import Bus
from shared.discovery import discover
from shared.natsd import NatsServer
from shared.schema import BlocksStored, InstanceState, KvEventBatch, StoredBlock
from shared.schema.kv_index import CacheCommand, CacheStats
from shared.subjects import DECODE, INGRESS, PREFILL, ROUTER
from shared.testing.fixtures import SESSION_STORE_BYTES, unique_root

KEY = "kvf-bench-faults-key"
MOCK = ["--engine", "mock", "--mock-speedup", "20"]
RECOVERY_BOUND_S = 60.0
CONTROL_PLANE_TARGET_S = 3.0
KV_INDEX_TARGET_S = 5.0
REFERENCE_BLOCKS = 2_300_000
BLOCKS_PER_EVENT = 1_000
TAIL_SHARE = 0.05  # of the blocks, stored after the last snapshot (the log's tail to replay)

KILLS = ("kv-index-0", "swa-memcache-0", "billing-0", "router-0", "ingress-1", "prefill-0")
KILLS += ("decode-1",)
QUICK_KILLS = ("billing-0", "router-0", "ingress-1", "decode-1")


def start_cluster(state_dir: Path) -> Cluster:
    spec = ClusterSpec(
        state_dir=state_dir,
        nats_port=0,
        http_port=0,
        root=unique_root(),
        replicas={INGRESS: 2, ROUTER: 2, PREFILL: 2, DECODE: 2},
        extra_args={PREFILL: MOCK, DECODE: MOCK, INGRESS: ["--dev-api-key", KEY]},
        shutdown_grace_s=3.0,
        restart_policy=RestartPolicy(budget=10, window_s=120.0),
        nats_cluster=3,
    )
    cluster = Cluster(spec)
    cluster.start()

    async def ready() -> None:
        bus = await Bus.connect(
            cluster.nats_url, service="bench", root=spec.root, creds=cluster.nats_creds
        )
        try:
            await cluster.wait_ready(bus, timeout_s=120)
        finally:
            await bus.close()

    try:
        asyncio.run(ready())
    except BaseException:
        cluster.stop()
        raise
    cluster.supervise_in_background()
    return cluster


def time_until_serving(cluster: Cluster, instance_id: str, since: float) -> float | None:
    """Seconds from `since` until discovery finds a process of `instance_id` started after
    `since` SERVING; None past RECOVERY_BOUND_S. One connection for the whole wait, and each
    round ends once its replies pause (a round's full window would add up to 0.3 s to the
    figure, and a connection per round more)."""
    return asyncio.run(_until_serving(cluster, instance_id, since))


async def _until_serving(cluster: Cluster, instance_id: str, since: float) -> float | None:
    service = cluster.child(instance_id).service
    bus: Bus | None = None
    try:
        while time.monotonic() < since + RECOVERY_BOUND_S:
            try:
                if bus is None:
                    bus = await Bus.connect(
                        cluster.nats_url,
                        service="faults",
                        root=cluster.spec.root,
                        creds=cluster.nats_creds,
                    )
                found = await discover(bus, service=service, timeout_s=0.3, stall_s=0.05)
            except Exception:  # NATS may be coming back
                found = []
            serving = any(
                i.instance_id == instance_id and i.load.get("state") == InstanceState.SERVING
                for i in found
            )
            if serving and cluster.child(instance_id).started_at > since:
                return time.monotonic() - since
            await asyncio.sleep(0.05)
        return None
    finally:
        if bus is not None:
            await bus.close()


def measure_fault(
    result: BenchResult,
    cluster: Cluster,
    name: str,
    inject: Callable[[], None],
    *,
    killed: str = "",
    refused_at: str = "",
) -> None:
    """Load before, during and after the fault; its figures. `killed`: the instance the
    fault kills, timed back to serving (from the kill, and from its restart)."""
    load = AgentLoad(cluster.http_urls, KEY).start()
    try:
        started = time.monotonic()
        while load.num_ok_since(started) < 4 and time.monotonic() - started < 60:
            time.sleep(0.05)
        fault_at = time.monotonic()
        inject()
        if killed:
            back_s = time_until_serving(cluster, killed, fault_at)
            if back_s is not None:
                restart_s = back_s - (cluster.child(killed).started_at - fault_at)
                result.figure(
                    f"{killed}: SIGKILL to serving again", back_s, "s", lower_is_better=True
                )
                result.figure(
                    f"{killed}: restarted process to serving",
                    restart_s,
                    "s",
                    CONTROL_PLANE_TARGET_S,
                    lower_is_better=True,
                )
        recovered_s = time_to_full_service(cluster, load, fault_at, RECOVERY_BOUND_S)
        after = time.monotonic()
        while load.num_ok_since(after) < 8 and time.monotonic() - after < 30:
            time.sleep(0.05)
    finally:
        outcomes = load.stop()
    failed = [o for o in outcomes if not o.ok]
    bad = outside_protocol(outcomes, refused_at)
    billed = billing(cluster, outcomes)
    lost = len(billed.missing) + sum(n - 1 for n in billed.doubled.values())
    result.figure(f"{name}: requests failed (of {len(outcomes)})", len(failed), "requests")
    if failed:
        in_flight = sum(o.started < fault_at for o in failed)
        result.note(f"{name}: {in_flight} of the {len(failed)} failed were in flight at the fault")
    if recovered_s is None:
        result.note(f"{name}: not back to full service within {RECOVERY_BOUND_S:.0f} s")
    else:
        result.figure(
            f"{name}: time to full service",
            recovered_s,
            "s",
            RECOVERY_BOUND_S / 2,
            lower_is_better=True,
        )
    result.figure(f"{name}: usage lost", lost, "records", 0, lower_is_better=True)
    if bad:
        result.note(f"{name}: {len(bad)} failures outside the protocol, e.g. {bad[0].error}")
    print(
        f"  ... {name}: {len(failed)}/{len(outcomes)} failed, full service after "
        f"{recovered_s if recovered_s is None else round(recovered_s, 1)} s, {lost} lost",
        flush=True,
    )


def kill_instance(cluster: Cluster, instance_id: str) -> Callable[[], None]:
    return lambda: os.kill(cluster.child(instance_id).process.pid, signal.SIGKILL)


def run_cluster_faults(result: BenchResult, quick: bool) -> None:
    with tempfile.TemporaryDirectory(prefix="kvf-bench-faults-") as tmp:
        cluster = start_cluster(Path(tmp))
        try:
            for instance_id in QUICK_KILLS if quick else KILLS:
                control_plane = instance_id.startswith(("router", "ingress"))
                refused_at = ""
                if instance_id.startswith("ingress"):
                    port = cluster.pinned_ports[instance_id]["http"]
                    refused_at = next(u for u in cluster.http_urls if u.endswith(f":{port}"))
                measure_fault(
                    result,
                    cluster,
                    f"kill -9 {instance_id}",
                    kill_instance(cluster, instance_id),
                    killed=instance_id if control_plane else "",
                    refused_at=refused_at,
                )
            assert cluster.nats_cluster is not None
            servers = cluster.nats_cluster.servers
            measure_fault(
                result, cluster, "one NATS server of three killed", lambda: servers[1].kill()
            )
            if not quick:

                def kill_all() -> None:
                    for server in servers:
                        if server.pid is not None:
                            os.kill(server.pid, signal.SIGKILL)

                measure_fault(result, cluster, "all three NATS servers killed", kill_all)
            restarts = {
                r.instance_id: r.restarts
                for r in cluster.supervisor.records.values()
                if r.restarts and not r.instance_id.startswith(NATS_SERVER)
            }
            result.note(f"restarts by the supervisor: {restarts}")
        finally:
            cluster.stop()


# -- kv-index: restart at the reference size ---------------------------------------------
def _block_hashes(count: int) -> np.ndarray:
    """Block hashes as the hasher makes them: uniform over all 64 bits (XXH3-64). The
    index's slots take a hash's high bits as its home, so small or 63-bit keys would
    crowd half of them and measure a pathology, not the index."""
    return np.random.default_rng(37).integers(1, 2**64, count, dtype=np.uint64)


async def _publish_blocks(bus: Bus, hashes: np.ndarray, first: int, count: int, seq: int) -> int:
    """Blocks first..first+count of one chain, in events of BLOCKS_PER_EVENT; the next seq."""
    subject = bus.subjects.kv_events("bench-writer")
    for start in range(first, first + count, BLOCKS_PER_EVENT):
        n = min(BLOCKS_PER_EVENT, first + count - start)
        chunk = hashes[start : start + n].tolist()
        blocks = tuple(StoredBlock(h, 0, start + i, 1, 98_304) for i, h in enumerate(chunk))
        parent = int(hashes[start - 1]) if start else None
        event = BlocksStored(tier="ssd", blocks=blocks, parent_block_hash=parent)
        seq += 1
        batch = KvEventBatch(writer_id="bench-writer", seq=seq, ts_ms=0, events=(event,))
        await bus.js.publish(subject, batch, msg_id=f"bench-{seq}")
    return seq


async def _num_indexed(bus: Bus) -> int | None:
    try:
        stats = await bus.request(
            bus.subjects.kv_index_admin(0), CacheCommand(action="stats"), CacheStats, timeout_s=2
        )
    except Exception:
        return None
    return stats.tiers.get("ssd", {}).get("num_blocks", 0)


async def _until_indexed(bus: Bus, count: int, since: float, timeout_s: float) -> float | None:
    while time.monotonic() < since + timeout_s:
        if await _num_indexed(bus) == count:
            return time.monotonic() - since
        await asyncio.sleep(0.02)
    return None


def _start_kv_index(
    nats: NatsServer, root: str, log: Path, interval_s: float, *extra: str
) -> subprocess.Popen:
    args = [sys.executable, "-m", "services.kv_index", "--nats-url", nats.url, "--root", root]
    args += ["--instance-id", "kv-index-0", "--snapshot-interval-s", str(interval_s), *extra]
    args += ["--capacity", f"ssd={1 << 50}", "--log-level", "info"]
    with log.open("ab") as out:
        return subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)


def kv_index_restart(result: BenchResult, num_blocks: int) -> None:
    """Index `num_blocks` (a snapshot covers all but the last TAIL_SHARE), SIGKILL kv-index,
    start it again: the time until it answers with every block (an uncut log this size is
    replayed whole). Then the same restart made to load the snapshot and replay the tail."""
    with tempfile.TemporaryDirectory(prefix="kvf-bench-kv-index-") as tmp:
        nats = NatsServer(Path(tmp) / "nats", max_file_store_bytes=SESSION_STORE_BYTES).start()
        root, log = unique_root(), Path(tmp) / "kv_index.out"
        processes = [_start_kv_index(nats, root, log, interval_s=5.0)]
        try:
            asyncio.run(_kv_index_restart(result, nats, root, log, processes, num_blocks))
        finally:
            for process in processes:
                if process.poll() is None:
                    process.kill()
                    process.wait()
            nats.stop()


async def _kv_index_restart(
    result: BenchResult,
    nats: NatsServer,
    root: str,
    log: Path,
    processes: list[subprocess.Popen],
    num_blocks: int,
) -> None:
    """Runs and restarts kv-index (each process it starts is added to `processes`)."""
    bus = await Bus.connect(nats.url, service="bench", root=root)
    try:
        assert await _until_indexed(bus, 0, time.monotonic(), 60) is not None, "no kv-index"
        tail = int(num_blocks * TAIL_SHARE)
        hashes = _block_hashes(num_blocks)
        started = time.monotonic()
        seq = await _publish_blocks(bus, hashes, 0, num_blocks - tail, 0)
        await _until_indexed(bus, num_blocks - tail, started, 600)
        # The next periodic snapshot (every 5 s) then covers these; wait for it.
        snapshots = log.read_text().count("snapshot saved")
        while log.read_text().count("snapshot saved") == snapshots:
            await asyncio.sleep(0.1)
        seq = await _publish_blocks(bus, hashes, num_blocks - tail, tail, seq)
        await _until_indexed(bus, num_blocks, started, 600)
        print(f"  ... kv-index holds {num_blocks:,} blocks; SIGKILL and restart", flush=True)

        processes[-1].kill()
        processes[-1].wait()
        killed_at = time.monotonic()
        processes.append(_start_kv_index(nats, root, log, 3600.0))
        restart_s = await _until_indexed(bus, num_blocks, killed_at, 300)

        processes[-1].kill()
        processes[-1].wait()
        killed_at = time.monotonic()
        processes.append(_start_kv_index(nats, root, log, 3600.0, "--replay-whole-log-bytes", "0"))
        snapshot_s = await _until_indexed(bus, num_blocks, killed_at, 600)
    finally:
        await bus.close()
    if restart_s is None or snapshot_s is None:
        result.note("kv-index did not come back with every block within the bound")
        return
    target = KV_INDEX_TARGET_S if num_blocks >= REFERENCE_BLOCKS else None
    result.ratio(
        f"kv-index SIGKILL to answering with all {num_blocks:,} blocks: as it restarts "
        f"(the uncut log replayed whole) against its snapshot + {TAIL_SHARE:.0%} log tail",
        restart_s,
        snapshot_s,
        "snapshot + tail",
        "s",
        lower_is_better=True,
    )
    result.figure(
        f"kv-index restart at {num_blocks:,} blocks (SIGKILL to answering)",
        restart_s,
        "s",
        target,
        lower_is_better=True,
    )


def run(quick: bool = False, kv_index_blocks: int = 0) -> BenchResult:
    result = BenchResult("faults", quick)
    run_cluster_faults(result, quick)
    kv_index_restart(result, kv_index_blocks or (100_000 if quick else REFERENCE_BLOCKS))
    run_failover_gap(result, quick)
    return result.finish()
