"""decode: continuous batching over a paged KV pool, streams tokens, writes completed
blocks to the store and emits usage. docs/design.md, 'One request, end to end';
docs/request-flow.md.

Serves `<root>.decode.run[.<id>]` (`DecodeJob` -> `JobAccepted`), `<root>.decode.suffix.<id>`
(`SuffixReady` -> `JobAccepted` after the NIXL pull) and its NIXL metadata; listens for
`CancelRequest`s; streams `TokenChunk`s to each request's inbox; publishes a `UsageRecord`
per request to JetStream. Speculative decoding with prompt-lookup drafts is on by default
(`--spec-decode false` turns it off); its drafts proposed and accepted and tokens per step are
in the metrics (metrics.py: /metrics, `kvfabric status --json`).

`--engine mock` runs the same worker and engine over a simulated model (worker/mock_engine/):
the served model's geometry without its weights, deterministic tokens, each step sleeping the
cost model's time, and everything else -- the pull, streams, store writes, KV events, window
snapshots, usage -- real.
"""

from __future__ import annotations

from services.decode.config import DecodeConfig
from services.decode.finish import Finisher
from shared.bus import Endpoint
from shared.runtime import ServiceRuntime, service_main
from shared.schema import CancelRequest, DecodeJob, SuffixReady
from shared.subjects import DECODE
from shared.usage import adopt_orphans, ensure_usage_stream, open_usage_outbox
from shared.usage_outbox import UsageOutbox
from worker.engine.checkpoint import Checkpoint
from worker.serving.metrics import observe_outbox
from worker.serving.wiring import (
    limit_openmp_spin,
    open_model_kv,
    publish_holdings,
    start_model_thread,
    start_worker,
)

# How often a worker looks for outboxes of dead workers in its directory (an instance that
# restarts under a new id never reopens its old one).
ORPHAN_SWEEP_S = 30.0


async def setup(runtime: ServiceRuntime) -> None:
    config = runtime.config
    assert isinstance(config, DecodeConfig)  # service_main built it from DecodeConfig
    runtime.metadata["engine"] = config.engine
    limit_openmp_spin()
    # Imported here: they import torch, which must load after the spin is set (libgomp
    # reads its environment once).
    from services.decode.worker import DecodeWorker
    from worker.engine.drafter import SpecDecodeConfig
    from worker.engine.engine import Engine
    from worker.engine.scheduler import SchedulerConfig
    from worker.engine.worker import describe, handoff_staging_bytes, max_model_len

    bus = runtime.bus
    runner, model_thread = await start_model_thread(runtime, config)
    runtime.metadata |= describe(runner, config)
    tokenizer = Checkpoint(config.model_path).tokenizer()
    engine = Engine(
        runner,
        SchedulerConfig(
            max_num_batched_tokens=config.max_batch_tokens, max_num_seqs=config.max_num_seqs
        ),
        spec_decode=SpecDecodeConfig(
            enabled=config.spec_decode, max_batch_size=config.spec_max_batch_size
        ),
        max_model_len=max_model_len(runner, config),
        track_block_boundaries=True,
    )
    outbox = await open_outbox(runtime, config)
    kv = await open_model_kv(
        runtime,
        config,
        DECODE,
        runner.layout.block_nbytes,
        has_windows=bool(runner.config.sliding_layer_ids),
        staging_nbytes=handoff_staging_bytes(runner, config),
    )
    worker = DecodeWorker(
        bus,
        engine,
        tokenizer,
        kv.agent,
        kv.staging,
        Finisher(
            bus,
            kv.store,
            kv.publisher,
            kv.swa,
            outbox,
            report_load=runtime.publish_load_report,
            metrics=runtime.metrics,
        ),
        model_name=config.model_name,
        retry_after_s=config.retry_after_s,
        pull_timeout_s=config.pull_timeout_s,
        suffix_timeout_s=config.suffix_timeout_s,
        model_thread=model_thread,
        write_through=config.write_through,
    )
    subjects = bus.subjects
    start_worker(runtime, worker, kv.store, kv.agent.close, host_tier=runner.host_tier)
    await publish_holdings(runtime, runner)
    await bus.serve(Endpoint("run", subjects.decode_run, DecodeJob, worker.handle_job))
    await bus.serve(Endpoint("suffix", subjects.decode_suffix, SuffixReady, worker.handle_suffix))
    await bus.subscribe(subjects.cancel, CancelRequest, worker.on_cancel)
    runtime.every(1.0, worker.expire)


async def open_outbox(runtime: ServiceRuntime, config: DecodeConfig) -> UsageOutbox:
    """The usage log, and this worker's outbox for it (replaying what a previous run of the
    same instance left). Closed after the worker stopped: the last records go out first."""
    await ensure_usage_stream(runtime.bus)
    outbox = await open_usage_outbox(
        runtime.bus, DECODE, config.usage_outbox_dir, runtime.instance_id
    )
    observe_outbox(runtime.metrics, outbox)

    async def close() -> None:
        await outbox.close(timeout_s=config.shutdown_grace_s)

    runtime.on_stop(close)  # registered before the worker's: runs after it

    async def adopt() -> None:  # what dead workers sharing the directory left
        await adopt_orphans(runtime.bus, DECODE, config.usage_outbox_dir)

    runtime.every(ORPHAN_SWEEP_S, adopt)
    return outbox


def main(argv: list[str] | None = None) -> int:
    return service_main(DECODE, DecodeConfig, setup, argv, description=__doc__ or "")
