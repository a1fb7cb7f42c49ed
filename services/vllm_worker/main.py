"""vllm-worker: a vLLM engine behind kvfabric's messages, prefill and decode in one instance
(an aggregated worker), its prefix cache extended by kvfabric's SSD tier and kv-index
through the KV connector (connector/, beside this file). docs/design.md, 'One request, end to
end'; docs/vllm.md.

At start it exports the model's weights for vLLM (the GGUF's own tensors, once) and starts
vLLM's OpenAI-compatible server from vLLM's own venv (`vllm_env.py`: built on first use)
with `--block-size`, `--dtype` (float32 by default) and the connector; the instance shows up
in discovery once vLLM answers. Serves `<root>.vllm-worker.run.<id>` (`DecodeJob` ->
`JobAccepted`: the router sends the whole request here, and no prefill job), listens for
`CancelRequest`s, streams `TokenChunk`s to each request's inbox, and keeps a `UsageRecord`
per request in its durable outbox until JetStream has it (worker.py). Heartbeats carry its
load: requests waiting for their first token and their uncached prompt tokens, requests
running, and vLLM's KV blocks in all and free (from vLLM's /metrics). If vLLM exits, the
worker stops: its requests end with UNAVAILABLE and the router sends the next ones
elsewhere.
"""

from __future__ import annotations

import asyncio

import aiohttp

from services.vllm_worker.config import VllmWorkerConfig
from services.vllm_worker.metrics import VllmWorkerMetrics
from services.vllm_worker.vllm_client import VllmClient, VllmError
from services.vllm_worker.vllm_env import (
    VllmServer,
    connector_config,
    ensure_vllm,
    export_checkpoint,
)
from services.vllm_worker.worker import VllmWorker
from shared.bus import Endpoint
from shared.logging import get_logger
from shared.models import model_path
from shared.runtime import ServiceRuntime, service_main
from shared.schema import CancelRequest, DecodeJob
from shared.subjects import DECODE, VLLM_WORKER
from shared.usage import adopt_orphans, ensure_usage_stream, open_usage_outbox
from worker.engine.checkpoint import Checkpoint
from worker.serving.metrics import observe_load, observe_outbox

log = get_logger(__name__)

ORPHAN_SWEEP_S = 30.0


def build_server(config: VllmWorkerConfig, instance_id: str) -> VllmServer:
    """The vLLM server this worker runs (blocking: may build vLLM's venv and the export)."""
    python = config.vllm_python or ensure_vllm()
    checkpoint = export_checkpoint(config.model)
    kv_transfer = None
    if config.connector:
        kv_transfer = connector_config(
            {
                "nats_url": config.nats_url,
                "root": config.root,
                "model": config.model_name,
                "store_dir": str(config.store_dir.resolve()),
                "writer_id": instance_id,
                "store_capacity_bytes": config.store_capacity_bytes,
                "store_file_nbytes": config.store_file_nbytes,
                "store_backend": config.store_backend,
                "block_size_tokens": config.kv_block_size_tokens,
                "kv_index_shards": config.kv_index_shards,
                "log_level": config.log_level,
            }
        )
    log_path = config.usage_outbox_dir.parent / "logs" / f"{instance_id}.vllm.log"
    return VllmServer(
        checkpoint,
        config.model_name,
        python=python,
        max_model_len=config.max_model_len,
        dtype=config.dtype,
        block_size_tokens=config.kv_block_size_tokens,
        kv_transfer_config=kv_transfer,
        enforce_eager=config.enforce_eager,
        kv_cache_bytes=config.kv_cache_bytes,
        log_path=log_path,
        startup_timeout_s=config.vllm_startup_timeout_s,
    )


async def setup(runtime: ServiceRuntime) -> None:
    config = runtime.config
    assert isinstance(config, VllmWorkerConfig)  # service_main built it from VllmWorkerConfig
    bus, subjects = runtime.bus, runtime.bus.subjects
    if config.connector:
        config.store_dir.mkdir(parents=True, exist_ok=True)
    server = await asyncio.to_thread(build_server, config, runtime.instance_id)
    log.info("starting vLLM", argv=" ".join(server.argv()), log=str(server.log_path))
    await asyncio.to_thread(server.start)
    log.info("vLLM serving", url=server.base_url, startup_s=round(server.startup_s, 1))
    client = VllmClient(server.base_url.removesuffix("/v1"))
    if config.warmup_tokens:  # before discovery: no request routed here pays it
        try:
            warmup_s = await client.warm_up(config.model_name, config.warmup_tokens)
        except (VllmError, aiohttp.ClientError) as exc:
            log.warning("vLLM warm-up failed: serving without it", error=str(exc))
        else:
            log.info("vLLM warmed up", num_tokens=config.warmup_tokens, s=round(warmup_s, 2))

    async def stop_server() -> None:
        await asyncio.to_thread(server.stop)

    runtime.on_stop(stop_server)  # registered first: runs last, after the requests ended
    runtime.metadata |= {
        # What ingress reads to serve the model (its tokenizer and chat template: ours).
        "model": config.model_name,
        "model_path": str(model_path(config.model)),
        "max_model_len": str(config.max_model_len),
        "kv_block_size_tokens": str(config.kv_block_size_tokens),
        "engine": "vllm",
        "vllm_url": server.base_url,
        "connector": "kvfabric" if config.connector else "none",
        "vllm_startup_s": f"{server.startup_s:.1f}",
    }

    await ensure_usage_stream(bus)
    # Published as decode's: the engine's own count of the request, which billing prefers.
    outbox = await open_usage_outbox(bus, DECODE, config.usage_outbox_dir, runtime.instance_id)
    observe_outbox(runtime.metrics, outbox)

    async def close_outbox() -> None:
        await outbox.close(timeout_s=config.shutdown_grace_s)

    runtime.on_stop(close_outbox)

    tokenizer = Checkpoint(model_path(config.model)).tokenizer()  # the engine workers' own
    worker = VllmWorker(bus, client, tokenizer, outbox, config, VllmWorkerMetrics(runtime.metrics))
    await worker.poll_load()
    runtime.load_fields = worker.load_fields
    observe_load(runtime.metrics, worker.load_fields)

    async def stop_worker() -> None:
        await worker.stop()
        await client.close()

    runtime.on_stop(stop_worker)  # registered last: runs first

    async def watch() -> None:
        if server.process is None or server.process.poll() is not None:
            log.error("vLLM exited: stopping", log_tail=server.log_tail(1500))
            runtime.request_stop()
            return
        await worker.poll_load()

    runtime.every(config.heartbeat_s, watch)

    async def adopt() -> None:  # what dead workers sharing the directory left
        await adopt_orphans(bus, DECODE, config.usage_outbox_dir)

    runtime.every(ORPHAN_SWEEP_S, adopt)
    await bus.serve(Endpoint("run", subjects.vllm_run, DecodeJob, worker.handle_job))
    await bus.subscribe(subjects.cancel, CancelRequest, worker.on_cancel)


def main(argv: list[str] | None = None) -> int:
    return service_main(VLLM_WORKER, VllmWorkerConfig, setup, argv, description=__doc__ or "")
