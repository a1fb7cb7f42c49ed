"""The prefill worker: jobs in, suffix KV out to decode (docs/request-flow.md).

One job: restore the cached prefix (restore.py) -> compute every prompt token, in chunks
batched with other jobs under `max_batch_tokens` per forward pass (planned by the engine's
scheduler, which reserves each chunk's pages first), and sample the first output
token from the last one's logits -> stage the computed pages and the window at `n` in the NIXL
buffer and tell decode, with that token (`SuffixReady`; decode pulls, then answers and streams
the token before its next step) -> write the new complete blocks to the store (BlocksStored)
and put the window snapshot at the last block boundary into swa-memcache -> reply
`PrefillDone`. Sampling here saves decode a forward over the whole prefix for one token: the
time to first token no longer waits for decode's pull and step.
The job table, cancellation, deadlines, batching and the handoff's messages are in jobs.py,
shared with the mock worker; this module is what runs on the model.

The window at the last block boundary (what the next turn restores) is taken from the
forward pass that crosses it (`keep_boundary_window`): no chunk has to stop there. Model
calls run one at a time in a thread (`compute_lock`), so the event loop keeps serving NATS
while the model computes.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass

import numpy as np

from services.prefill.handoff import put_window, tell_decode
from services.prefill.jobs import JobState, PrefillJobsBase
from services.prefill.restore import PrefixRestorer
from shared import telemetry
from shared.blocks import RequestBlocks
from shared.bus import Bus
from shared.logging import get_logger
from shared.metrics import Metrics
from shared.schema import BadRequest, PrefillJob, PrefillTimings
from worker.engine.runner import ModelRunner
from worker.engine.sampler import SamplingParams as EngineSampling
from worker.engine.sampler import generator_state, make_generator, sample_one
from worker.engine.scheduler import Scheduler, SchedulerConfig
from worker.engine.sequence import Sequence
from worker.engine.swa_restore import snapshot_to_bytes
from worker.engine.worker import ModelThread
from worker.kvstore.writer import KvEventPublisher
from worker.serving.pages import stage_pages, store_blocks, tag_blocks
from worker.serving.sampling import engine_sampling
from worker.serving.staging import StagingSpace, StagingTooSmall
from worker.swa_client import SwaClient
from worker.transfer import KvTransferAgent

log = get_logger(__name__)

# Jobs computing at once: the pool's pages bound them long before this does.
MAX_JOBS = 1 << 16


@dataclass(eq=False)
class ModelJob(JobState):
    seq: Sequence
    sampling: EngineSampling  # the request's, for its first output token

    SAMPLES_FIRST_TOKEN = True

    @property
    def num_left(self) -> int:
        return self.target - self.seq.num_computed_tokens


class PrefillWorker(PrefillJobsBase[ModelJob]):
    def __init__(
        self,
        bus: Bus,
        runner: ModelRunner,
        restorer: PrefixRestorer,
        publisher: KvEventPublisher,
        swa: SwaClient | None,
        agent: KvTransferAgent,
        staging: StagingSpace,
        *,
        model_name: str,
        max_batch_tokens: int,
        max_model_len: int,
        handoff_timeout_s: float,
        compute_lock: asyncio.Lock,
        model_thread: ModelThread,
        metrics: Metrics | None = None,
    ) -> None:
        super().__init__(
            bus,
            publisher,
            swa,
            model_name=model_name,
            max_model_len=max_model_len,
            block_size_tokens=runner.layout.block_size_tokens,
            max_batch_tokens=max_batch_tokens,
            handoff_timeout_s=handoff_timeout_s,
            metrics=metrics,
        )
        self.runner = runner
        self.restorer = restorer
        self.agent = agent
        self.buffer = agent.buffer.reshape(-1).view(np.uint8)
        self.staging = staging
        self.compute_lock = compute_lock
        self.model_thread = model_thread
        self._seq_ids = itertools.count()
        # The engine's own planner: chunks under `max_batch_tokens` per pass, oldest job
        # first, pages reserved before the pass (a job waits for them, or the youngest running
        # job is preempted and recomputed), never more jobs than the pool holds.
        self.scheduler = Scheduler(
            runner.block_manager,
            SchedulerConfig(max_num_batched_tokens=max_batch_tokens, max_num_seqs=MAX_JOBS),
        )

    def kv_pages(self) -> tuple[int, int]:
        return self.runner.allocator.num_blocks, self.runner.allocator.num_free_blocks

    # -- jobs ----------------------------------------------------------------------------
    async def _admit(
        self,
        job: PrefillJob,
        token_ids: list[int],
        blocks: RequestBlocks,
        num_cached_blocks: int,
        accepted_s: float,
    ) -> ModelJob:
        sampling = engine_sampling(job.request.sampling)  # BadRequest before any work
        restored = await self.restorer.restore(
            token_ids, blocks, job.cached_blocks, num_cached_blocks
        )
        seq = Sequence(next(self._seq_ids), token_ids)
        if restored.window is not None:
            self.runner.block_manager.attach_prefix(seq, restored.pages, restored.window)
            self.runner.allocator.free(restored.pages)  # the sequence owns them now
        self.scheduler.add(seq)
        timings = PrefillTimings(
            load_ms=restored.load_ms,
            restore_ms=restored.restore_ms,
            swa_restore=restored.mode,
            num_replay_tokens=restored.num_replay_tokens,
            num_local_blocks=restored.num_local_blocks,
        )
        return ModelJob(
            job,
            token_ids,
            blocks,
            asyncio.get_running_loop().create_future(),
            accepted_s,
            timings,
            restored.num_blocks,
            seq,
            sampling,
        )

    def _release(self, entry: ModelJob) -> None:
        self.scheduler.remove(entry.seq)  # its pages are free
        self._wake.set()  # a job may have waited for them

    # -- the model -----------------------------------------------------------------------
    def _schedule(self) -> list[tuple[ModelJob, int]]:
        batch = self.scheduler.schedule()
        by_seq = {entry.seq.seq_id: entry for entry in self._jobs.values()}
        for seq in batch.preempted_seqs:
            log.info("prefill job preempted: pool full", request_id=by_seq[seq.seq_id].request_id)
        # A job with one prompt token left is "decoding" to the scheduler: a 1-token chunk.
        chunks = [(seq, 1) for seq in batch.decode_seqs]
        chunks += zip(batch.prefill_seqs, batch.prefill_num_tokens, strict=True)
        return [(by_seq[seq.seq_id], num_tokens) for seq, num_tokens in chunks]

    async def _forward(self, batch: list[tuple[ModelJob, int]]) -> float:
        started = time.perf_counter()
        async with self.compute_lock:
            await self.model_thread.run(self._prefill, batch)
        return time.perf_counter() - started

    def _prefill(self, batch: list[tuple[ModelJob, int]]) -> None:
        """One pass (model thread); a job whose prompt it completes samples its first token
        from the last token's logits, as decode's engine would have."""
        logits = self.runner.prefill(
            [entry.seq for entry, _ in batch],
            num_new_tokens=[n for _, n in batch],
            keep_boundary_window=True,  # the window at the last block boundary
        )
        for (entry, _), row in zip(batch, logits, strict=True):
            if entry.num_left == 0:
                sampling = entry.sampling
                generator = None if sampling.is_greedy else make_generator(sampling.seed)
                entry.first_token_id = sample_one(row, sampling, generator).token_id
                entry.sampler_state = generator_state(generator)

    def _advance(self, entry: ModelJob, num_tokens: int) -> None:
        """The runner advanced the sequence (and kept its boundary window); a computed one
        leaves the scheduler with its pages, to be staged and stored before they are freed."""
        if entry.num_left == 0:
            self.scheduler.detach(entry.seq)

    # -- handoff -------------------------------------------------------------------------
    async def _send_suffix(self, entry: ModelJob) -> tuple[PrefillTimings, float]:
        """Stage the computed pages and the window at n, and hold them until decode
        answers that it pulled them."""
        seq = entry.seq
        pages = seq.block_table[entry.num_cached_blocks :]  # the blocks this worker computed
        # A model without sliding layers has no window: nothing staged, decode starts empty.
        window = seq.window if seq.window is not None else self.runner.empty_window(0)
        window_bytes = snapshot_to_bytes(window) if self.runner.config.sliding_layer_ids else b""
        block_nbytes = self.runner.layout.block_nbytes
        try:
            extent = await self.staging.allocate(len(pages) * block_nbytes + len(window_bytes))
        except StagingTooSmall as exc:
            raise BadRequest(f"suffix too large to hand off: {exc}") from exc
        try:
            staged = stage_pages(self.runner.pool, pages, self.buffer, extent.offset)
            if window_bytes:
                end = extent.offset + staged + len(window_bytes)
                self.buffer[extent.offset + staged : end] = np.frombuffer(window_bytes, np.uint8)
            timings = entry.timings()
            async with self.agent.busy():  # decode pulls from our region until it answers
                transfer_ms = await tell_decode(
                    self.bus,
                    entry,
                    timings,
                    num_blocks=len(pages),
                    block_nbytes=block_nbytes,
                    region_offset=extent.offset,
                    window_nbytes=len(window_bytes),
                    timeout_s=self.handoff_timeout_s,
                )
        finally:
            await self.staging.free(extent)
        return timings, transfer_ms

    async def _persist(self, entry: ModelJob) -> None:
        seq, blocks = entry.seq, entry.blocks
        # The prompt's complete blocks stay in the pool, found by hash, until their pages are
        # handed out again: the next turn routed here takes them from there (restore.py).
        num_complete = len(entry.token_ids) // self.block_size
        tag_blocks(self.runner.allocator, seq.block_table, blocks.hashes[:num_complete])
        num_stored = await store_blocks(
            self.publisher,
            self.runner.pool,
            seq.block_table,
            entry.token_ids,
            blocks,
            entry.num_cached_blocks,
            blocks.num_prefill_blocks,
        )
        self.counts.blocks_stored.inc(num_stored)
        span = telemetry.current_span()  # prefill store
        if span.is_recording():
            nbytes = num_stored * self.runner.layout.block_nbytes
            span.set_attributes({"kvfabric.num_blocks": num_stored, "kvfabric.bytes": nbytes})
        # The window at the last boundary a pass crossed; none when the restored prefix ended
        # there already (the memcache has that one).
        window = seq.boundary_window
        boundary = blocks.num_prefill_blocks * self.block_size
        if self.swa is None or window is None or window.end_position != boundary:
            return  # (no swa client: the model has no sliding layers)
        if await put_window(self.swa, entry, snapshot_to_bytes(window)):
            self.counts.snapshots_put.inc()
