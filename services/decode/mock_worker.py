"""The mock decode worker (`--engine mock`): the real worker's endpoints, streams, store writes
and usage over shared.testing's MockEngine (docs/request-flow.md; shared/serving/mock.py).

`DecodeJob`: admit if the simulated pool has the pages the request can grow to (prompt +
max_tokens: what MockEngine reserves, so it never preempts), answer `JobAccepted`.
`SuffixReady`: nothing to pull (mock prefill stages no bytes); the sequence joins the engine
with the prompt's whole blocks up to token n - 1 counted as cached, so the engine charges
their load and the short tail, not the prefill the prefill worker already simulated.

The batch loop runs `MockEngine.step` on the event loop (pure bookkeeping: no thread and no
engine lock, unlike the model's) and sleeps the step's simulated duration before its tokens
go out, so a token leaves when the simulated step that made it ends. Tokens are the mock's
deterministic fake ids (`fake_tokens`), detokenized with the model's tokenizer so stop
strings behave as on the model. Endings go through the real `Finisher`: the complete blocks
(placeholder bytes) to the store and kv-index before the final chunk, then the `UsageRecord`
to JetStream -- completed, cancelled or failed, as on the model.
"""

from __future__ import annotations

import asyncio
import math
import time

from tokenizers import Tokenizer

from services.decode.config import DecodeConfig
from services.decode.finish import Finisher
from services.decode.state import DecodeRequest, Finished
from shared.bus import Bus, Context
from shared.detokenizer import IncrementalDetokenizer
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
from shared.serving.kv_io import hasher_for
from shared.serving.mock import MockModel, sleep_simulated
from shared.streams import StreamWriter
from shared.testing.mock_engine import (
    FinishReason,
    MockEngine,
    MockRequestError,
    MockSamplingParams,
    MockStepOutput,
)

log = get_logger(__name__)

_REASONS = {
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.ABORT: "cancelled",
}


