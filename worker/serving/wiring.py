"""The wiring prefill's and decode's main.py share, for either engine: what a worker writes
KV through, and the worker's place in the service's lifecycle.

A worker's KV goes through the store (its blocks, logged for kv-index), one NIXL buffer
(its head for large swa-memcache puts, the rest staging the handoff between prefill and
decode) and swa-memcache, whether its model is the checkpoint's or the mock's simulated one
(`--engine mock`: the one difference, made in `start_model_thread`). The worker's loop
starts before its endpoints are served, its load goes into the heartbeats and, with its
store's figures, into the process's metrics (serving/metrics.py), and at shutdown it stops
before what it used is closed (STYLE.md: shutdown).
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from shared.bus import Bus
from shared.config import EngineWorkerConfig
from shared.discovery import discover
from shared.logging import get_logger
from shared.runtime import ServiceRuntime
from shared.schema.kv_index import HOLD_DEVICE, HOLD_HOST
from shared.subjects import SWA_MEMCACHE
from worker.engine.host_tier import HostTier
from worker.kvstore.backends import alloc_staging
from worker.kvstore.store import KvStore
from worker.kvstore.writer import KvEventPublisher
from worker.serving.holdings import Holdings, HoldingsPublisher
from worker.serving.kv_io import open_store
from worker.serving.metrics import observe_host_tier, observe_load, observe_store
from worker.serving.staging import StagingSpace
from worker.swa_client import SwaClient
from worker.transfer import KvTransferAgent

if TYPE_CHECKING:  # torch: the model workers' only
    from worker.engine.runner import ModelRunner
    from worker.engine.worker import ModelThread

log = get_logger(__name__)

SWA_STAGING_BYTES = 4 << 20  # the head of the NIXL buffer: large snapshot puts
MEMCACHE_LOOKUP_S = 1.0  # a worker that started before its node's memcache looks again


class ServedWorker(Protocol):
    """What the lifecycle needs of a prefill or decode worker."""

    def start(self) -> None: ...

    async def stop(self) -> None: ...

    def load_fields(self) -> dict[str, int | str]: ...


@dataclass(frozen=True)
class ModelKv:
    """A worker's ways out for KV."""

    store: KvStore
    publisher: KvEventPublisher  # BlocksStored / BlocksRemoved for kv-index
    agent: KvTransferAgent  # its `buffer`: SWA_STAGING_BYTES, then the handoff staging
    swa: SwaClient | None  # None: the model has no sliding layers
    staging: StagingSpace  # the handoff's part of the buffer


async def open_model_kv(
    runtime: ServiceRuntime,
    config: EngineWorkerConfig,
    service: str,
    block_nbytes: int,
    *,
    has_windows: bool,
    staging_nbytes: int,
) -> ModelKv:
    """The store (`block_nbytes` per block) and its log, then the NIXL buffer (its handoff
    part `staging_nbytes`) registered and served as `service`'s, and the node's
    swa-memcache."""
    bus = runtime.bus
    store = await open_store(config, bus.instance_id, block_nbytes)
    publisher = KvEventPublisher(bus, store)
    await publisher.start()
    # Every page touched now: a pull or a staging copy into a page never used before pays
    # its fault on the request's path (NIXL reads of 12 MB into fresh pages took 2.4-69 ms
    # here, into touched ones 1.1-1.5 ms).
    buffer = alloc_staging(staging_nbytes + SWA_STAGING_BYTES)
    agent = await asyncio.to_thread(KvTransferAgent, bus, buffer, service=service)
    await agent.serve()
    # A model without sliding layers has no windows: no swa-memcache to talk to.
    swa = None
    if has_windows:
        swa = await node_swa_client(
            runtime, config, agent, staging_offset=0, staging_nbytes=SWA_STAGING_BYTES
        )
    staging = StagingSpace(SWA_STAGING_BYTES, staging_nbytes)
    return ModelKv(store, publisher, agent, swa, staging)


async def node_swa_client(
    runtime: ServiceRuntime,
    config: EngineWorkerConfig,
    agent: KvTransferAgent | None,
    **staging: int,
) -> SwaClient:
    """A client of this node's swa-memcache: snapshots are node-local (docs/design.md,
    'Sliding-window state'), and the router sends an agent's next step to the node whose
    memcache holds its window.
    Workers and memcaches start together, so one that is not there yet is looked for again
    every `MEMCACHE_LOOKUP_S` (off the request path); until then any instance serves.
    Discovery metadata names it (`swa_memcache`) once found."""
    bus = runtime.bus
    swa = SwaClient(
        bus, agent, memcache_instance_id=await node_memcache(bus, config.node_id), **staging
    )
    if swa.memcache_instance_id is not None:
        runtime.metadata["swa_memcache"] = swa.memcache_instance_id
    else:
        log.warning(
            "no swa-memcache on this node yet: snapshots go to any instance", node_id=config.node_id
        )

        async def look_again() -> None:
            if swa.memcache_instance_id is None:
                swa.memcache_instance_id = await node_memcache(bus, config.node_id)
                if swa.memcache_instance_id is not None:
                    runtime.metadata["swa_memcache"] = swa.memcache_instance_id
                    log.info(
                        "this node's swa-memcache found",
                        node_id=config.node_id,
                        instance_id=swa.memcache_instance_id,
                    )

        runtime.every(MEMCACHE_LOOKUP_S, look_again)
    return swa


