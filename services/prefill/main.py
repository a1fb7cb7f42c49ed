"""prefill: loads the cached prefix KV, restores the sliding-window state, computes the
uncached suffix and hands it to decode. docs/design.md, 'One request, end to end' and
'Sliding-window state'; docs/request-flow.md.

Serves `<root>.prefill.run[.<id>]` (`PrefillJob` -> `PrefillDone`, once decode holds the
suffix) and its NIXL metadata; listens for `CancelRequest`s; writes the blocks it computes
to the store (`--store-dir`, shared by every worker) and logs them for kv-index; puts the
window snapshot at each prompt's last block boundary into swa-memcache. Heartbeats report
the tokens still to compute (`num_queued_tokens`) and the KV pool's pages.

`--engine mock` serves the same subjects from `mock_worker.py`: simulated compute, real
store writes, KV events and swa-memcache puts, no torch and no NIXL.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from services.prefill.config import PrefillConfig
from services.prefill.jobs import PrefillJobsBase
from services.prefill.mock_worker import MockPrefillWorker
from shared.bus import Endpoint
from shared.runtime import ServiceRuntime, service_main
from shared.schema import CancelRequest, PrefillJob
from shared.subjects import PREFILL
from worker.kvstore.store import KvStore
from worker.serving.wiring import (
    limit_openmp_spin,
    node_swa_client,
    open_mock_kv,
    open_model_kv,
    start_model_thread,
    start_worker,
)


async def setup(runtime: ServiceRuntime) -> None:
    config = runtime.config
    assert isinstance(config, PrefillConfig)  # service_main built it from PrefillConfig
    runtime.metadata["engine"] = config.engine
    if config.engine == "mock":
        await setup_mock(runtime, config)
        return
    limit_openmp_spin()
    # Imported here: they import torch (2-10 s), which `--engine mock` never needs.
    from services.prefill.restore import PrefixRestorer, RestorePolicy
    from services.prefill.worker import PrefillWorker
    from worker.engine.worker import describe, handoff_staging_bytes, max_model_len

    bus = runtime.bus
    runner, model_thread = await start_model_thread(runtime, config)
    runtime.metadata |= describe(runner, config)
    kv = await open_model_kv(
        runtime,
        config,
        PREFILL,
        runner.layout.block_nbytes,
        has_windows=bool(runner.config.sliding_layer_ids),
        staging_nbytes=handoff_staging_bytes(runner, config),
    )
    compute_lock = asyncio.Lock()
    policy = RestorePolicy(
        use_memcache=config.swa_use_memcache,
        replay=config.swa_replay,
        replay_tokens=config.swa_replay_tokens,
    )
    worker = PrefillWorker(
        bus,
        runner,
        PrefixRestorer(runner, kv.store, kv.swa, policy, compute_lock, model_thread),
        kv.publisher,
        kv.swa,
        kv.agent,
        kv.staging,
        model_name=config.model_name,
        max_batch_tokens=config.max_batch_tokens,
        max_model_len=max_model_len(runner, config),
        handoff_timeout_s=config.handoff_timeout_s,
        compute_lock=compute_lock,
        model_thread=model_thread,
        metrics=runtime.metrics,
    )
    await serve(runtime, worker, kv.store, kv.agent.close)


async def setup_mock(runtime: ServiceRuntime, config: PrefillConfig) -> None:
    bus = runtime.bus
    model, store, publisher = await open_mock_kv(runtime, config)
    # Placeholder snapshots are small: inline, no NIXL.
    swa = await node_swa_client(runtime, config, None)
    worker = MockPrefillWorker(bus, publisher, swa, config, model, metrics=runtime.metrics)
    await serve(runtime, worker, store)


async def serve(
    runtime: ServiceRuntime,
    worker: PrefillJobsBase[Any],
    store: KvStore,
    *closers: Callable[[], None],
) -> None:
    """What either engine serves, and its shutdown: the worker, then what it used."""
    bus = runtime.bus
    start_worker(runtime, worker, store, *closers)
    await bus.serve(Endpoint("run", bus.subjects.prefill_run, PrefillJob, worker.handle_job))
    await bus.subscribe(bus.subjects.cancel, CancelRequest, worker.on_cancel)


def main(argv: list[str] | None = None) -> int:
    return service_main(PREFILL, PrefillConfig, setup, argv, description=__doc__ or "")
