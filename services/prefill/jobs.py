"""What the model's prefill worker (worker.py) and the mock one (mock_worker.py) share: the
table of jobs in flight and everything around it that does not depend on the engine.

A `PrefillJob`'s handler waits on a future from its arrival until `PrefillDone` (or its
typed error). In between, both workers validate it the same way, cut the same chunks under
`max_batch_tokens` per forward pass, drop it the same way (cancelled, past its deadline, the
bus stopping, a failed pass), hand it off the same way (handoff.py) and report the same load
fields and metrics (metrics.py) -- one copy, so the mock's timings, errors and load reports
cannot drift from the model's. What differs is what a worker overrides: what admitting a job
costs (`_admit`: restoring the prefix), what a job holds (`_release`), which chunks the next
pass computes (`_schedule`: the model's engine scheduler, or the mock's count of pages), what
a forward pass is (`_forward`, `_advance`), what is staged for
decode (`_send_suffix`), what is written to the store (`_persist`) and the KV pool
(`kv_pages`).

No torch here: the mock worker runs this without it.
"""

from __future__ import annotations

import asyncio
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar, Generic, TypeVar

import msgspec
from opentelemetry.trace import INVALID_SPAN, Span, StatusCode

from services.prefill.metrics import PrefillMetrics
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
)
from shared.subjects import PREFILL
from shared.tasks import cancel_and_wait
from worker.kvstore.writer import KvEventPublisher
from worker.serving.checks import checked_prompt
from worker.swa_client import SwaClient

log = get_logger(__name__)


@dataclass(eq=False)
class JobState(ABC):
    """One job from its arrival to its reply; a worker adds what its engine needs."""

    job: PrefillJob
    token_ids: list[int]
    blocks: RequestBlocks  # the prompt's block layout, from the request
    done: asyncio.Future[PrefillDone]
    accepted_s: float
    restored: PrefillTimings  # load_ms, restore_ms, swa_restore, num_replay_tokens
    num_cached_blocks: int  # the restored prefix: the first block this worker computes
    first_chunk_s: float | None = field(default=None, kw_only=True)
    compute_s: float = field(default=0.0, kw_only=True)
    finishing: bool = field(default=False, kw_only=True)  # computed: being handed off
    # The job's span (the bus's, of the `run` endpoint): the parent of the steps that run in the
    # compute loop's and the handoff's tasks.
    span: Span = field(default=INVALID_SPAN, kw_only=True)
    # The first output token, sampled once the whole prompt is computed, and the sampler's
    # state after it (b"": greedy); None where decode computes the last prompt token.
    first_token_id: int | None = field(default=None, kw_only=True)
    sampler_state: bytes = field(default=b"", kw_only=True)
    # Whether this worker computes the last prompt token and samples the first output token
    # (the model's worker), or leaves that token to decode (the mock).
    SAMPLES_FIRST_TOKEN: ClassVar[bool] = False

    @property
    def request_id(self) -> str:
        return self.job.request.request_id

    @property
    def target(self) -> int:
        """Prompt tokens this worker computes: all, or all but the last (decode's)."""
        return len(self.token_ids) - (0 if self.SAMPLES_FIRST_TOKEN else 1)

    @property
    @abstractmethod
    def num_left(self) -> int:
        """Prompt tokens still to compute, up to `target`."""

    def timings(self) -> PrefillTimings:
        """The restore's times with the queue and compute times so far."""
        queue_s = (self.first_chunk_s or time.perf_counter()) - self.accepted_s
        return msgspec.structs.replace(
            self.restored, queue_ms=queue_s * 1000, compute_ms=self.compute_s * 1000
        )


JobT = TypeVar("JobT", bound=JobState)


