"""The decode worker: jobs in, token streams out (docs/request-flow.md).

`DecodeJob` (from the router): admit if the pool can hold the prompt (`Overloaded`
otherwise), start reading the cached prefix from the store at once, answer `JobAccepted`.
`SuffixReady` (from prefill): pull the staged suffix pages and window over NIXL, join the
sequence to the running batch; the first output token, which prefill sampled, leaves before
the batch's next forward. The batch loop (`Engine.step` in a thread, one step at a time)
streams each step's tokens as seq-numbered `TokenChunk`s with incrementally detokenized text;
a finished sequence's complete blocks (output included) go to the store and its window at
the last block boundary to swa-memcache, before the final chunk (finish.py), so the agent's
next turn hits its own answer. A request also ends when it is cancelled, waits too long for
its suffix, passes its deadline or its step fails. Every accepted request ends with a
`UsageRecord` on JetStream: completed, cancelled or failed. The engine's model is the
checkpoint's, or the mock's simulated one (`--engine mock`): the same code runs either way.
"""

from __future__ import annotations

import asyncio
import time

import msgspec
import numpy as np
from tokenizers import Tokenizer

from services.decode.finish import Finisher
from services.decode.state import STREAM_FINISH_REASONS, DecodeRequest, Finished
from shared import telemetry
from shared.bus import Bus, Context
from shared.logging import get_logger
from shared.schema import (
    BadRequest,
    Cancelled,
    CancelRequest,
    DecodeJob,
    InternalError,
    JobAccepted,
    NotFound,
    Overloaded,
    ServiceError,
    SuffixReady,
    Unavailable,
)
from shared.streams import StreamWriter
from shared.subjects import PREFILL
from shared.tasks import cancel_and_wait
from worker.engine.engine import Engine, FinishReason, RequestError, StepOutput
from worker.engine.kv_cache import SlidingWindowState
from worker.engine.sequence import Sequence
from worker.engine.swa_restore import snapshot_from_bytes, snapshot_to_bytes
from worker.engine.worker import ModelThread
from worker.serving.checks import checked_prompt
from worker.serving.lifecycle import send_tokens, stream_detokenizer
from worker.serving.pages import LoadedPrefix, tag_blocks, take_prefix, unstage_pages
from worker.serving.sampling import engine_sampling
from worker.serving.staging import StagingSpace
from worker.transfer import ByteRange, KvTransferAgent

