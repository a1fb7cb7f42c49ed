"""kvfabric's KV connector for vLLM (V1 API, `KVConnectorBase_V1`): vLLM's prefix cache
extended by kvfabric's SSD tier, shared by every vLLM instance and every kvfabric engine
worker of the same model, and outliving restarts.

    --block-size 64 --kv-transfer-config '{"kv_connector": "KvfabricConnector",
      "kv_connector_module_path": "services.vllm_worker.connector.connector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"nats_url": "nats://127.0.0.1:4222",
        "model": "SmolLM2-135M-Instruct", "store_dir": "/mnt/kvstore",
        "writer_id": "vllm-node-a-0"}}'

vLLM makes two of these per engine: one beside its scheduler, one beside its model runner.

Scheduler side (`scheduler_side.py`). `get_num_new_matched_tokens` finds the longest prefix
of the prompt on the SSD tier: for a request the vllm-worker sent, from its
`kv_transfer_params` (the caller's chain and the router's kv-index match, `params.py`: the
prompt is neither hashed nor matched again); for one sent to vLLM directly, by hashing the
prompt with the same chained block hashes as ingress (`RequestBlocks`: namespace = model,
block size, the request's `cache_salt`) and asking kv-index. It offers the blocks past
vLLM's own cached prefix, up to the prompt's last complete block before its last token (that
token is computed, for its logits), and remembers where each lives. When a request finishes,
`request_finished` hands its complete blocks past the stored prefix -- prompt and output, so
an agent's next turn hits its own answer -- to the worker side, hashing only the blocks past
the chain it holds, and holds vLLM's blocks until they are copied out.

Worker side. `start_load_kv` reads the offered slots from the store, synchronously, before
the forward that needs them, and writes them into vLLM's paged cache (`loading.py`,
`layout.py`: in parts of 64 MiB through two buffers kept between loads, one part read
while the one before it is scattered). Every slot is checked (header, hash, length,
checksum): a bad or evicted slot is a miss, reported through
`get_block_ids_with_load_errors`, and vLLM recomputes from there -- never wrong KV.
`wait_for_save` copies the finished requests' blocks out of the cache and writes them to the
store in the background, publishing `BlocksStored` as the writer `writer_id`
(`KvEventPublisher`: the same event log, resync and eviction protocol as an engine worker).

kv_connector_extra_config:
- `nats_url` (required), `root` (kvf.v1): the cluster's bus.
- `model` (required): the model's name in the block-hash namespace: what kvfabric's workers
  of the same weights serve (`SmolLM2-135M-Instruct`), or no block is shared with them.
- `store_dir` (required), `writer_id` (required, unique per vLLM instance and stable across
  its restarts), `store_capacity_bytes` (64 GiB), `store_file_nbytes` (1 GiB),
  `store_backend` (`aiofiles`; `nixl:POSIX` where NIXL is installed in vLLM's environment).
- `block_size_tokens` (64): must equal vLLM's `--block-size`.
- `kv_index_shards` (1), `match_timeout_s` (0.5): a match that fails or is late is a miss.
- `load`, `save` (true): either direction can be turned off.
- `log_level` (info): the level of the connector's own lines in vLLM's log.
- `idle_spin_s` (0.05; null: vLLM's own 1 s): how long vLLM's model process busy-polls for
  its next step after each one (`spin.py`).
"""

from __future__ import annotations

import logging
import socket
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import structlog
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from services.vllm_worker.connector.config import ConnectorConfig, ConnectorConfigError
from services.vllm_worker.connector.layout import VllmBlockConverter, check_with_kernel
from services.vllm_worker.connector.loading import BlockLoader
from services.vllm_worker.connector.loop import LoopThread
from services.vllm_worker.connector.scheduler_side import LoadJob, SaveJob, SchedulerSide
from services.vllm_worker.connector.spin import shorten_idle_spin
from shared import kv_index_client
from shared.bus import Bus
from shared.kv_index_client import PrefixMatch
from shared.logging import get_logger
from worker.kvstore.store import KvStore, KvStoreConfig
from worker.kvstore.writer import KvEventPublisher

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = get_logger(__name__)

CONNECT_TIMEOUT_S = 10.0
STORE_TIMEOUT_S = 60.0  # the store's open (it scans its own files), a save at shutdown
MAX_PENDING_SAVE_BYTES = 1 << 30  # copied out and not yet written: beyond this, wait


# -- what the scheduler side tells the worker side, each step --------------------------------
@dataclass
class KvfabricMetadata(KVConnectorMetadata):
    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)


