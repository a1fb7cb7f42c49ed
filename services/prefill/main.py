"""prefill: loads the cached prefix KV, restores the sliding-window state, computes the
uncached suffix and hands it to decode. docs/design.md, 'One request, end to end' and
'Sliding-window state'; docs/request-flow.md.

Serves `<root>.prefill.stage[.<id>]` (`StageRequest`, published: a session's blocks kept in
the host tier over a tool call) and `<root>.prefill.run[.<id>]` (`PrefillJob` ->
`PrefillDone`, once decode holds the suffix) and its NIXL metadata; listens for
`CancelRequest`s; writes the blocks it computes to the store (`--store-dir`, shared by
every worker) and logs them for kv-index; puts the window snapshot at each prompt's last
block boundary into swa-memcache. Heartbeats report
the tokens still to compute (`num_queued_tokens`; by queue level with `--queue-policy fair`)
and the KV pool's pages.

`--engine mock` runs the same worker over a simulated model (worker/mock_engine/): the
served model's geometry without its weights, each pass sleeping the cost model's time, and
everything else -- restore, handoff, store writes, KV events, window snapshots -- real.
"""

from __future__ import annotations

import asyncio

from services.prefill.config import PrefillConfig
from shared.bus import Endpoint
from shared.runtime import ServiceRuntime, service_main
from shared.schema import CancelRequest, PrefillJob, StageRequest
from shared.subjects import PREFILL
from worker.serving.wiring import (
    limit_openmp_spin,
    open_model_kv,
    publish_holdings,
    start_model_thread,
    start_worker,
)


async def setup(runtime: ServiceRuntime) -> None:
    config = runtime.config
    assert isinstance(config, PrefillConfig)  # service_main built it from PrefillConfig
    runtime.metadata["engine"] = config.engine
    limit_openmp_spin()
    # Imported here: they import torch, which must load after the spin is set (libgomp
    # reads its environment once).
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
        queue_policy=config.queue_policy,
    )
    start_worker(runtime, worker, kv.store, kv.agent.close, host_tier=runner.host_tier)
    await publish_holdings(runtime, runner)
    await bus.serve(Endpoint("run", bus.subjects.prefill_run, PrefillJob, worker.handle_job))
    await bus.serve(
        Endpoint("stage", bus.subjects.prefill_stage, StageRequest, worker.handle_stage)
    )
    await bus.subscribe(bus.subjects.cancel, CancelRequest, worker.on_cancel)


def main(argv: list[str] | None = None) -> int:
    return service_main(PREFILL, PrefillConfig, setup, argv, description=__doc__ or "")
