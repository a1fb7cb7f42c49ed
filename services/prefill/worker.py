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

A `PrefillJob`'s handler waits on a future from its arrival until `PrefillDone` (or its typed
error); a job is dropped when it is cancelled, passes its deadline, the bus stops or its pass
fails. The model is the checkpoint's, or the mock's simulated one (`--engine mock`): the same
code runs either way.

The window at the last block boundary (what the next turn restores) is taken from the
forward pass that crosses it (`keep_boundary_window`): no chunk has to stop there. Model
calls run one at a time in a thread (`compute_lock`), so the event loop keeps serving NATS
while the model computes.
"""

from __future__ import annotations

import asyncio
import itertools
import time

import msgspec
import numpy as np
from opentelemetry.trace import StatusCode

from services.prefill.handoff import put_window, tell_decode
from services.prefill.jobs import JobState
from services.prefill.metrics import PrefillMetrics
from services.prefill.restore import PrefixRestorer
from shared import telemetry
from shared.blocks import RequestBlocks
from shared.bus import Bus, Context
from shared.logging import get_logger
from shared.metrics import Metrics
from shared.schema import (
    BadRequest,
    Cancelled,
    CancelRequest,
    DeadlineExceeded,
    InternalError,
    PrefillDone,
    PrefillJob,
    PrefillTimings,
    ServiceError,
    StageRequest,
    unpack_block_hashes,
)
from shared.subjects import PREFILL
from shared.tasks import cancel_and_wait
from worker.cost_model import CostModel
from worker.engine.runner import ModelRunner
from worker.engine.sampler import generator_state, make_generator, sample_one
from worker.engine.scheduler import Scheduler, SchedulerConfig
from worker.engine.sequence import Sequence
from worker.engine.swa_restore import snapshot_to_bytes
from worker.engine.worker import ModelThread
from worker.kvstore.writer import KvEventPublisher
from worker.serving.checks import checked_prompt
from worker.serving.fair_queue import FAIR, FCFS, NUM_QUEUE_LEVELS, FairOrder, QueuedJob
from worker.serving.pages import stage_pages, store_blocks, tag_blocks
from worker.serving.sampling import engine_sampling
from worker.serving.staging import StagingSpace, StagingTooSmall
from worker.swa_client import SwaClient
from worker.transfer import KvTransferAgent

log = get_logger(__name__)

# Jobs computing at once: the pool's pages bound them long before this does.
MAX_JOBS = 1 << 16


class PrefillWorker:
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
        metrics: Metrics | None = None,  # the process's (a test's own when None)
        queue_policy: str = FCFS,
    ) -> None:
        self.bus = bus
        self.runner = runner
        self.restorer = restorer
        self.publisher = publisher
        self.swa = swa
        self.agent = agent
        self.buffer = agent.buffer.reshape(-1).view(np.uint8)
        self.staging = staging
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.block_size = runner.layout.block_size_tokens
        self.max_batch_tokens = max_batch_tokens
        self.handoff_timeout_s = handoff_timeout_s
        self.compute_lock = compute_lock
        self.model_thread = model_thread
        self._seq_ids = itertools.count()
        # The engine's own planner: chunks under `max_batch_tokens` per pass, oldest job
        # first (or the fair queue's order, `_reorder`), pages reserved before the pass (a
        # job waits for them, or the last running job is preempted and recomputed), never
        # more jobs than the pool holds.
        self.scheduler = Scheduler(
            runner.block_manager,
            SchedulerConfig(max_num_batched_tokens=max_batch_tokens, max_num_seqs=MAX_JOBS),
        )
        self._jobs: dict[str, JobState] = {}
        # Jobs still restoring their prefix (not yet in `_jobs`): request id -> the queue
        # tokens they bring (`CostModel.queue_tokens_of`, as the router counts a job it sends).
        # Reported with the queue: on a loaded worker the restore can take longer than the
        # router's in-flight count lasts, and a job in neither looked like an idle worker.
        self._admitting: dict[str, tuple[int, int]] = {}  # (queue tokens, queue level)
        # `--queue-policy fair`: the order each pass serves jobs in (fair_queue.py); None:
        # arrival order, the engine scheduler's own.
        self._fair = FairOrder() if queue_policy == FAIR else None
        self._cost = CostModel()
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self._finishing: set[asyncio.Task[None]] = set()
        self.metrics = metrics or Metrics(PREFILL, bus.instance_id)
        self.counts = PrefillMetrics(self.metrics)

    # -- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        self._loop_task = asyncio.create_task(self._compute_loop())

    async def stop(self) -> None:
        await cancel_and_wait(self._loop_task)
        await asyncio.gather(*self._finishing, return_exceptions=True)

    def load_fields(self) -> dict[str, int | str | tuple[int, ...]]:
        computing = [j for j in self._jobs.values() if not j.finishing]
        allocator = self.runner.allocator
        queued = [(j.num_left, j.job.queue_level) for j in computing]
        queued += self._admitting.values()
        fields: dict[str, int | str | tuple[int, ...]] = {
            "num_queued": len(queued),
            "num_queued_tokens": sum(num_tokens for num_tokens, _ in queued),
            "num_running": len(self._jobs),
            "num_kv_pages_total": allocator.num_blocks,
            "num_kv_pages_free": allocator.num_free_blocks,
            "model": self.model_name,
            "num_devices": 1,
        }
        if self._fair is not None:  # the router estimates what a job of each level waits for
            by_level = [0] * NUM_QUEUE_LEVELS
            for num_tokens, level in queued:
                by_level[level] += num_tokens
            fields["num_queued_tokens_by_level"] = tuple(by_level)
        return fields

    # -- requests ------------------------------------------------------------------------
    async def handle_stage(self, request: StageRequest, ctx: Context) -> None:
        """A session's turn ended in a tool call: keep its blocks in the host tier, and the
        window at their end in the node's memcache, until the tool is expected back."""
        try:
            hashes = unpack_block_hashes(request.block_hashes).tolist()
        except ValueError as exc:
            raise BadRequest(str(exc)) from exc
        if not hashes or not request.hold_s > 0:
            return
        self.runner.host_tier.stage(hashes, request.hold_s)
        self.counts.staged_blocks.inc(len(hashes))
        if self.swa is not None:  # the window sits at the last or the one-before-last block
            until_ms = int((time.time() + request.hold_s) * 1000)
            await self.swa.hold(hashes[-2:], until_ms)

    async def handle_job(self, job: PrefillJob, ctx: Context) -> PrefillDone:
        request = job.request
        token_ids, blocks = self._validate(job)
        held = self._jobs.get(request.request_id)
        if held is not None:
            if request.failover_attempt <= held.job.request.failover_attempt:
                raise BadRequest(f"request {request.request_id} is already being prefilled here")
            self._supersede(held)
        accepted_s = time.perf_counter()
        self.counts.jobs_received.inc()
        num_cached_blocks = blocks.num_reusable_blocks(job.decision.num_cached_blocks)
        self._admitting[request.request_id] = (
            self._queue_tokens(len(token_ids), num_cached_blocks, job.decision.has_swa_snapshot),
            job.queue_level,
        )
        try:
            entry = await self._admit(job, token_ids, blocks, num_cached_blocks, accepted_s)
        finally:
            self._admitting.pop(request.request_id, None)
        entry.span = telemetry.current_span()
        self.counts.cached_tokens.inc(entry.num_cached_blocks * self.block_size)
        self.counts.restores.labels(entry.restored.swa_restore or "none").inc()
        self.counts.replayed_tokens.inc(entry.restored.num_replay_tokens)
        self._enqueue(entry)
        try:
            return await asyncio.shield(entry.done)
        except asyncio.CancelledError:  # the bus is stopping: do not leave the job behind
            self._drop(entry, Cancelled("prefill worker stopping"))
            raise

    def _queue_tokens(self, num_prompt_tokens: int, num_cached_blocks: int, has_swa: bool) -> int:
        """What an admitted job adds to the queue before its prefix is restored: its compute,
        with the replay and the store read in compute-token equivalents."""
        num_cached = num_cached_blocks * self.block_size
        load_s = self._cost.store_load_s(num_cached)
        return self._cost.queue_tokens_of(num_prompt_tokens, num_cached, has_swa, load_s=load_s)

    def _validate(self, job: PrefillJob) -> tuple[list[int], RequestBlocks]:
        token_ids, blocks = checked_prompt(
            job.request,
            model_name=self.model_name,
            block_size_tokens=self.block_size,
            max_model_len=self.max_model_len,
            vocab_size=self.runner.config.vocab_size,
        )
        if not 0 <= job.queue_level < NUM_QUEUE_LEVELS:
            raise BadRequest(f"queue_level must be in 0..{NUM_QUEUE_LEVELS - 1}")
        num_pages_total = self.runner.allocator.num_blocks
        if -(-len(token_ids) // self.block_size) > num_pages_total:
            raise BadRequest(
                f"prompt of {len(token_ids)} tokens does not fit this worker's KV pool "
                f"({num_pages_total} pages of {self.block_size} tokens)"
            )
        return token_ids, blocks

    async def _admit(
        self,
        job: PrefillJob,
        token_ids: list[int],
        blocks: RequestBlocks,
        num_cached_blocks: int,
        accepted_s: float,
    ) -> JobState:
        """Restore up to `num_cached_blocks` of the prefix; the job, not yet queued."""
        sampling = engine_sampling(job.request.sampling)  # BadRequest before any work
        # A failover's continuation must match the stream it continues: never a bounded
        # replay of its window.
        restored = await self.restorer.restore(
            token_ids,
            blocks,
            job.cached_blocks,
            num_cached_blocks,
            exact=job.request.resume is not None,
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
        return JobState(
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

    def _enqueue(self, entry: JobState) -> None:
        self._jobs[entry.request_id] = entry
        self._wake.set()

    async def on_cancel(self, cancel: CancelRequest) -> None:
        entry = self._jobs.get(cancel.request_id)
        if entry is not None and not entry.finishing:
            self.counts.cancelled.inc()
            self._drop(entry, Cancelled(f"cancelled: {cancel.reason}"))

    def _supersede(self, entry: JobState) -> None:
        """A continuation of the request (its decode worker died) takes the place of this
        older attempt. One still computing is dropped; one being handed off or stored ends
        its own work (its pages are freed when it does) without holding the request's place."""
        log.info("superseded by a continuation", request_id=entry.request_id)
        if entry.finishing:
            del self._jobs[entry.request_id]
        else:
            self._drop(entry, Cancelled("superseded by a continuation of the request"))

    def _drop(self, entry: JobState, error: ServiceError | None) -> None:
        """Forget the job and free what it holds; fail its handler with `error` (None: done)."""
        if self._jobs.get(entry.request_id) is entry:
            del self._jobs[entry.request_id]
        if not entry.released:
            entry.released = True
            self._release(entry)
        if error is not None and not entry.done.done():
            entry.done.set_exception(error)
            entry.done.exception()  # retrieved: the handler may already be gone

    def _release(self, entry: JobState) -> None:
        """Free the KV pages the job holds (once: `_drop` marks it released)."""
        self.scheduler.remove(entry.seq)  # its pages are free
        self._wake.set()  # a job may have waited for them

    # -- the compute loop ----------------------------------------------------------------
    def _plan(self) -> list[tuple[JobState, int]]:
        """The next forward pass over the jobs still computing, after dropping those past
        their deadline: (job, tokens), at most `max_batch_tokens` in all; [] when none can
        run."""
        now_ms = time.time() * 1000
        for entry in list(self._jobs.values()):
            deadline_ms = entry.job.request.deadline_ms
            if entry.finishing or deadline_ms is None or now_ms <= deadline_ms:
                continue
            self.counts.expired.inc()
            self._drop(entry, DeadlineExceeded("deadline passed while queued for prefill"))
        if self._fair is not None:
            self._reorder(self._fair)
        batch = self.scheduler.schedule()
        by_seq = {entry.seq.seq_id: entry for entry in self._jobs.values()}
        for seq in batch.preempted_seqs:
            log.info("prefill job preempted: pool full", request_id=by_seq[seq.seq_id].request_id)
        # A job with one prompt token left is "decoding" to the scheduler: a 1-token chunk.
        chunks = [(seq, 1) for seq in batch.decode_seqs]
        chunks += zip(batch.prefill_seqs, batch.prefill_num_tokens, strict=True)
        return [(by_seq[seq.seq_id], num_tokens) for seq, num_tokens in chunks]

    def _reorder(self, fair: FairOrder) -> None:
        """The engine scheduler serves the jobs still computing in the fair queue's order."""
        computing = [entry for entry in self._jobs.values() if not entry.finishing]
        ordered = fair.order(computing, _queued_job)
        rank = {entry.seq.seq_id: i for i, entry in enumerate(ordered)}
        self.scheduler.reorder(lambda seq: rank.get(seq.seq_id, len(rank)))

    async def _forward(self, batch: list[tuple[JobState, int]]) -> float:
        started = time.perf_counter()
        async with self.compute_lock:
            await self.model_thread.run(self._prefill, batch)
        return time.perf_counter() - started

    def _prefill(self, batch: list[tuple[JobState, int]]) -> None:
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

    def _advance(self, entry: JobState, num_tokens: int) -> None:
        """The runner advanced the sequence (and kept its boundary window); a computed one
        leaves the scheduler with its pages, to be staged and stored before they are freed."""
        if entry.num_left == 0:
            self.scheduler.detach(entry.seq)

    async def _compute_loop(self) -> None:
        while True:
            batch = self._plan()
            if not batch:
                self._wake.clear()
                await self._wake.wait()
                continue
            started = time.perf_counter()
            try:
                elapsed_s = await self._forward(batch)
            except Exception:
                log.exception("prefill forward pass failed", num_jobs=len(batch))
                for entry, _ in batch:
                    self.counts.failed.inc()
                    self._drop(entry, InternalError("prefill forward pass failed"))
                continue
            for entry, num_tokens in batch:
                if self._jobs.get(entry.request_id) is not entry:
                    continue  # cancelled while the pass ran
                entry.first_chunk_s = entry.first_chunk_s or started
                entry.compute_s += elapsed_s
                self.counts.computed_tokens.inc(num_tokens)
                self._advance(entry, num_tokens)
                if entry.num_left == 0:
                    self._start_finish(entry)

    # -- handoff -------------------------------------------------------------------------
    def _start_finish(self, entry: JobState) -> None:
        entry.finishing = True
        task = asyncio.create_task(self._finish(entry))
        self._finishing.add(task)
        task.add_done_callback(self._finishing.discard)

    async def _finish(self, entry: JobState) -> None:
        self._trace_compute(entry)
        with telemetry.span("prefill transfer", parent=entry.span) as span:
            try:
                timings, transfer_ms = await self._send_suffix(entry)
            except ServiceError as exc:  # decode gone, cancelled or timed out: a typed answer
                self.counts.failed.inc()
                log.warning("prefill handoff failed", request_id=entry.request_id, error=str(exc))
                span.set_status(StatusCode.ERROR, str(exc))
                self._drop(entry, exc)
                return
            except Exception:
                self.counts.failed.inc()
                log.exception("prefill handoff failed", request_id=entry.request_id)
                span.set_status(StatusCode.ERROR, "prefill handoff failed")
                self._drop(entry, InternalError("prefill handoff failed"))
                return
        # Decode holds the suffix and serves the request from here: what follows only
        # decides whether the next turn finds these blocks, never whether this one ends.
        started = time.perf_counter()
        with telemetry.span("prefill store", parent=entry.span) as span:
            try:
                await self._persist(entry)
            except Exception:
                self.counts.store_failures.inc()
                log.exception("prefill blocks not stored", request_id=entry.request_id)
                span.set_status(StatusCode.ERROR, "prefill blocks not stored")
        store_ms = (time.perf_counter() - started) * 1000
        self._drop(entry, None)
        self.counts.done.inc()
        self.counts.handoff_seconds.observe(transfer_ms / 1000)
        self.counts.job_seconds.observe(time.perf_counter() - entry.accepted_s)
        if not entry.done.done():
            timings = msgspec.structs.replace(timings, transfer_ms=transfer_ms, store_ms=store_ms)
            entry.done.set_result(PrefillDone(request_id=entry.request_id, timings=timings))

    def _trace_compute(self, entry: JobState) -> None:
        """The job's compute, from its first pass to its last, as one span (its passes were
        batched with other jobs' in the compute loop's task)."""
        if entry.first_chunk_s is None:
            return  # the restored prefix left nothing to compute
        span = telemetry.child_span(
            entry.span, "prefill compute", start_ns=telemetry.ns_ago(entry.first_chunk_s)
        )
        if span.is_recording():
            num_computed = len(entry.token_ids) - entry.num_cached_blocks * self.block_size
            compute_ms = round(entry.compute_s * 1000, 3)
            span.set_attributes(
                {"kvfabric.num_tokens": num_computed, "kvfabric.compute_ms": compute_ms}
            )
        span.end()

    # -- handoff -------------------------------------------------------------------------
    async def _send_suffix(self, entry: JobState) -> tuple[PrefillTimings, float]:
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

    async def _pin(self, entry: JobState) -> None:
        """Log the request's pins (cache_control) over the blocks this prefill stored or
        found stored: the first `num_tokens // block` blocks, at most the ones prefill
        stores (decode writes the block holding the prompt's last token, unpinned)."""
        now_ms = int(time.time() * 1000)
        for pin in entry.job.request.pins:
            num_blocks = min(pin.num_tokens // self.block_size, entry.blocks.num_prefill_blocks)
            hashes = entry.blocks.hashes[:num_blocks]
            await self.publisher.pin(hashes, now_ms + pin.ttl_s * 1000)

    async def _persist(self, entry: JobState) -> None:
        """New complete blocks to the store; the window at the last boundary to memcache.
        Runs after decode took the suffix: a failure here is logged and counted, never the
        request's."""
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
        await self._pin(entry)
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


def _queued_job(entry: JobState) -> QueuedJob:
    return QueuedJob(entry.seq.seq_id, entry.job.queue_level, entry.job.request.account)