class MockDecodeWorker:
    def __init__(
        self,
        bus: Bus,
        engine: MockEngine,
        tokenizer: Tokenizer,
        finisher: Finisher,
        config: DecodeConfig,
        model: MockModel,
    ) -> None:
        self.bus = bus
        self.engine = engine
        self.tokenizer = tokenizer
        self.finisher = finisher
        self.config = config
        self.model = model
        self.block_size = engine.config.block_size_tokens
        self.requests: dict[str, DecodeRequest] = {}
        self._by_seq: dict[int, DecodeRequest] = {}
        self._pages: dict[str, int] = {}  # request id -> pages reserved when admitted
        self._payload = bytes(config.mock_block_nbytes)
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None

    # -- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        self._loop_task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        for state in list(self.requests.values()):
            await self._fail(state, Unavailable("decode worker stopping"))
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
        await self.finisher.drain()

    @property
    def num_kv_pages_free(self) -> int:
        return self.engine.config.num_kv_pages - sum(self._pages.values())

    def load_fields(self) -> dict[str, int]:
        joined = sum(r.joined for r in self.requests.values())
        return {
            "num_queued": len(self.requests) - joined,
            "num_running": joined,
            "num_kv_pages_total": self.engine.config.num_kv_pages,
            "num_kv_pages_free": self.num_kv_pages_free,
        }

    def counters(self) -> dict[str, float]:
        return self.finisher.counts | {"simulated_clock_s": round(self.engine.clock_s, 3)}

    # -- DecodeJob -----------------------------------------------------------------------
    async def handle_job(self, job: DecodeJob, ctx: Context) -> JobAccepted:
        request, model = job.request, self.model
        token_ids = checked_prompt(
            request, model_name=model.name, block_size_tokens=self.block_size,
            max_model_len=model.max_model_len,
        )  # fmt: skip
        if not request.stream_inbox:
            raise BadRequest("stream_inbox is required")
        if request.request_id in self.requests:
            raise BadRequest(f"request {request.request_id} is already decoding here")
        sampling = request.sampling
        max_len = min(len(token_ids) + sampling.max_tokens, model.max_model_len)
        num_pages = math.ceil(max_len / self.block_size)
        if num_pages > self.num_kv_pages_free:
            raise Overloaded(
                f"{num_pages} KV pages needed, {self.num_kv_pages_free} free",
                retry_after_s=self.config.retry_after_s,
            )
        eos = () if sampling.ignore_eos else model.eos_token_ids
        params = MockSamplingParams(
            max_new_tokens=sampling.max_tokens,
            stop_token_ids=(*sampling.stop_token_ids, *eos),
            seed=sampling.seed,
        )
        state = DecodeRequest(
            job, token_ids, hasher_for(request),
            StreamWriter(self.bus, request.stream_inbox, request_id=request.request_id),
            IncrementalDetokenizer(self.tokenizer, stop=sampling.stop), params,
        )  # fmt: skip
        self.requests[request.request_id] = state
        self._pages[request.request_id] = num_pages
        return JobAccepted(request_id=request.request_id, instance_id=self.bus.instance_id)

    # -- SuffixReady ---------------------------------------------------------------------
    async def handle_suffix(self, ready: SuffixReady, ctx: Context) -> JobAccepted:
        state = self.requests.get(ready.request_id)
        accepted = JobAccepted(request_id=ready.request_id, instance_id=self.bus.instance_id)
        if state is None:
            raise NotFound(f"no decode job {ready.request_id} here (cancelled or timed out)")
        if state.joined:
            return accepted  # a retried prefill's duplicate: the first suffix is in use
        state.prefill = ready.timings
        state.num_cached_tokens = ready.first_block_index * self.block_size
        num_ready = ready.num_computed_tokens // self.block_size * self.block_size
        try:
            seq_id = self.engine.add_request(
                state.token_ids, state.params, num_cached_tokens=num_ready, has_swa_snapshot=True
            )
        except MockRequestError as exc:
            error = BadRequest(str(exc))
            await self._fail(state, error)
            raise error from exc
        state.seq_id, state.joined = seq_id, True
        self._by_seq[seq_id] = state
        self._wake.set()
        return accepted

    # -- cancellation and failure -------------------------------------------------------
    async def on_cancel(self, cancel: CancelRequest) -> None:
        state = self.requests.get(cancel.request_id)
        if state is None:
            return
        state.note_cancel(cancel)
        await self._abort(state, state.error)

    async def expire(self) -> None:
        """Periodic: fail jobs whose suffix never came, and requests past their deadline."""
        now_ms = time.time() * 1000
        for state in list(self.requests.values()):
            deadline_ms = state.job.request.deadline_ms
            waited_s = time.perf_counter() - state.accepted_s
            if not state.joined and waited_s > self.config.suffix_timeout_s:
                await self._fail(state, Unavailable(f"no prefill result in {waited_s:.0f}s"))
            elif deadline_ms is not None and now_ms > deadline_ms:
                state.cancel_reason = "deadline"
                state.error = DeadlineExceeded("deadline passed while decoding")
                await self._abort(state, state.error)

    async def _abort(self, state: DecodeRequest, error: ServiceError | None) -> None:
        """In the batch: abort, and the loop ends it with what it produced; else end it now."""
        if state.joined and state.seq_id is not None:
            self.engine.abort(state.seq_id)
            self._wake.set()
        else:
            await self._fail(state, error)

    async def _fail(self, state: DecodeRequest, error: ServiceError | None) -> None:
        """End a request at once, in the batch or not (None: finish_reason cancelled)."""
        if self.requests.pop(state.request_id, None) is None:
            return
        self._pages.pop(state.request_id, None)
        if state.seq_id is not None:
            self.engine.abort(state.seq_id)
            self._by_seq.pop(state.seq_id, None)
        await self.finisher.end(state, None, error)

    # -- the batch loop ------------------------------------------------------------------
    async def _loop(self) -> None:
        while True:
            if not self.engine.has_unfinished():
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:
                log.exception("mock decode step failed")
                for state in list(self._by_seq.values()):
                    await self._fail(state, InternalError(f"decode step failed: {exc}"))
                continue
            duration_s = self.engine.last_step_duration_s
            if not outputs and duration_s == 0:  # nothing can run until a request joins
                self._wake.clear()
                await self._wake.wait()
                continue
            await sleep_simulated(duration_s, self.config.mock_speedup)
            for out in outputs:
                state = self._by_seq.get(out.seq_id)
                if state is not None:
                    await self._emit(state, out)

    async def _emit(self, state: DecodeRequest, out: MockStepOutput) -> None:
        token_ids = list(out.new_token_ids)
        text = state.record_output(token_ids)
        stopped_by_string = state.detokenizer.stopped and not out.finished
        if not out.finished and not stopped_by_string:
            if token_ids:
                await self.finisher.send(state, token_ids, text)
            return
        if stopped_by_string:  # a stop string ended it: leave the batch now
            self.engine.abort(out.seq_id)
        self._by_seq.pop(out.seq_id, None)
        self.requests.pop(state.request_id, None)
        self._pages.pop(state.request_id, None)
        # A finished output always carries its reason; STOP only satisfies the type.
        reason = "stop" if stopped_by_string else _REASONS[out.finish_reason or FinishReason.STOP]
        await self.finisher.end(state, self._finished(state, reason), state.error, token_ids, text)

    def _finished(self, state: DecodeRequest, reason: str) -> Finished:
        """Decode's blocks: from the one holding prompt token n - 1 (prefill wrote those
        before it) to the last complete one computed (the last sampled token's KV is not)."""
        token_ids = state.token_ids + state.output_ids
        first = (state.num_prompt_tokens - 1) // self.block_size
        end = (len(token_ids) - 1) // self.block_size
        blocks = [(i, self._payload) for i in range(first, end)]
        return Finished(reason, token_ids, blocks, boundary_window=None)
