"""decode: continuous batching over a paged KV pool, streams tokens, writes completed
blocks to the store and emits usage. docs/design.md, 'One request, end to end';
docs/request-flow.md.

Serves `<root>.decode.run[.<id>]` (`DecodeJob` -> `JobAccepted`), `<root>.decode.suffix.<id>`
(`SuffixReady` -> `JobAccepted` after the NIXL pull) and its NIXL metadata; listens for
`CancelRequest`s; streams `TokenChunk`s to each request's inbox; publishes a `UsageRecord`
per request to JetStream. Speculative decoding with prompt-lookup drafts is on by default
(`--spec-decode false` turns it off); its drafts proposed and accepted and tokens per step are
in the metrics (metrics.py: /metrics, `kvfabric status --json`).

`--engine mock` serves the same subjects from `mock_worker.py` over worker.mock_engine's
MockEngine: simulated step times, fake tokens, real streams, store writes, KV events and
usage, no torch and no NIXL.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from services.decode.config import DecodeConfig
from services.decode.finish import Finisher
from services.decode.jobs import DecodeJobsBase
from services.decode.mock_worker import MockDecodeWorker
from shared.bus import Endpoint
from shared.runtime import ServiceRuntime, service_main
from shared.schema import CancelRequest, DecodeJob, SuffixReady
from shared.subjects import DECODE
from shared.usage import adopt_orphans, ensure_usage_stream, open_usage_outbox
from shared.usage_outbox import UsageOutbox
from worker.engine.checkpoint import Checkpoint
from worker.kvstore.store import KvStore
from worker.mock_engine import MockEngine, MockEngineConfig
from worker.serving.metrics import observe_outbox
from worker.serving.wiring import (
    limit_openmp_spin,
    open_mock_kv,
    open_model_kv,
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
    if config.engine == "mock":
        await setup_mock(runtime, config)
        return
    limit_openmp_spin()
    # Imported here: they import torch (2-10 s), which `--engine mock` never needs.
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
    )
    await serve(runtime, worker, kv.store, kv.agent.close)


async def setup_mock(runtime: ServiceRuntime, config: DecodeConfig) -> None:
    bus = runtime.bus
    outbox = await open_outbox(runtime, config)
    model, store, publisher = await open_mock_kv(runtime, config)
    tokenizer = Checkpoint(config.model_path).tokenizer()
    engine = MockEngine(
        MockEngineConfig(
            model_id=model.name,
            block_size_tokens=config.kv_block_size_tokens,
            vocab_size=model.vocab_size,
            max_model_len=model.max_model_len,
            max_num_batched_tokens=config.max_batch_tokens,
            max_num_seqs=config.max_num_seqs,
            num_kv_pages=config.pool_pages(config.mock_block_nbytes),
        )
    )
    # Mock sequences have no window: no swa-memcache.
    finisher = Finisher(
        bus,
        store,
        publisher,
        None,
        outbox,
        report_load=runtime.publish_load_report,
        metrics=runtime.metrics,
    )
    await serve(runtime, MockDecodeWorker(bus, engine, tokenizer, finisher, config, model), store)


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


async def serve(
    runtime: ServiceRuntime,
    worker: DecodeJobsBase[Any, Any],
    store: KvStore,
    *closers: Callable[[], None],
) -> None:
    """What either engine serves, and its shutdown: the worker, then what it used."""
    bus, subjects = runtime.bus, runtime.bus.subjects
    start_worker(runtime, worker, store, *closers)
    await bus.serve(Endpoint("run", subjects.decode_run, DecodeJob, worker.handle_job))
    await bus.serve(Endpoint("suffix", subjects.decode_suffix, SuffixReady, worker.handle_suffix))
    await bus.subscribe(subjects.cancel, CancelRequest, worker.on_cancel)
    runtime.every(1.0, worker.expire)


def main(argv: list[str] | None = None) -> int:
    return service_main(DECODE, DecodeConfig, setup, argv, description=__doc__ or "")