class KvfabricConnector(KVConnectorBase_V1):
    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self.config = config = ConnectorConfig.from_extra(extra)
        # structlog's level only: vLLM's own logging (the stdlib's) is left as vLLM set it.
        structlog.configure(
            wrapper_class=structlog.make_filtering_bound_logger(
                logging.getLevelNamesMapping()[config.log_level.upper()]
            )
        )
        block_size = vllm_config.cache_config.block_size
        if block_size != config.block_size_tokens:
            raise ConnectorConfigError(
                f"vLLM's --block-size is {block_size}; the store's blocks are "
                f"{config.block_size_tokens} tokens: start vLLM with --block-size "
                f"{config.block_size_tokens}"
            )
        self.block_size = block_size
        self._loop = LoopThread(f"kvfabric-connector-{role.name.lower()}")
        self.bus: Bus = self._loop.call(
            Bus.connect(
                config.nats_url,
                service="vllm-connector",
                root=config.root,
                instance_id=f"{config.writer_id}-{role.name.lower()}-{socket.gethostname()}",
            ),
            timeout_s=CONNECT_TIMEOUT_S + 5,
        )
        self.scheduler_side = SchedulerSide(config, block_size, self._match)
        self.counts = self.scheduler_side.counts
        # worker side
        self.converter: VllmBlockConverter | None = None
        self.store: KvStore | None = None
        self.publisher: KvEventPublisher | None = None
        self._load_errors: set[int] = set()
        self.loader: BlockLoader | None = None
        self._saved: set[str] = set()  # copied out this step: vLLM may free their blocks
        self._pending: list[tuple[Future, int]] = []  # (write, bytes copied) in the background
        self._lock = threading.Lock()
        log.info(
            "kvfabric connector",
            role=role.name,
            model=config.model,
            writer_id=config.writer_id,
            store_dir=str(config.store_dir),
            block_size_tokens=block_size,
        )

    # == scheduler side (scheduler_side.py) ===================================================
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self.scheduler_side.num_new_matched_tokens(request, num_computed_tokens), False

    def _match(self, hashes: list[int]) -> dict[str, PrefixMatch]:
        """kv-index's answer, from vLLM's scheduler thread (our loop runs the request)."""
        return self._loop.call(
            kv_index_client.match(
                self.bus,
                hashes,
                num_shards=self.config.kv_index_shards,
                timeout_s=self.config.match_timeout_s,
            ),
            timeout_s=self.config.match_timeout_s + 1.0,
        )

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self.scheduler_side.allocated(request.request_id, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KvfabricMetadata(saves=self.scheduler_side.take_saves())
        for new in scheduler_output.scheduled_new_reqs:
            self._add_load(meta, new.req_id, new.block_ids[0])
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new_block_ids = cached.new_block_ids[i]
            # A request resumed after preemption: its blocks are all new, load them again.
            if req_id in cached.resumed_req_ids and new_block_ids is not None:
                self._add_load(meta, req_id, new_block_ids[0])
        return meta

    def _add_load(self, meta: KvfabricMetadata, request_id: str, block_ids: list[int]) -> None:
        load = self.scheduler_side.take_load(request_id, block_ids)
        if load is not None:
            meta.loads.append(load)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        # True: vLLM holds the blocks until the worker side copied them.
        return self.scheduler_side.finished(request, block_ids), None

    # == worker side ===========================================================================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.converter = converter_for(kv_caches, self.block_size)
        config = self.config
        store_config = KvStoreConfig(
            root_dir=config.store_dir,
            writer_id=config.writer_id,
            payload_nbytes=self.converter.layout.block_nbytes,
            capacity_bytes=config.store_capacity_bytes,
            file_nbytes=config.store_file_nbytes,
            backend=config.store_backend,
        )
        config.store_dir.mkdir(parents=True, exist_ok=True)

        async def open_store() -> tuple[KvStore, KvEventPublisher]:
            import asyncio

            store = await asyncio.to_thread(KvStore.open, store_config)
            publisher = KvEventPublisher(self.bus, store)
            await publisher.start()  # announces the slots a restarted writer found
            return store, publisher

        self.store, self.publisher = self._loop.call(open_store(), timeout_s=STORE_TIMEOUT_S)
        self.loader = BlockLoader(self.store, self.converter, self._loop)
        if config.idle_spin_s is not None:
            spinning = shorten_idle_spin(config.idle_spin_s)
            log.info("vLLM's idle spin shortened", readers=spinning, s=config.idle_spin_s)
        log.info(
            "kvfabric store open",
            writer_id=config.writer_id,
            block_nbytes=self.converter.layout.block_nbytes,
            num_layers=self.converter.layout.num_full_layers,
            adopted_blocks=len(self.store.adopted),
        )

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvfabricMetadata)
        for job in meta.loads:
            self._load(job)

    def _load(self, job: LoadJob) -> None:
        assert self.loader is not None
        loaded = self.loader.load(job.refs, job.block_ids, job.request_id)
        # A miss ends the prefix there: that block and every one after it are recomputed.
        self._load_errors.update(job.block_ids[loaded.num_blocks :])
        log.debug(
            "loaded",
            request_id=job.request_id,
            num_blocks=loaded.num_blocks,
            num_missed=len(job.refs) - loaded.num_blocks,
            read_ms=round(loaded.read_s * 1e3, 2),
            scatter_ms=round(loaded.scatter_s * 1e3, 2),
        )

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are whole before the forward (start_load_kv)

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        return  # saves are whole blocks of finished requests (wait_for_save)

    def wait_for_save(self) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvfabricMetadata)
        for job in meta.saves:
            self._save(job)

    def _save(self, job: SaveJob) -> None:
        assert self.converter is not None and self.publisher is not None
        payloads = self.converter.gather(job.block_ids)  # a copy: vLLM may free the blocks
        nbytes = payloads.numel() * payloads.element_size()
        self._saved.add(job.request_id)
        raw = payloads.view(torch.uint8).numpy().reshape(len(job.block_ids), -1)
        pairs = [(h, memoryview(raw[i])) for i, h in enumerate(job.block_hashes)]
        future = self._loop.submit(
            self.publisher.store_blocks(pairs, parent_block_hash=job.parent_block_hash)
        )
        future.add_done_callback(lambda f, job=job: self._saved_done(f, job))
        with self._lock:
            self._pending = [(f, n) for f, n in self._pending if not f.done()]
            self._pending.append((future, nbytes))
            waiting = list(self._pending)
        # Backpressure: a store slower than the engine must not grow memory without bound.
        while sum(n for f, n in waiting if not f.done()) > MAX_PENDING_SAVE_BYTES:
            next(f for f, _ in waiting if not f.done()).exception()  # waits for it

    def _saved_done(self, future: Future, job: SaveJob) -> None:
        exc = future.exception()
        if exc is not None:  # a skipped save is a later miss, never an error for the request
            log.warning("store write failed", request_id=job.request_id, error=repr(exc))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        saved, self._saved = self._saved, set()
        return (saved or None), None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        with self._lock:
            pending = [f for f, _ in self._pending]
        for future in pending:  # what was copied out reaches the store before we go
            try:
                future.result(STORE_TIMEOUT_S)
            except Exception as exc:
                log.warning("store write lost at shutdown", error=repr(exc))
        if self.store is not None:
            self.store.close()
        try:
            self._loop.call(self.bus.close(), timeout_s=5)
        except Exception as exc:
            log.warning("bus close failed", error=repr(exc))
        self._loop.stop()


