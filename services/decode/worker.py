"""The decode worker: jobs in, token streams out (docs/request-flow.md).

`DecodeJob` (from the router): admit if the pool can hold the prompt, start reading the
cached prefix from the store at once, answer `JobAccepted`. `SuffixReady` (from prefill):
pull the staged suffix pages and window over NIXL, join the sequence to the running batch;
the first output token, which prefill sampled, leaves before the batch's next forward.
The batch loop (`Engine.step` in a thread, one step at a time) streams each step's tokens as
seq-numbered `TokenChunk`s with incrementally detokenized text; a finished sequence's complete
blocks (output included) go to the store and its window at the last block boundary to
swa-memcache, before the final chunk, so the agent's next turn hits its own answer. Every
accepted request ends with a `UsageRecord` on JetStream: completed, cancelled or failed.
Admission, cancellation, deadlines and the stream's path are in jobs.py, shared with the mock
worker; this module is what runs on the model: the prefix load, the NIXL pull, the engine.
"""

from __future__ import annotations

import asyncio
import time

import msgspec
import numpy as np
from tokenizers import Tokenizer

from services.decode.finish import Finisher
from services.decode.jobs import DecodeJobsBase
from services.decode.state import STREAM_FINISH_REASONS, DecodeRequest, Finished
from shared import telemetry
from shared.bus import Bus
from shared.schema import BadRequest, SamplingParams, SuffixReady, Unavailable
from shared.subjects import PREFILL
from worker.engine.engine import Engine, FinishReason, RequestError, StepOutput
from worker.engine.kv_cache import SlidingWindowState
from worker.engine.sampler import SamplingParams as EngineSampling
from worker.engine.sequence import Sequence
from worker.engine.swa_restore import snapshot_from_bytes, snapshot_to_bytes
from worker.engine.worker import ModelThread
from worker.serving.pages import LoadedPrefix, tag_blocks, take_prefix, unstage_pages
from worker.serving.sampling import engine_sampling
from worker.serving.staging import StagingSpace
from worker.transfer import ByteRange, KvTransferAgent