async def node_memcache(bus: Bus, node_id: str) -> str | None:
    """The swa-memcache instance on `node_id` (the first by id), or None."""
    local = sorted(
        i.instance_id
        for i in await discover(bus, service=SWA_MEMCACHE, timeout_s=0.5)
        if i.metadata.get("node_id") == node_id
    )
    return local[0] if local else None


def start_worker(
    runtime: ServiceRuntime,
    worker: ServedWorker,
    store: KvStore,
    *closers: Callable[[], None],
    host_tier: HostTier | None = None,
) -> None:
    """Start the worker's loop and report its load, its store's and its host tier's figures;
    at shutdown stop it (its in-flight work ends), then close what it used: `closers`, then
    the store."""
    worker.start()
    runtime.load_fields = worker.load_fields

    def in_flight() -> int:  # what a drain waits for: jobs queued and running
        fields = worker.load_fields()
        return int(fields.get("num_queued", 0)) + int(fields.get("num_running", 0))

    runtime.in_flight = in_flight
    observe_load(runtime.metrics, worker.load_fields)
    observe_store(runtime.metrics, store)
    if host_tier is not None:
        observe_host_tier(runtime.metrics, host_tier)

    async def close() -> None:
        await worker.stop()
        for closer in closers:
            closer()
        store.close()

    runtime.on_stop(close)


# libgomp's spin before an idle OpenMP thread sleeps (its default: 300,000 pauses, ~10-20 ms).
OPENMP_SPIN_COUNT = "10000"


def limit_openmp_spin() -> None:
    """Before torch loads (libgomp reads its environment once): idle OpenMP threads spin
    briefly, then sleep. Prefill and decode share a host's cores, and a worker's threads
    spinning for libgomp's default ~10-20 ms after each op took the CPU from the other
    worker's compute: at concurrency 4 the peers benchmark served 0.19 requests/s, against
    0.63 with this spin (and 0.68 when a second OpenMP team had throttled every spin to
    nothing, at 1.2-1.55x slower forwards: worker/engine/worker.py). A short spin still
    bridges the gaps between one forward's ops: 151-156 ms against 144-158 ms for the same
    bfloat16 prefill. An operator's own GOMP_SPINCOUNT or OMP_WAIT_POLICY is kept."""
    if "torch" in sys.modules:
        log.warning("torch loaded before the OpenMP spin was set: libgomp's default applies")
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ.setdefault("GOMP_SPINCOUNT", OPENMP_SPIN_COUNT)


async def start_model_thread(
    runtime: ServiceRuntime, config: EngineWorkerConfig
) -> tuple[ModelRunner, ModelThread]:
    """The thread a worker computes in, with the model built in it (the checkpoint's, or
    the simulated one for `--engine mock`) and the checkpoint's warmed up on
    `config.warmup_tokens` dummy tokens before the worker joins discovery
    (worker/engine/worker.py: why one thread does all of it); closed last."""
    from worker.engine.worker import ModelThread, build_runner, warm_up
    from worker.mock_engine.simulated import simulated_model

    model_thread = ModelThread()
    runtime.on_stop(model_thread.close)  # registered before the worker's: runs after it
    if config.engine == "mock":  # nothing to warm: its passes only sleep
        return await model_thread.run(build_runner, config, simulated_model), model_thread
    runner = await model_thread.run(build_runner, config)
    warmup_s = await model_thread.run(warm_up, runner, config.warmup_tokens)
    log.info("model warmed up", num_tokens=config.warmup_tokens, s=round(warmup_s, 2))
    return runner, model_thread


async def publish_holdings(runtime: ServiceRuntime, runner: ModelRunner) -> Holdings:
    """Tell kv-index what this worker's pool and host tier hold (holdings.py), from now
    until shutdown (a goodbye then)."""
    holdings = Holdings(runtime.instance_id)
    runner.allocator.on_hold = lambda block_hash, held: holdings.set(block_hash, HOLD_DEVICE, held)
    runner.host_tier.on_hold = lambda block_hash, held: holdings.set(block_hash, HOLD_HOST, held)
    publisher = HoldingsPublisher(runtime.bus, holdings)
    await publisher.start()
    runtime.on_stop(publisher.stop)
    runtime.metrics.gauge_from(
        "kvfabric_worker_holdings_blocks",
        "Blocks this worker's pool and host tier hold, as kv-index is told",
        lambda: holdings.num_blocks,
    )
    return holdings
