"""The mock prefill worker (`--engine mock`): the real worker's endpoints and messages, with
simulated compute (docs/request-flow.md; what both mock workers share: shared/serving/mock.py).

One job: "restore" the cached prefix (sleep MockCostModel's load of it, plus a bounded replay
when the router found no window snapshot) -> wait its turn -> "compute" every prompt token
but the last, in chunks under `max_batch_tokens` per simulated forward pass, each pass slept
for its simulated time -> `SuffixReady` to decode, with nothing staged (decode pulls no
bytes) -> write the new complete blocks (placeholder bytes) to the real store and log them for
kv-index, put a placeholder window snapshot at the last block boundary into swa-memcache (so
the router sees it, as it would the real one) -> `PrefillDone`.

The KV pool is only counted: a job holds ceil(n / block) pages from its first chunk until it
is done, and jobs start first come, first served while pages last. No torch, no NIXL.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field

import msgspec

from services.prefill.config import PrefillConfig
from shared.bus import Bus, Context
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
from shared.serving.kv_io import hasher_for, store_payloads
from shared.serving.mock import MockModel, sleep_simulated
from shared.testing.cost_model import MockCostModel

log = get_logger(__name__)

# swa-memcache keeps it inline; a real window's size (96 KiB for tiny-coder) is not simulated.
MOCK_SNAPSHOT_NBYTES = 1024


@dataclass(eq=False)
class _Job:
    job: PrefillJob
    token_ids: list[int]
    hasher: BlockHasher
    done: asyncio.Future[PrefillDone]
    accepted_s: float
    restored: PrefillTimings  # load_ms, restore_ms, swa_restore, num_replay_tokens
    num_cached_tokens: int  # the restored prefix: whole blocks
    num_computed_tokens: int = field(init=False)  # from the restored prefix on
    num_pages: int = 0  # of the simulated pool, held from the first chunk on
    first_chunk_s: float | None = None
    compute_s: float = 0.0
    finishing: bool = False

    def __post_init__(self) -> None:
        self.num_computed_tokens = self.num_cached_tokens

    @property
    def request_id(self) -> str:
        return self.job.request.request_id

    @property
    def target(self) -> int:
        return len(self.token_ids) - 1  # decode computes the last prompt token

    @property
    def num_left(self) -> int:
        return self.target - self.num_computed_tokens


class MockPrefillWorker:
    def __init__(
        self,
        bus: Bus,
        publisher: KvEventPublisher,
        swa: SwaClient | None,
        config: PrefillConfig,
        model: MockModel,
        cost: MockCostModel | None = None,
    ) -> None:
        self.bus = bus
        self.publisher = publisher
        self.swa = swa
        self.config = config
        self.model = model
        self.cost = cost or MockCostModel()
        self.block_size = config.kv_block_size_tokens
        self.num_kv_pages_free = config.num_kv_blocks
        self._payload = bytes(config.mock_block_nbytes)
        self._jobs: dict[str, _Job] = {}
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self._finishing: set[asyncio.Task[None]] = set()
        self.counts = {"num_jobs": 0, "num_done": 0, "num_failed": 0, "num_cancelled": 0,
                       "num_tokens_computed": 0, "num_tokens_cached": 0,
                       "num_blocks_stored": 0, "num_snapshots_put": 0}  # fmt: skip

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
            "num_kv_pages_total": self.config.num_kv_blocks,
            "num_kv_pages_free": self.num_kv_pages_free,
        }

    def counters(self) -> dict[str, int]:
        return dict(self.counts)

    # -- requests ------------------------------------------------------------------------
    async def handle_job(self, job: PrefillJob, ctx: Context) -> PrefillDone:
        request = job.request
        token_ids = self._validate(job)
        if request.request_id in self._jobs:
            raise BadRequest(f"request {request.request_id} is already being prefilled here")
        accepted_s = time.perf_counter()
        self.counts["num_jobs"] += 1
        # The last prompt token is decode's: never restore a prefix that covers it.
        num_blocks = min(job.decision.num_cached_tokens, len(token_ids) - 1) // self.block_size
        restored = await self._restore(num_blocks * self.block_size, job.decision.has_swa_snapshot)
        entry = _Job(
            job, token_ids, hasher_for(request), asyncio.get_running_loop().create_future(),
            accepted_s, restored, num_blocks * self.block_size,
        )  # fmt: skip
        self.counts["num_tokens_cached"] += entry.num_cached_tokens
        self._jobs[request.request_id] = entry
        self._wake.set()
        try:
            return await asyncio.shield(entry.done)
        except asyncio.CancelledError:  # the bus is stopping: do not leave the job behind
            self._drop(entry, Cancelled("prefill worker stopping"))
            raise

    async def _restore(self, num_cached_tokens: int, has_snapshot: bool) -> PrefillTimings:
        """Sleep the simulated store read of the prefix and the window's restore."""
        if num_cached_tokens == 0:
            return PrefillTimings(swa_restore="none")
        speedup = self.config.mock_speedup
        load_s = await sleep_simulated(self.cost.prefill_s(0, num_cached_tokens), speedup)
        num_replay = self.cost.num_replay_tokens(num_cached_tokens, has_snapshot)
        restore_s = await sleep_simulated(self.cost.prefill_s(0, 0, num_replay), speedup)
        return PrefillTimings(
            load_ms=load_s * 1000, restore_ms=restore_s * 1000,
            swa_restore="snapshot" if has_snapshot else "bounded", num_replay_tokens=num_replay,
        )  # fmt: skip

    def _validate(self, job: PrefillJob) -> list[int]:
        token_ids = checked_prompt(
            job.request, model_name=self.model.name, block_size_tokens=self.block_size,
            max_model_len=self.model.max_model_len,
        )  # fmt: skip
        if math.ceil(len(token_ids) / self.block_size) > self.config.num_kv_blocks:
            raise BadRequest(
                f"prompt of {len(token_ids)} tokens does not fit this worker's KV pool "
                f"({self.config.num_kv_blocks} pages of {self.block_size} tokens)"
            )
        return token_ids

    async def on_cancel(self, cancel: CancelRequest) -> None:
        entry = self._jobs.get(cancel.request_id)
        if entry is not None and not entry.finishing:
            self.counts["num_cancelled"] += 1
            self._drop(entry, Cancelled(f"cancelled: {cancel.reason}"))

    def _drop(self, entry: _Job, error: ServiceError | None) -> None:
        """Forget the job and free its pages; fail its handler with `error` (None: done)."""
        if self._jobs.get(entry.request_id) is entry:
            del self._jobs[entry.request_id]
            self.num_kv_pages_free += entry.num_pages
            self._wake.set()  # the head of the queue may have waited for these pages
        if error is not None and not entry.done.done():
            entry.done.set_exception(error)
            entry.done.exception()  # retrieved: the handler may already be gone

    # -- the simulated model -------------------------------------------------------------
    def _plan(self) -> list[tuple[_Job, int]]:
        budget, batch = self.config.max_batch_tokens, []
        now_ms = time.time() * 1000
        for entry in list(self._jobs.values()):
            if entry.finishing:
                continue
            deadline_ms = entry.job.request.deadline_ms
            if deadline_ms is not None and now_ms > deadline_ms:
                self._drop(entry, DeadlineExceeded("deadline passed while queued for prefill"))
                continue
            if budget == 0:
                break
            if entry.num_pages == 0:
                num_pages = math.ceil(len(entry.token_ids) / self.block_size)
                if num_pages > self.num_kv_pages_free:
                    break  # first come, first served: nobody overtakes the head
                entry.num_pages = num_pages
                self.num_kv_pages_free -= num_pages
            num_tokens = min(entry.num_left, budget)  # 0: a fully cached prompt, done at once
            batch.append((entry, num_tokens))
            budget -= num_tokens
        return batch

    async def _compute_loop(self) -> None:
        while True:
            batch = self._plan()
            if not batch:
                self._wake.clear()
                await self._wake.wait()
                continue
            started = time.perf_counter()
            num_tokens = sum(n for _, n in batch)
            elapsed_s = await sleep_simulated(
                self.cost.prefill_s(num_tokens), self.config.mock_speedup
            )
            for entry, num_tokens in batch:
                if self._jobs.get(entry.request_id) is not entry:
                    continue  # cancelled while the pass ran
                entry.first_chunk_s = entry.first_chunk_s or started
                entry.compute_s += elapsed_s
                entry.num_computed_tokens += num_tokens
                self.counts["num_tokens_computed"] += num_tokens
                if entry.num_left == 0:
                    entry.finishing = True
                    task = asyncio.create_task(self._finish(entry))
                    self._finishing.add(task)
                    task.add_done_callback(self._finishing.discard)

    # -- handoff -------------------------------------------------------------------------
    async def _finish(self, entry: _Job) -> None:
        try:
            done = PrefillDone(request_id=entry.request_id, timings=await self._handoff(entry))
        except ServiceError as exc:  # decode gone, cancelled or timed out: a typed answer
            self.counts["num_failed"] += 1
            log.warning("prefill handoff failed", request_id=entry.request_id, error=str(exc))
            self._drop(entry, exc)
            return
        except Exception as exc:
            self.counts["num_failed"] += 1
            log.exception("prefill handoff failed", request_id=entry.request_id)
            self._drop(entry, InternalError(f"prefill handoff failed: {exc}"))
            return
        self._drop(entry, None)
        self.counts["num_done"] += 1
        if not entry.done.done():
            entry.done.set_result(done)

    async def _handoff(self, entry: _Job) -> PrefillTimings:
        request, first_block = entry.job.request, entry.num_cached_tokens // self.block_size
        queue_s = (entry.first_chunk_s or time.perf_counter()) - entry.accepted_s
        timings = msgspec.structs.replace(
            entry.restored, queue_ms=queue_s * 1000, compute_ms=entry.compute_s * 1000
        )
        ready = SuffixReady(
            request_id=request.request_id, attempt=entry.job.attempt,
            prefill_worker_id=self.bus.instance_id, num_computed_tokens=entry.target,
            first_block_index=first_block, num_blocks=0,
            block_nbytes=self.config.mock_block_nbytes, region_offset=0, window_nbytes=0,
            timings=timings,
        )  # fmt: skip
        subject = self.bus.subjects.instance(
            self.bus.subjects.decode_suffix, entry.job.decision.decode_worker_id
        )
        started = time.perf_counter()
        await self.bus.request(
            subject, ready, JobAccepted, timeout_s=self.config.handoff_timeout_s,
            request_id=request.request_id, deadline_ms=request.deadline_ms,
        )  # fmt: skip
        transfer_ms = (time.perf_counter() - started) * 1000
        started = time.perf_counter()
        await self._persist(entry, first_block)
        store_ms = (time.perf_counter() - started) * 1000
        return msgspec.structs.replace(timings, transfer_ms=transfer_ms, store_ms=store_ms)

    async def _persist(self, entry: _Job, first_block: int) -> None:
        """New complete blocks to the store; a placeholder window at the last boundary."""
        end_block = entry.target // self.block_size
        payloads = [self._payload] * max(end_block - first_block, 0)
        self.counts["num_blocks_stored"] += await store_payloads(
            self.publisher, entry.token_ids, entry.hasher, first_block, payloads
        )
        if self.swa is None or not payloads:
            return  # the boundary lies in the restored prefix: its snapshot was put before
        boundary_hash = entry.hasher.hashes(entry.token_ids[: end_block * self.block_size])[-1]
        try:
            if await self.swa.put(boundary_hash, bytes(MOCK_SNAPSHOT_NBYTES)):
                self.counts["num_snapshots_put"] += 1
        except ServiceError as exc:
            log.warning("sliding-window snapshot not kept", error=str(exc))