class DecodeWorker(DecodeJobsBase[Engine, StepOutput]):
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
        model_thread: ModelThread,
    ) -> None:
        super().__init__(
            bus,
            engine,
            tokenizer,
            finisher,
            model_name=model_name,
            max_model_len=engine.max_model_len,
            block_size_tokens=engine.runner.layout.block_size_tokens,
            retry_after_s=retry_after_s,
            suffix_timeout_s=suffix_timeout_s,
        )
        self.runner = engine.runner
        self.agent = agent
        self.buffer = agent.buffer.reshape(-1).view(np.uint8)
        self.staging = staging
        self.pull_timeout_s = pull_timeout_s
        self.model_thread = model_thread
        self._finished: dict[int, Finished] = {}
        # request id -> the read of its cached prefix, started at admission, awaited at join
        self._prefix_loads: dict[str, asyncio.Task[LoadedPrefix]] = {}
        self._engine_lock = asyncio.Lock()  # engine state changes only between steps
        # The request being added to the engine: its first token (sampled by prefill) may
        # end it inside `add_request`, before it is in `_by_seq` (see `_on_finish`).
        self._joining: DecodeRequest | None = None
        self.engine.on_finish = self._on_finish
        self.counts.observe_engine(engine)

    def kv_pages(self) -> tuple[int, int]:
        return self.runner.allocator.num_blocks, self.runner.allocator.num_free_blocks

    # -- DecodeJob -----------------------------------------------------------------------
    def _pages_to_admit(self, num_prompt_tokens: int, sampling: SamplingParams) -> int:
        """The prompt and the first token; later ones may preempt, as the engine schedules."""
        return self.runner.block_manager.num_blocks_for(num_prompt_tokens + 1)

    def _sampling_params(self, sampling: SamplingParams) -> EngineSampling:
        return engine_sampling(sampling)

    def _admit(self, state: DecodeRequest, num_pages: int) -> None:
        """Start reading the cached prefix now, and connect to the prefill worker if this is
        our first job from it: both overlap prefill's compute."""
        prefill_worker_id = state.job.decision.prefill_worker_id
        if prefill_worker_id:
            self.agent.connect_soon(PREFILL, prefill_worker_id)
        num_cached_blocks = state.blocks.num_reusable_blocks(state.job.decision.num_cached_blocks)
        self._prefix_loads[state.request_id] = asyncio.create_task(
            self._load_prefix(state, num_cached_blocks)
        )

    async def _load_prefix(self, state: DecodeRequest, num_blocks: int) -> LoadedPrefix:
        if num_blocks == 0:
            return LoadedPrefix([])
        started = time.perf_counter()
        with telemetry.span("decode load", parent=state.span):
            prefix = await take_prefix(
                self.finisher.store,
                self.runner.pool,
                self.runner.allocator,
                state.job.cached_blocks,
                state.blocks.hashes,
                num_blocks,
            )
        state.prefix_load_ms = (time.perf_counter() - started) * 1000
        return prefix

    # -- SuffixReady ---------------------------------------------------------------------
    async def _join(self, state: DecodeRequest, ready: SuffixReady) -> int:
        prefix = await self._prefix_loads.pop(state.request_id)
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
            with telemetry.span("decode pull") as span:
                suffix_pages, window, pull_ms = await self._pull(ready)
                if span.is_recording():
                    nbytes = ready.num_blocks * ready.block_nbytes + ready.window_nbytes
                    span.set_attributes(
                        {
                            "kvfabric.prefill_worker_id": ready.prefill_worker_id,
                            "kvfabric.num_blocks": ready.num_blocks,
                            "kvfabric.bytes": nbytes,
                        }
                    )
        except BaseException:
            allocator.free(pages)
            raise
        pages += suffix_pages
        state.prefill = msgspec.structs.replace(ready.timings, transfer_ms=pull_ms)
        state.num_cached_tokens = ready.first_block_index * self.block_size
        params = state.params
        async with self._engine_lock:
            self._joining = state
            try:
                if ready.num_computed_tokens == 0:
                    seq_id = self.engine.add_request(state.token_ids, params)
                else:
                    seq_id = self.engine.add_request(
                        state.token_ids,
                        params,
                        prefix_block_ids=pages,
                        prefix_window=window,
                        num_prefix_tokens=ready.num_computed_tokens,
                        first_token_id=ready.first_token_id,
                        sampler_state=ready.sampler_state,
                    )
            except RequestError as exc:
                raise BadRequest(str(exc)) from exc
            finally:
                self._joining = None
                allocator.free(pages)  # the sequence holds its own reference now
        return seq_id

    async def _pull(self, ready: SuffixReady) -> tuple[list[int], SlidingWindowState, float]:
        """Pull the staged pages and window into our buffer, then into fresh pages."""
        nbytes = ready.num_blocks * ready.block_nbytes + ready.window_nbytes
        if ready.block_nbytes != self.runner.layout.block_nbytes:
            raise BadRequest(f"staged blocks of {ready.block_nbytes} bytes, pool pages differ")
        extent = await self.staging.allocate(nbytes, timeout_s=self.pull_timeout_s)
        try:
            started = time.perf_counter()
            await self.agent.read(
                PREFILL,
                ready.prefill_worker_id,
                [ByteRange(extent.offset, ready.region_offset, nbytes)],
                timeout_s=self.pull_timeout_s,
            )
            pull_ms = (time.perf_counter() - started) * 1000
            self.counts.transfer_bytes.inc(nbytes)
            self.counts.transfer_seconds.observe(pull_ms / 1000)
            pages = self.runner.allocator.allocate(ready.num_blocks)
            unstage_pages(self.buffer, extent.offset, self.runner.pool, pages)
            start = extent.offset + ready.num_blocks * ready.block_nbytes
            if ready.window_nbytes:
                snapshot = bytes(self.buffer[start : start + ready.window_nbytes])
                window = snapshot_from_bytes(self.runner.config, snapshot)
            else:  # a model without sliding layers: no window was staged
                window = self.runner.empty_window(ready.num_computed_tokens)
        finally:
            await self.staging.free(extent)
        return pages, window, pull_ms

    # -- cancellation, the batch loop ---------------------------------------------------
    async def _abort_seq(self, seq_id: int) -> None:
        async with self._engine_lock:
            self.engine.abort(seq_id)

    async def _release(self, state: DecodeRequest) -> None:
        load = self._prefix_loads.pop(state.request_id, None)
        if load is not None:  # never joined: the prefix read is ours to stop and free
            load.cancel()
            prefix = await asyncio.gather(load, return_exceptions=True)
            if not isinstance(prefix[0], BaseException):
                self.runner.allocator.free(prefix[0].pages)
        if state.seq_id is not None:
            self._finished.pop(state.seq_id, None)  # filled by the abort's _on_finish

    def _on_finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Engine callback (step thread): copy what the store needs before pages are freed."""
        state = self._by_seq.get(seq.seq_id) or self._joining
        if state is None:
            return
        first = state.blocks.num_prefill_blocks  # prefill wrote the ones before
        end = seq.num_computed_tokens // self.block_size
        pool = self.runner.pool
        blocks = [(i, bytes(pool.block_view(seq.block_table[i]))) for i in range(first, end)]
        # Prompt and answer stay in the pool by hash: the agent's next turn, routed here,
        # takes its prefix from there before the store (`_load_prefix`).
        tag_blocks(self.runner.allocator, seq.block_table, state.blocks.extend(seq.token_ids, end))
        window = seq.boundary_window
        at_last_block = window is not None and window.end_position == end * self.block_size
        has_window = at_last_block and bool(self.runner.config.sliding_layer_ids)
        snapshot = snapshot_to_bytes(window) if has_window and blocks else None
        self._finished[seq.seq_id] = Finished(
            STREAM_FINISH_REASONS[reason], list(seq.token_ids), blocks, snapshot
        )

    async def _step(self) -> list[StepOutput]:
        async with self._engine_lock:
            # A joined request's first token (prefill sampled it) leaves before the next
            # forward, not after it.
            return self.engine.take_pending() or await self.model_thread.run(self.engine.step)

    def _take_finished(
        self, state: DecodeRequest, out: StepOutput, stopped_by_string: bool
    ) -> Finished | None:
        finished = self._finished.pop(out.seq_id, None)
        if out.spec_stats is not None:
            state.num_draft_tokens = out.spec_stats.num_draft_tokens
            state.num_accepted_draft_tokens = out.spec_stats.num_accepted_tokens
        if finished is not None and stopped_by_string:
            finished.reason = "stop"
        return finished