class PrefillJobsBase(ABC, Generic[JobT]):
    def __init__(
        self,
        bus: Bus,
        publisher: KvEventPublisher,
        swa: SwaClient | None,
        *,
        model_name: str,
        max_model_len: int,
        block_size_tokens: int,
        max_batch_tokens: int,
        handoff_timeout_s: float,
        metrics: Metrics | None = None,  # the process's (a test's own when None)
    ) -> None:
        self.bus = bus
        self.publisher = publisher
        self.swa = swa
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.block_size = block_size_tokens
        self.max_batch_tokens = max_batch_tokens
        self.handoff_timeout_s = handoff_timeout_s
        self._jobs: dict[str, JobT] = {}
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

    @abstractmethod
    def kv_pages(self) -> tuple[int, int]:
        """The KV pool's pages: (total, free)."""

    def load_fields(self) -> dict[str, int | str]:
        computing = [j for j in self._jobs.values() if not j.finishing]
        num_pages_total, num_pages_free = self.kv_pages()
        return {
            "num_queued": len(computing),
            "num_queued_tokens": sum(j.num_left for j in computing),
            "num_running": len(self._jobs),
            "num_kv_pages_total": num_pages_total,
            "num_kv_pages_free": num_pages_free,
            "model": self.model_name,
            "num_devices": 1,
        }

    # -- requests ------------------------------------------------------------------------
    async def handle_job(self, job: PrefillJob, ctx: Context) -> PrefillDone:
        request = job.request
        token_ids, blocks = self._validate(job)
        if request.request_id in self._jobs:
            raise BadRequest(f"request {request.request_id} is already being prefilled here")
        accepted_s = time.perf_counter()
        self.counts.jobs_received.inc()
        num_cached_blocks = blocks.num_reusable_blocks(job.decision.num_cached_blocks)
        entry = await self._admit(job, token_ids, blocks, num_cached_blocks, accepted_s)
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

    def _validate(self, job: PrefillJob) -> tuple[list[int], RequestBlocks]:
        token_ids, blocks = checked_prompt(
            job.request,
            model_name=self.model_name,
            block_size_tokens=self.block_size,
            max_model_len=self.max_model_len,
        )
        num_pages_total = self.kv_pages()[0]
        if -(-len(token_ids) // self.block_size) > num_pages_total:
            raise BadRequest(
                f"prompt of {len(token_ids)} tokens does not fit this worker's KV pool "
                f"({num_pages_total} pages of {self.block_size} tokens)"
            )
        return token_ids, blocks

    @abstractmethod
    async def _admit(
        self,
        job: PrefillJob,
        token_ids: list[int],
        blocks: RequestBlocks,
        num_cached_blocks: int,
        accepted_s: float,
    ) -> JobT:
        """Restore up to `num_cached_blocks` of the prefix; the job, not yet queued."""

    def _enqueue(self, entry: JobT) -> None:
        self._jobs[entry.request_id] = entry
        self._wake.set()

    async def on_cancel(self, cancel: CancelRequest) -> None:
        entry = self._jobs.get(cancel.request_id)
        if entry is not None and not entry.finishing:
            self.counts.cancelled.inc()
            self._drop(entry, Cancelled(f"cancelled: {cancel.reason}"))

    def _drop(self, entry: JobT, error: ServiceError | None) -> None:
        """Forget the job and free what it holds; fail its handler with `error` (None: done)."""
        if self._jobs.get(entry.request_id) is entry:
            del self._jobs[entry.request_id]
            self._release(entry)
        if error is not None and not entry.done.done():
            entry.done.set_exception(error)
            entry.done.exception()  # retrieved: the handler may already be gone

    @abstractmethod
    def _release(self, entry: JobT) -> None:
        """Free the KV pages the job holds (once: it has just left the table)."""

    # -- the compute loop ----------------------------------------------------------------
    def _plan(self) -> list[tuple[JobT, int]]:
        """The next forward pass, after dropping the jobs past their deadline."""
        now_ms = time.time() * 1000
        for entry in list(self._jobs.values()):
            deadline_ms = entry.job.request.deadline_ms
            if entry.finishing or deadline_ms is None or now_ms <= deadline_ms:
                continue
            self.counts.expired.inc()
            self._drop(entry, DeadlineExceeded("deadline passed while queued for prefill"))
        return self._schedule()

    @abstractmethod
    def _schedule(self) -> list[tuple[JobT, int]]:
        """The next forward pass over the jobs still computing: (job, tokens), at most
        `max_batch_tokens` in all; [] when none can run."""

    @abstractmethod
    async def _forward(self, batch: list[tuple[JobT, int]]) -> float:
        """One forward pass over `batch`; returns the seconds it took."""

    def _advance(self, entry: JobT, num_tokens: int) -> None:
        """After a pass computed `num_tokens` more of `entry`."""

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
    def _start_finish(self, entry: JobT) -> None:
        entry.finishing = True
        task = asyncio.create_task(self._finish(entry))
        self._finishing.add(task)
        task.add_done_callback(self._finishing.discard)

    async def _finish(self, entry: JobT) -> None:
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

    def _trace_compute(self, entry: JobT) -> None:
        """The job's compute, from its first pass to its last, as one span (its passes were
        batched with other jobs' in the compute loop's task)."""
        if entry.first_chunk_s is None:
            return  # the restored prefix left nothing to compute
        span = telemetry.child_span(
            entry.span, "prefill compute", start_ns=telemetry.ns_ago(entry.first_chunk_s)
        )
        if span.is_recording():
            num_computed = entry.target - entry.num_cached_blocks * self.block_size
            compute_ms = round(entry.compute_s * 1000, 3)
            span.set_attributes(
                {"kvfabric.num_tokens": num_computed, "kvfabric.compute_ms": compute_ms}
            )
        span.end()

    @abstractmethod
    async def _send_suffix(self, entry: JobT) -> tuple[PrefillTimings, float]:
        """Stage the suffix and `tell_decode` (handoff.py); returns the timings sent and the
        milliseconds until decode answered."""

    @abstractmethod
    async def _persist(self, entry: JobT) -> None:
        """New complete blocks to the store; the window at the last boundary to memcache.
        Runs after decode took the suffix: a failure here is logged and counted, never the
        request's."""
