"""The decode worker: jobs in, token streams out (docs/request-flow.md).

`DecodeJob` (from the router): admit if the pool can hold the prompt, start reading the
cached prefix from the store at once, answer `JobAccepted`. `SuffixReady` (from prefill):
pull the staged suffix pages and window over NIXL, join the sequence to the running batch.
The batch loop (`Engine.step` in a thread, one step at a time) streams each step's tokens as
seq-numbered `TokenChunk`s with incrementally detokenized text; a finished sequence's complete
blocks (output included) go to the store and its window at the last block boundary to
swa-memcache, before the final chunk, so the agent's next turn hits its own answer. Every
accepted request ends with a `UsageRecord` on JetStream: completed, cancelled or failed.
"""

from __future__ import annotations

import asyncio
import time

import msgspec
import numpy as np
from tokenizers import Tokenizer

from services.decode.finish import Finisher
from services.decode.state import DecodeRequest, Finished
from shared.bus import Bus, Context
from shared.detokenizer import IncrementalDetokenizer
from shared.engine.engine import Engine, FinishReason, RequestError, StepOutput
from shared.engine.kv_cache import SlidingWindowState
from shared.engine.sampler import SamplingParams as EngineSampling
from shared.engine.sampler import SamplingParamsError
from shared.engine.sequence import Sequence
from shared.engine.swa_restore import snapshot_from_bytes
from shared.kvstore.transfer import ByteRange, KvTransferAgent
from shared.logging import get_logger
from shared.schema import (
    BadRequest,
    CancelRequest,
    DeadlineExceeded,
    DecodeJob,
    InternalError,
    JobAccepted,
    NotFound,
    Overloaded,
    ServiceError,
    SuffixReady,
    Unavailable,
)
from shared.serving.checks import checked_prompt
from shared.serving.kv_io import LoadedPrefix, hasher_for, load_prefix, unstage_pages
from shared.serving.staging import StagingSpace
from shared.streams import StreamWriter
from shared.subjects import PREFILL

log = get_logger(__name__)

_REASONS = {
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.ABORT: "cancelled",
}


