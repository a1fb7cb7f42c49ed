"""The prefill worker: jobs in, suffix KV out to decode (docs/request-flow.md).

One job: restore the cached prefix (restore.py) -> compute every prompt token but the last,
in chunks batched with other jobs under `max_batch_tokens` per forward pass -> stage the
computed pages and the window at `n - 1` in the NIXL buffer and tell decode (`SuffixReady`;
decode pulls, then answers) -> write the new complete blocks to the store (BlocksStored) and
put the window snapshot at the last block boundary into swa-memcache -> reply `PrefillDone`.

Chunks are cut at the last block boundary so that the window there (what the next turn
restores) is seen exactly. Model calls run one at a time in a thread (`compute_lock`), so
the event loop keeps serving NATS while the model computes.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass

import msgspec
import numpy as np

from services.prefill.restore import PrefixRestorer, Restored
from shared.bus import Bus, Context
from shared.engine.kv_cache import SlidingWindowState
from shared.engine.runner import ModelRunner
from shared.engine.sequence import Sequence
from shared.engine.swa_restore import snapshot_to_bytes
from shared.kvstore.hashing import BlockHasher
from shared.kvstore.swa_client import SwaClient
from shared.kvstore.writer import KvEventPublisher
from shared.logging import get_logger
from shared.schema import (
    BadRequest,
    Cancelled,
    CancelRequest,
    DeadlineExceeded,
    InternalError,
    JobAccepted,
    PrefillDone,
    PrefillJob,
    PrefillTimings,
    ServiceError,
    SuffixReady,
)
from shared.serving.checks import checked_prompt
from shared.serving.kv_io import hasher_for, stage_pages, store_blocks
from shared.serving.staging import StagingSpace, StagingTooSmall

log = get_logger(__name__)


@dataclass(eq=False)
class _Job:
    job: PrefillJob
    token_ids: list[int]
    hasher: BlockHasher
    done: asyncio.Future[PrefillDone]
    accepted_s: float
    seq: Sequence
    restored: Restored
    boundary: int  # the last block boundary at or before n - 1
    target: int  # n - 1: decode computes the last prompt token
    boundary_window: SlidingWindowState | None = None
    first_chunk_s: float | None = None
    compute_s: float = 0.0
    finishing: bool = False

    @property
    def request_id(self) -> str:
        return self.job.request.request_id

    @property
    def num_left(self) -> int:
        return self.target - self.seq.num_computed_tokens


class PrefillWorker:
    def __init__(
        self,
        bus: Bus,
        runner: ModelRunner,
        restorer: PrefixRestorer,
        publisher: KvEventPublisher,
        swa: SwaClient | None,
        handoff_buffer: np.ndarray,
        staging: StagingSpace,
        *,
        model_name: str,
        max_batch_tokens: int,
        max_model_len: int,
        handoff_timeout_s: float,
        compute_lock: asyncio.Lock,
    ) -> None:
        self.bus = bus
        self.runner = runner
        self.restorer = restorer
        self.publisher = publisher
        self.swa = swa
        self.buffer = handoff_buffer.reshape(-1).view(np.uint8)
        self.staging = staging
        self.model_name = model_name
        self.max_batch_tokens = max_batch_tokens
        self.max_model_len = max_model_len
        self.handoff_timeout_s = handoff_timeout_s
        self.compute_lock = compute_lock
        self.block_size = runner.layout.block_size_tokens
        self._jobs: dict[str, _Job] = {}
        self._wake = asyncio.Event()
        self._seq_ids = itertools.count()
        self._loop_task: asyncio.Task[None] | None = None
        self._finishing: set[asyncio.Task[None]] = set()
        self.counts = {"num_jobs": 0, "num_done": 0, "num_failed": 0, "num_cancelled": 0,
                       "num_tokens_computed": 0, "num_tokens_cached": 0,
                       "num_blocks_stored": 0, "num_snapshots_put": 0}  # fmt: skip

    # -- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        self._loop_task = asyncio.create_task(self._compute_loop())

    async def stop(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
        await asyncio.gather(*self._finishing, return_exceptions=True)

    def load_fields(self) -> dict[str, int]:
        computing = [j for j in self._jobs.values() if not j.finishing]
        return {
            "num_queued": len(computing),
            "num_queued_tokens": sum(j.num_left for j in computing),
            "num_running": len(self._jobs),
            "num_kv_pages_total": self.runner.allocator.num_blocks,
            "num_kv_pages_free": self.runner.allocator.num_free_blocks,
        }

    def counters(self) -> dict[str, int]:
        return self.counts | {
            "num_snapshot_hits": self.restorer.num_snapshot_hits,
            "num_snapshot_misses": self.restorer.num_snapshot_misses,
            "num_replayed_tokens": self.restorer.num_replayed_tokens,
        }

    # -- requests ------------------------------------------------------------------------
    async def handle_job(self, job: PrefillJob, ctx: Context) -> PrefillDone:
        request = job.request
        token_ids = self._validate(job)
        if request.request_id in self._jobs:
            raise BadRequest(f"request {request.request_id} is already being prefilled here")
        accepted_s = time.perf_counter()
        self.counts["num_jobs"] += 1
        hasher = hasher_for(request)
        block_hashes = hasher.hashes(token_ids)
        num_cached_blocks = job.decision.num_cached_tokens // self.block_size
        # The last prompt token is decode's: never restore a prefix that covers it.
        num_cached_blocks = min(num_cached_blocks, (len(token_ids) - 1) // self.block_size)
        restored = await self.restorer.restore(
            token_ids, block_hashes, job.cached_blocks, num_cached_blocks
        )
        seq = Sequence(next(self._seq_ids), token_ids)
        if restored.window is not None:
            self.runner.block_manager.attach_prefix(seq, restored.pages, restored.window)
            self.runner.allocator.free(restored.pages)  # the sequence owns them now
        target = len(token_ids) - 1
        entry = _Job(
            job, token_ids, hasher, asyncio.get_running_loop().create_future(), accepted_s,
            seq, restored, (target // self.block_size) * self.block_size, target,
        )  # fmt: skip
        self.counts["num_tokens_cached"] += restored.num_blocks * self.block_size
        self._jobs[request.request_id] = entry
        if entry.num_left == 0:
            self._start_finish(entry)
        else:
            self._wake.set()
        try:
            return await asyncio.shield(entry.done)
        except asyncio.CancelledError:  # the bus is stopping: do not leave the job behind
            self._drop(entry, Cancelled("prefill worker stopping"))
            raise

    def _validate(self, job: PrefillJob) -> list[int]:
        token_ids = checked_prompt(
            job.request, model_name=self.model_name, block_size_tokens=self.block_size,
            max_model_len=self.max_model_len,
        )  # fmt: skip
        if self.runner.block_manager.num_blocks_for(len(token_ids)) > self.runner.pool.num_blocks:
            raise BadRequest(
                f"prompt of {len(token_ids)} tokens does not fit this worker's KV pool "
                f"({self.runner.pool.num_blocks} pages of {self.block_size} tokens)"
            )
        return token_ids

    async def on_cancel(self, cancel: CancelRequest) -> None:
        entry = self._jobs.get(cancel.request_id)
        if entry is not None and not entry.finishing:
            self.counts["num_cancelled"] += 1
            self._drop(entry, Cancelled(f"cancelled: {cancel.reason}"))

    def _drop(self, entry: _Job, error: ServiceError) -> None:
        if self._jobs.get(entry.request_id) is entry:
            del self._jobs[entry.request_id]
            self.runner.release(entry.seq)
        if not entry.done.done():
            entry.done.set_exception(error)
            entry.done.exception()  # retrieved: the handler may already be gone

    # -- the model -----------------------------------------------------------------------
    def _plan(self) -> list[tuple[_Job, int]]:
        budget, batch = self.max_batch_tokens, []
        now_ms = time.time() * 1000
        for entry in list(self._jobs.values()):
            if entry.finishing or entry.num_left == 0:
                continue
            deadline_ms = entry.job.request.deadline_ms
            if deadline_ms is not None and now_ms > deadline_ms:
                self._drop(entry, DeadlineExceeded("deadline passed while queued for prefill"))
                continue
            computed = entry.seq.num_computed_tokens
            cut = entry.boundary if computed < entry.boundary else entry.target
            num_tokens = min(cut - computed, budget)
            if num_tokens > 0:
                batch.append((entry, num_tokens))
                budget -= num_tokens
            if budget == 0:
                break
        return batch

    async def _compute_loop(self) -> None:
        while True:
            batch = self._plan()
            if not batch:
                self._wake.clear()
                await self._wake.wait()
                continue
            seqs = [entry.seq for entry, _ in batch]
            started = time.perf_counter()
            try:
                async with self.compute_lock:
                    await asyncio.to_thread(
                        self.runner.prefill, seqs, num_new_tokens=[n for _, n in batch]
                    )
            except Exception as exc:
                log.exception("prefill forward pass failed")
                for entry, _ in batch:
                    self.counts["num_failed"] += 1
                    self._drop(entry, InternalError(f"prefill failed: {exc}"))
                continue
            elapsed = time.perf_counter() - started
            for entry, num_tokens in batch:
                if self._jobs.get(entry.request_id) is not entry:
                    continue  # cancelled while the model ran
                entry.first_chunk_s = entry.first_chunk_s or started
                entry.compute_s += elapsed
                self.counts["num_tokens_computed"] += num_tokens
                if entry.seq.num_computed_tokens == entry.boundary:
                    entry.boundary_window = entry.seq.window
                if entry.num_left == 0:
                    self._start_finish(entry)

    # -- handoff -------------------------------------------------------------------------
    def _start_finish(self, entry: _Job) -> None:
        entry.finishing = True
        task = asyncio.create_task(self._finish(entry))
        self._finishing.add(task)
        task.add_done_callback(self._finishing.discard)

    async def _finish(self, entry: _Job) -> None:
        try:
            timings = await self._handoff(entry)
        except ServiceError as exc:
            self.counts["num_failed"] += 1
            log.warning("prefill handoff failed", request_id=entry.request_id, error=str(exc))
            self._drop(entry, exc)
            return
        except Exception as exc:
            self.counts["num_failed"] += 1
            log.exception("prefill handoff failed", request_id=entry.request_id)
            self._drop(entry, InternalError(f"prefill handoff failed: {exc}"))
            return
        del self._jobs[entry.request_id]
        self.runner.release(entry.seq)
        self.counts["num_done"] += 1
        if not entry.done.done():
            entry.done.set_result(PrefillDone(request_id=entry.request_id, timings=timings))

    async def _handoff(self, entry: _Job) -> PrefillTimings:
        seq, restored, request = entry.seq, entry.restored, entry.job.request
        first_block = restored.num_blocks  # the first block this worker computed
        pages = seq.block_table[first_block:]
        window = seq.window if seq.window is not None else self.runner.empty_window(0)
        window_bytes = snapshot_to_bytes(window)
        block_nbytes = self.runner.layout.block_nbytes
        try:
            extent = await self.staging.allocate(len(pages) * block_nbytes + len(window_bytes))
        except StagingTooSmall as exc:
            raise BadRequest(f"suffix too large to hand off: {exc}") from exc
        try:
            staged = stage_pages(self.runner.pool, pages, self.buffer, extent.offset)
            end = extent.offset + staged + len(window_bytes)
            self.buffer[extent.offset + staged : end] = np.frombuffer(window_bytes, np.uint8)
            queue_s = (entry.first_chunk_s or time.perf_counter()) - entry.accepted_s
            timings = PrefillTimings(
                queue_ms=queue_s * 1000, load_ms=restored.load_ms,
                restore_ms=restored.restore_ms, swa_restore=restored.mode,
                num_replay_tokens=restored.num_replay_tokens, compute_ms=entry.compute_s * 1000,
            )  # fmt: skip
            ready = SuffixReady(
                request_id=request.request_id, attempt=entry.job.attempt,
                prefill_worker_id=self.bus.instance_id, num_computed_tokens=entry.target,
                first_block_index=first_block, num_blocks=len(pages), block_nbytes=block_nbytes,
                region_offset=extent.offset, window_nbytes=len(window_bytes),
                timings=timings,
            )  # fmt: skip
            subject = self.bus.subjects.instance(
                self.bus.subjects.decode_suffix, entry.job.decision.decode_worker_id
            )
            started = time.perf_counter()
            await self.bus.request(
                subject, ready, JobAccepted, timeout_s=self.handoff_timeout_s,
                request_id=request.request_id, deadline_ms=request.deadline_ms,
            )  # fmt: skip
            transfer_ms = (time.perf_counter() - started) * 1000
        finally:
            await self.staging.free(extent)
        started = time.perf_counter()
        await self._persist(entry, first_block)
        store_ms = (time.perf_counter() - started) * 1000
        return msgspec.structs.replace(timings, transfer_ms=transfer_ms, store_ms=store_ms)

    async def _persist(self, entry: _Job, first_block: int) -> None:
        """New complete blocks to the store; the window at the last boundary to memcache."""
        seq = entry.seq
        end_block = entry.boundary // self.block_size
        self.counts["num_blocks_stored"] += await store_blocks(
            self.publisher, self.runner.pool, seq.block_table, entry.token_ids, entry.hasher,
            first_block, end_block,
        )  # fmt: skip
        window = entry.boundary_window
        if self.swa is None or window is None or end_block == 0:
            return
        boundary_hash = entry.hasher.hashes(entry.token_ids[: entry.boundary])[-1]
        try:
            if await self.swa.put(boundary_hash, snapshot_to_bytes(window)):
                self.counts["num_snapshots_put"] += 1
        except ServiceError as exc:
            log.warning("sliding-window snapshot not kept", error=str(exc))