log = get_logger(__name__)


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
        model_thread: ModelThread,
        write_through: bool = True,
    ) -> None:
        self.bus = bus
        self.write_through = write_through
        self.engine = engine
        self.runner = engine.runner
        self.tokenizer = tokenizer
        self.finisher = finisher
        self.counts = finisher.counts  # the worker's metrics, its endings' among them
        self.model_name = model_name
        self.max_model_len = engine.max_model_len
        self.block_size = engine.runner.layout.block_size_tokens
        self.retry_after_s = retry_after_s
        self.suffix_timeout_s = suffix_timeout_s
        self.agent = agent
        self.buffer = agent.buffer.reshape(-1).view(np.uint8)
        self.staging = staging
        self.pull_timeout_s = pull_timeout_s
        self.model_thread = model_thread
        self.requests: dict[str, DecodeRequest] = {}
        self._by_seq: dict[int, DecodeRequest] = {}
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self._finished: dict[int, Finished] = {}
        # request id -> the read of its cached prefix, started at admission, awaited at join
        self._prefix_loads: dict[str, asyncio.Task[LoadedPrefix]] = {}
        self._engine_lock = asyncio.Lock()  # engine state changes only between steps
        # The request being added to the engine: its first token (sampled by prefill) may
        # end it inside `add_request`, before it is in `_by_seq` (see `_on_finish`).
        self._joining: DecodeRequest | None = None
        self.engine.on_finish = self._on_finish
        self.counts.observe_engine(engine)

    # -- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        self._loop_task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        for state in list(self.requests.values()):
            await self._fail(state, Unavailable("decode worker stopping"))
        await cancel_and_wait(self._loop_task)
        await self.finisher.drain()

    def load_fields(self) -> dict[str, int | str]:
        joined = sum(r.joined for r in self.requests.values())
        allocator = self.runner.allocator
        return {
            "num_queued": len(self.requests) - joined,
            "num_running": joined,
            "num_kv_pages_total": allocator.num_blocks,
            "num_kv_pages_free": allocator.num_free_blocks,
            "model": self.model_name,
            "num_devices": 1,
        }

    # -- DecodeJob -----------------------------------------------------------------------
    async def handle_job(self, job: DecodeJob, ctx: Context) -> JobAccepted:
        request = job.request
        token_ids, blocks = checked_prompt(
            request,
            model_name=self.model_name,
            block_size_tokens=self.block_size,
            max_model_len=self.max_model_len,
            vocab_size=self.runner.config.vocab_size,
        )
        if not request.stream_inbox:
            raise BadRequest("stream_inbox is required")
        held = self.requests.get(request.request_id)
        if held is not None:
            if request.failover_attempt <= held.job.request.failover_attempt:
                raise BadRequest(f"request {request.request_id} is already decoding here")
            await self._supersede(held)
        sampling = request.sampling
        params = engine_sampling(sampling)  # BadRequest for what the sampler cannot do
        # The prompt and the first token; later ones may preempt, as the engine schedules.
        num_pages = self.runner.block_manager.num_blocks_for(len(token_ids) + 1)
        num_pages_free = self.runner.allocator.num_free_blocks
        if num_pages > num_pages_free:
            raise Overloaded(
                f"{num_pages} KV pages needed, {num_pages_free} free",
                retry_after_s=self.retry_after_s,
            )
        state = DecodeRequest(
            job,
            token_ids,
            StreamWriter(self.bus, request.stream_inbox, request_id=request.request_id),
            stream_detokenizer(self.tokenizer, request, token_ids),
            params,
            blocks,
        )
        state.num_blocks_written = blocks.num_prefill_blocks  # prefill writes those
        state.span = telemetry.current_span()
        self._admit(state)
        self.requests[request.request_id] = state
        return JobAccepted(request_id=request.request_id, instance_id=self.bus.instance_id)

    def _admit(self, state: DecodeRequest) -> None:
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
                host=self.runner.host_tier,
            )
        state.prefix_load_ms = (time.perf_counter() - started) * 1000
        return prefix

    # -- SuffixReady ---------------------------------------------------------------------
    async def handle_suffix(self, ready: SuffixReady, ctx: Context) -> JobAccepted:
        state = self.requests.get(ready.request_id)
        accepted = JobAccepted(request_id=ready.request_id, instance_id=self.bus.instance_id)
        if state is None:
            raise NotFound(f"no decode job {ready.request_id} here (cancelled or timed out)")
        if state.joined:
            return accepted  # a resend whose first answer was lost, or a retried prefill's
        if state.join_done is not None:
            # A retried prefill's, while the first suffix is still being pulled (from a
            # prefill killed after it sent it), is answered at once: it must not join again,
            # the prefix it would take is already taken. The same prefill's resend (its first
            # answer late or lost) is answered once that pull is done: its staged region is
            # being read until then.
            if state.joining_from == (ready.prefill_worker_id, ready.attempt):
                await asyncio.shield(state.join_done)
            return accepted
        state.joining_from = (ready.prefill_worker_id, ready.attempt)
        done = state.join_done = asyncio.get_running_loop().create_future()
        try:
            await self._join_suffix(state, ready)
        except Exception as exc:
            failed = InternalError("joining the suffix failed")
            _settle(done, exc if isinstance(exc, ServiceError) else failed)
            raise
        except asyncio.CancelledError:
            _settle(done, Cancelled(f"decode job {ready.request_id} ended while joining"))
            raise
        _settle(done, None)
        return accepted

    async def _join_suffix(self, state: DecodeRequest, ready: SuffixReady) -> None:
        try:
            seq_id = await self._join(state, ready)
        except ServiceError as exc:
            await self._fail(state, exc)
            raise
        except Exception:
            # The caller's stream ends with a code and a safe message; the bus logs the
            # trace (once) and answers prefill INTERNAL.
            await self._fail(state, InternalError("joining the suffix failed"))
            raise
        if self.requests.get(ready.request_id) is not state:
            # Cancelled (or expired) while its suffix was being pulled: it was ended then,
            # so the sequence just added must not run. Left running, its tokens went to a
            # finished stream and the error killed the batch loop (a storm of client
            # disconnects on hosts apart, where the pull takes long enough, found it).
            await self._abort_seq(seq_id)  # its ABORT output finds no state: skipped
            raise Cancelled(f"decode job {ready.request_id} ended while joining")
        state.seq_id, state.joined = seq_id, True
        state.generate_span = telemetry.child_span(state.span, "decode generate")
        self._by_seq[seq_id] = state
        self._wake.set()

    async def _join(self, state: DecodeRequest, ready: SuffixReady) -> int:
        """Add the request's sequence to the engine, its prompt computed up to n - 1, or
        all n with its first output token (`ready.first_token_id`); returns its seq id."""
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

    # -- cancellation and failure -------------------------------------------------------
    async def on_cancel(self, cancel: CancelRequest) -> None:
        state = self.requests.get(cancel.request_id)
        if state is None:
            return
        state.note_cancel(cancel)
        await self._abort(state, state.error)

    async def expire(self) -> None:
        """Periodic: fail jobs whose suffix never came, and requests past their deadline."""
        for state in list(self.requests.values()):
            waited_s = time.perf_counter() - state.accepted_s
            if not state.joined and waited_s > self.suffix_timeout_s:
                await self._fail(state, Unavailable(f"no prefill result in {waited_s:.0f}s"))
            elif state.seconds_left() == 0:
                state.expire("decoding")
                await self._abort(state, state.error)

    async def _abort(self, state: DecodeRequest, error: ServiceError | None) -> None:
        """In the batch: abort, and the loop ends it with what it produced; else end it now."""
        if state.joined and state.seq_id is not None:
            await self._abort_seq(state.seq_id)
            self._wake.set()
        else:
            await self._fail(state, error)

    async def _fail(self, state: DecodeRequest, error: ServiceError | None) -> None:
        """End a request at once, in the batch or not (None: finish_reason cancelled)."""
        if self.requests.pop(state.request_id, None) is None:
            return
        if state.seq_id is not None:
            await self._abort_seq(state.seq_id)
            self._by_seq.pop(state.seq_id, None)
        await self._release(state)
        await self.finisher.end(state, None, error)

    async def _supersede(self, held: DecodeRequest) -> None:
        """A failover's continuation reached the worker still holding the attempt it
        continues (alive, but cut off from its caller for a while): the older attempt ends
        here without a word. Its stream's reader is gone, and the continuation's usage
        record bills the whole request, so this one writes neither."""
        if self.requests.pop(held.request_id, None) is None:
            return
        if held.seq_id is not None:
            await self._abort_seq(held.seq_id)
            self._by_seq.pop(held.seq_id, None)
        await self._release(held)
        log.info(
            "superseded by a continuation",
            request_id=held.request_id,
            attempt=held.job.request.failover_attempt,
        )

    async def _abort_seq(self, seq_id: int) -> None:
        """Take the sequence out of the engine's batch; its pages are freed at once."""
        async with self._engine_lock:
            self.engine.abort(seq_id)

    async def _release(self, state: DecodeRequest) -> None:
        """Free what the request still holds once it has left the table and the batch."""
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
        end = seq.num_computed_tokens // self.block_size
        blocks, snapshot = self._new_blocks(state, seq, end)
        # Prompt and answer stay in the pool by hash: the agent's next turn, routed here,
        # takes its prefix from there before the store (`_load_prefix`).
        tag_blocks(self.runner.allocator, seq.block_table, state.blocks.extend(seq.token_ids, end))
        self._finished[seq.seq_id] = Finished(
            STREAM_FINISH_REASONS[reason], list(seq.token_ids), blocks, snapshot
        )

    def _new_blocks(
        self, state: DecodeRequest, seq: Sequence, end: int
    ) -> tuple[list[tuple[int, bytes]], bytes | None]:
        """Copies of the sequence's full blocks not yet written (prefill wrote the prompt's,
        write-through the ones filled since) up to block `end`, and its window snapshot at
        that boundary when the model has sliding layers and the engine kept it there."""
        first = state.num_blocks_written
        pool = self.runner.pool
        blocks = [(i, bytes(pool.block_view(seq.block_table[i]))) for i in range(first, end)]
        window = seq.boundary_window
        at_last_block = window is not None and window.end_position == end * self.block_size
        has_window = at_last_block and bool(self.runner.config.sliding_layer_ids)
        snapshot = snapshot_to_bytes(window) if has_window and blocks else None
        state.num_blocks_written = max(first, end)
        return blocks, snapshot

    def _write_through(self, state: DecodeRequest, seq_id: int) -> None:
        """Between steps: send each block the sequence filled to the store (and its window
        at that boundary to swa-memcache) now, not at the end, so that if this worker dies
        the request continues elsewhere from there instead of recomputing its context."""
        seq = self.engine.sequence(seq_id)
        if seq is None:
            return
        end = seq.num_computed_tokens // self.block_size
        if end <= state.num_blocks_written:
            return
        blocks, snapshot = self._new_blocks(state, seq, end)
        state.blocks.extend(seq.token_ids, end)  # here, not in the write's task: see extend
        self.finisher.write_through(
            state, list(seq.token_ids[: end * self.block_size]), blocks, snapshot
        )

    # -- the batch loop ------------------------------------------------------------------
    async def _step(self) -> list[StepOutput]:
        async with self._engine_lock:
            # A joined request's first token (prefill sampled it) leaves before the next
            # forward, not after it.
            return self.engine.take_pending() or await self.model_thread.run(self.engine.step)

    async def _loop(self) -> None:
        while True:
            if not self.engine.has_unfinished():
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                outputs = await self._step()
            except Exception:
                log.exception("decode step failed", num_seqs=len(self._by_seq))
                for state in list(self._by_seq.values()):
                    await self._fail(state, InternalError("decode step failed"))
                continue
            for out in outputs:
                state = self._by_seq.get(out.seq_id)
                if state is None:
                    continue
                try:
                    await self._emit(state, out)
                except Exception:  # one request's failure must not end the batch loop
                    log.exception("emitting a step's output failed", request_id=state.request_id)
                    await self._fail(state, InternalError("emitting the output failed"))

    async def _emit(self, state: DecodeRequest, out: StepOutput) -> None:
        token_ids = list(out.new_token_ids)
        if token_ids:
            self._time_tokens(state, len(token_ids))
        text = state.record_output(token_ids)
        stopped_by_string = state.detokenizer.stopped and not out.finished
        if not out.finished and not stopped_by_string:
            if self.write_through:
                self._write_through(state, out.seq_id)
            if token_ids:
                await send_tokens(state, token_ids, text)
            return
        if stopped_by_string:  # a stop string ended it: leave the batch now
            await self._abort_seq(out.seq_id)
        self._by_seq.pop(out.seq_id, None)
        self.requests.pop(state.request_id, None)
        finished = self._take_finished(state, out, stopped_by_string)
        await self.finisher.end(state, finished, state.error, token_ids, text)

    def _time_tokens(self, state: DecodeRequest, num_tokens: int) -> None:
        """Time to first token, then the gap per token between the sequence's steps."""
        now = time.perf_counter()
        if state.last_token_s is None:
            self.counts.ttft_seconds.observe(now - state.accepted_s)
        else:
            self.counts.itl_seconds.observe((now - state.last_token_s) / num_tokens)
        state.last_token_s = now

    def _take_finished(
        self, state: DecodeRequest, out: StepOutput, stopped_by_string: bool
    ) -> Finished | None:
        """What the ended sequence leaves for the store (None: nothing, e.g. after a failed
        step); its reason is "stop" when a stop string ended it."""
        finished = self._finished.pop(out.seq_id, None)
        if out.spec_stats is not None:
            state.num_draft_tokens = out.spec_stats.num_draft_tokens
            state.num_accepted_draft_tokens = out.spec_stats.num_accepted_tokens
        if finished is not None and stopped_by_string:
            finished.reason = "stop"
        return finished


def _settle(done: asyncio.Future[None], error: BaseException | None) -> None:
    """A join's outcome, for the resends waiting on it (retrieved here, so that an outcome
    nobody waited for is not reported as never retrieved)."""
    if error is None:
        done.set_result(None)
    else:
        done.set_exception(error)
        done.exception()