class DecodeWorker:
    def __init__(
        self,
        bus: Bus,
        engine: Engine,
        tokenizer: Tokenizer,
        agent: KvTransferAgent,
        staging: StagingSpace,
        finisher: Finisher,
        *,
        model_name: str,
        retry_after_s: float,
        pull_timeout_s: float,
        suffix_timeout_s: float,
    ) -> None:
        self.bus = bus
        self.engine = engine
        self.runner = engine.runner
        self.tokenizer = tokenizer
        self.agent = agent
        self.buffer = agent.buffer.reshape(-1).view(np.uint8)
        self.staging = staging
        self.finisher = finisher
        self.model_name = model_name
        self.retry_after_s = retry_after_s
        self.pull_timeout_s = pull_timeout_s
        self.suffix_timeout_s = suffix_timeout_s
        self.block_size = self.runner.layout.block_size_tokens
        self.requests: dict[str, DecodeRequest] = {}
        self._by_seq: dict[int, DecodeRequest] = {}
        self._finished: dict[int, Finished] = {}
        self._engine_lock = asyncio.Lock()  # engine state changes only between steps
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self.engine.on_finish = self._on_finish

    # -- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        self._loop_task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        for request in list(self.requests.values()):
            await self._fail(request, Unavailable("decode worker stopping"))
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
        await self.finisher.drain()

    def load_fields(self) -> dict[str, int]:
        joined = sum(r.joined for r in self.requests.values())
        return {
            "num_queued": len(self.requests) - joined,
            "num_running": joined,
            "num_kv_pages_total": self.runner.allocator.num_blocks,
            "num_kv_pages_free": self.runner.allocator.num_free_blocks,
        }

    def counters(self) -> dict[str, float]:
        spec = self.engine.spec_stats
        return self.finisher.counts | {
            "num_preemptions": self.engine.num_preemptions,
            "spec_acceptance_rate": round(spec.acceptance_rate, 4),
            "spec_tokens_per_forward": round(spec.tokens_per_forward, 4),
            "spec_num_draft_tokens": spec.num_draft_tokens,
        }

    # -- DecodeJob -----------------------------------------------------------------------
    async def handle_job(self, job: DecodeJob, ctx: Context) -> JobAccepted:
        request = job.request
        token_ids = checked_prompt(
            request, model_name=self.model_name, block_size_tokens=self.block_size,
            max_model_len=self.engine.max_model_len,
        )  # fmt: skip
        if not request.stream_inbox:
            raise BadRequest("stream_inbox is required")
        if request.request_id in self.requests:
            raise BadRequest(f"request {request.request_id} is already decoding here")
        num_pages = self.runner.block_manager.num_blocks_for(len(token_ids) + 1)
        if num_pages > self.runner.allocator.num_free_blocks:
            raise Overloaded(
                f"{num_pages} KV pages needed, {self.runner.allocator.num_free_blocks} free",
                retry_after_s=self.retry_after_s,
            )
        sampling = request.sampling
        try:
            params = EngineSampling(
                temperature=sampling.temperature, top_p=sampling.top_p,
                top_k=sampling.top_k or 0, seed=sampling.seed, max_new_tokens=sampling.max_tokens,
                stop_token_ids=tuple(sampling.stop_token_ids), ignore_eos=sampling.ignore_eos,
            )  # fmt: skip
        except SamplingParamsError as exc:
            raise BadRequest(str(exc)) from exc
        state = DecodeRequest(
            job, token_ids, hasher_for(request),
            StreamWriter(self.bus, request.stream_inbox, request_id=request.request_id),
            IncrementalDetokenizer(self.tokenizer, stop=sampling.stop), params,
        )  # fmt: skip
        num_cached_blocks = min(job.decision.num_cached_tokens, len(token_ids) - 1)
        num_cached_blocks //= self.block_size
        state.prefix_task = asyncio.create_task(self._load_prefix(state, num_cached_blocks))
        self.requests[request.request_id] = state
        return JobAccepted(request_id=request.request_id, instance_id=self.bus.instance_id)

    async def _load_prefix(self, state: DecodeRequest, num_blocks: int) -> LoadedPrefix:
        started = time.perf_counter()
        prefix = await load_prefix(
            self.finisher.store, self.runner.pool, self.runner.allocator,
            state.job.cached_blocks, num_blocks,
        )  # fmt: skip
        state.prefix_load_ms = (time.perf_counter() - started) * 1000
        return prefix

    # -- SuffixReady ---------------------------------------------------------------------
    async def handle_suffix(self, ready: SuffixReady, ctx: Context) -> JobAccepted:
        state = self.requests.get(ready.request_id)
        accepted = JobAccepted(request_id=ready.request_id, instance_id=self.bus.instance_id)
        if state is None:
            raise NotFound(f"no decode job {ready.request_id} here (cancelled or timed out)")
        if state.joined:
            return accepted  # a retried prefill's duplicate: the first suffix is in use
        try:
            await self._join(state, ready)
        except ServiceError as exc:
            await self._fail(state, exc)
            raise
        except Exception as exc:
            log.exception("joining the suffix failed", request_id=ready.request_id)
            await self._fail(state, InternalError(f"joining the suffix failed: {exc}"))
            raise InternalError(f"joining the suffix failed: {exc}") from exc
        return accepted

    async def _join(self, state: DecodeRequest, ready: SuffixReady) -> None:
        assert state.prefix_task is not None
        prefix = await state.prefix_task
        allocator = self.runner.allocator
        if prefix.num_blocks < ready.first_block_index:
            allocator.free(prefix.pages)
            raise Unavailable(
                f"cached block {prefix.num_blocks} became unreadable between prefill and "
                f"decode; retry the request"
            )
        allocator.free(prefix.pages[ready.first_block_index :])  # prefill computed those
        pages = prefix.pages[: ready.first_block_index]
        try:
            suffix_pages, window, pull_ms = await self._pull(ready)
        except BaseException:
            allocator.free(pages)
            raise
        pages += suffix_pages
        state.prefill = msgspec.structs.replace(ready.timings, transfer_ms=pull_ms)
        state.num_cached_tokens = ready.first_block_index * self.block_size
        params = state.params
        async with self._engine_lock:
            try:
                if ready.num_computed_tokens == 0:
                    seq_id = self.engine.add_request(state.token_ids, params)
                else:
                    seq_id = self.engine.add_request(
                        state.token_ids, params, prefix_block_ids=pages, prefix_window=window,
                        num_prefix_tokens=ready.num_computed_tokens,
                    )  # fmt: skip
            except RequestError as exc:
                raise BadRequest(str(exc)) from exc
            finally:
                allocator.free(pages)  # the sequence holds its own reference now
        state.seq_id, state.joined = seq_id, True
        self._by_seq[seq_id] = state
        self._wake.set()

    async def _pull(self, ready: SuffixReady) -> tuple[list[int], SlidingWindowState, float]:
        """Pull the staged pages and window into our buffer, then into fresh pages."""
        nbytes = ready.num_blocks * ready.block_nbytes + ready.window_nbytes
        if ready.block_nbytes != self.runner.layout.block_nbytes:
            raise BadRequest(f"staged blocks of {ready.block_nbytes} bytes, pool pages differ")
        extent = await self.staging.allocate(nbytes, timeout_s=self.pull_timeout_s)
        try:
            started = time.perf_counter()
            await self.agent.read(
                PREFILL, ready.prefill_worker_id,
                [ByteRange(extent.offset, ready.region_offset, nbytes)],
                timeout_s=self.pull_timeout_s,
            )  # fmt: skip
            pull_ms = (time.perf_counter() - started) * 1000
            pages = self.runner.allocator.allocate(ready.num_blocks)
            unstage_pages(self.buffer, extent.offset, self.runner.pool, pages)
            start = extent.offset + ready.num_blocks * ready.block_nbytes
            snapshot = bytes(self.buffer[start : start + ready.window_nbytes])
            window = snapshot_from_bytes(self.runner.config, snapshot)
        finally:
            await self.staging.free(extent)
        return pages, window, pull_ms

    # -- cancellation and failure -------------------------------------------------------
    async def on_cancel(self, cancel: CancelRequest) -> None:
        state = self.requests.get(cancel.request_id)
        if state is None:
            return
        state.note_cancel(cancel)
        if not state.joined:
            await self._fail(state, state.error or None)
            return
        async with self._engine_lock:
            if state.seq_id is not None:
                self.engine.abort(state.seq_id)
        self._wake.set()

    async def expire(self) -> None:
        """Periodic: fail jobs whose suffix never came, and requests past their deadline."""
        now_ms = time.time() * 1000
        for state in list(self.requests.values()):
            deadline_ms = state.job.request.deadline_ms
            waited_s = time.perf_counter() - state.accepted_s
            if not state.joined and waited_s > self.suffix_timeout_s:
                await self._fail(state, Unavailable(f"no prefill result in {waited_s:.0f}s"))
            elif deadline_ms is not None and now_ms > deadline_ms:
                state.cancel_reason = "deadline"
                state.error = DeadlineExceeded("deadline passed while decoding")
                if state.joined and state.seq_id is not None:
                    async with self._engine_lock:
                        self.engine.abort(state.seq_id)
                    self._wake.set()
                else:
                    await self._fail(state, state.error)

    async def _fail(self, state: DecodeRequest, error: ServiceError | None) -> None:
        """End a request that is not in the batch (or leave the batch first)."""
        if self.requests.pop(state.request_id, None) is None:
            return
        if state.prefix_task is not None and not state.joined:
            state.prefix_task.cancel()
            prefix = await asyncio.gather(state.prefix_task, return_exceptions=True)
            if not isinstance(prefix[0], BaseException):
                self.runner.allocator.free(prefix[0].pages)
        if state.joined and state.seq_id is not None:
            async with self._engine_lock:
                self.engine.abort(state.seq_id)
            self._by_seq.pop(state.seq_id, None)
            self._finished.pop(state.seq_id, None)
        await self.finisher.end(state, None, error)

    # -- the batch loop ------------------------------------------------------------------
    def _on_finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Engine callback (step thread): copy what the store needs before pages are freed."""
        state = self._by_seq.get(seq.seq_id)
        if state is None:
            return
        first = (state.num_prompt_tokens - 1) // self.block_size  # prefill wrote the ones before
        end = seq.num_computed_tokens // self.block_size
        pool = self.runner.pool
        blocks = [(i, bytes(pool.block_view(seq.block_table[i]))) for i in range(first, end)]
        self._finished[seq.seq_id] = Finished(
            _REASONS[reason], list(seq.token_ids), blocks, seq.boundary_window
        )

    async def _loop(self) -> None:
        while True:
            if not self.engine.has_unfinished():
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                async with self._engine_lock:
                    outputs = await asyncio.to_thread(self.engine.step)
            except Exception as exc:
                log.exception("decode step failed")
                for state in list(self._by_seq.values()):
                    await self._fail(state, InternalError(f"decode step failed: {exc}"))
                continue
            for out in outputs:
                state = self._by_seq.get(out.seq_id)
                if state is not None:
                    await self._emit(state, out)

    async def _emit(self, state: DecodeRequest, out: StepOutput) -> None:
        token_ids = list(out.new_token_ids)
        text = state.record_output(token_ids)
        stopped_by_string = state.detokenizer.stopped and not out.finished
        if not out.finished and not stopped_by_string:
            if token_ids:
                await self.finisher.send(state, token_ids, text)
            return
        if stopped_by_string:  # a stop string ended it: leave the batch now
            async with self._engine_lock:
                self.engine.abort(out.seq_id)
        finished = self._finished.pop(out.seq_id, None)
        self._by_seq.pop(out.seq_id, None)
        self.requests.pop(state.request_id, None)
        if out.spec_stats is not None:
            state.num_draft_tokens = out.spec_stats.num_draft_tokens
            state.num_accepted_draft_tokens = out.spec_stats.num_accepted_tokens
        if finished is not None and stopped_by_string:
            finished.reason = "stop"
        await self.finisher.end(state, finished, state.error, token_ids, text)