def converter_for(kv_caches: dict[str, torch.Tensor], block_size: int) -> VllmBlockConverter:
    """The converter for the kernels vLLM picked for these caches, checked against its own
    cache-write kernel before any block moves (layout.check_with_kernel):
    - on its CPU backend, the ISA's (by dtype, block size and the CPU: the same choice its
      attention layers make), written by `cpu_attn_reshape_and_cache`;
    - on a GPU, `flash` (FlashAttention, FlashInfer and Triton alike), written by
      `reshape_and_cache_flash`."""
    from vllm import _custom_ops as ops

    first = next(iter(kv_caches.values()))
    if first.device.type == "cpu":
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        kernels = _get_attn_isa(first.dtype, block_size, first.shape[-1] // 2)

        def write(key_cache, value_cache, slots, keys, values) -> None:  # noqa: ANN001
            ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, slots, kernels)

    else:
        kernels = "flash"
        scale = torch.ones((), dtype=torch.float32, device=first.device)  # unquantized

        def write(key_cache, value_cache, slots, keys, values) -> None:  # noqa: ANN001
            ops.reshape_and_cache_flash(
                keys, values, key_cache, value_cache, slots, "auto", scale, scale
            )

    converter = VllmBlockConverter.of(kv_caches, block_size, kernels)
    check_with_kernel(converter, write)
    log.info(
        "KV layout checked against vLLM's kernel",
        kernels=kernels,
        dtype=str(first.dtype),
        device=str(first.device),
    )
    return converter
