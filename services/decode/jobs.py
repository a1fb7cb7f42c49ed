"""What the model's decode worker (worker.py) and the mock one (mock_worker.py) share: the
requests they hold, from `DecodeJob` to the last chunk, and everything around them that does
not depend on the engine.

Both workers admit a job on the same checks (the prompt, the stream inbox, free KV pages:
`Overloaded` otherwise), join its sequence when `SuffixReady` comes, end it the same way
when it is cancelled, waits too long for its suffix, passes its deadline or its step fails,
and stream each step's tokens through the same `Finisher` -- one copy, so what the mock
cluster tests is what the model serves. What differs is what a worker overrides: the pages a
request needs (`_pages_to_admit`, `kv_pages`), the engine's sampling parameters
(`_sampling_params`), what admitting and joining do (`_admit`: start loading the cached
prefix; `_join`: pull the suffix), what a request holds (`_release`), one engine step
(`_step`), stopping a sequence (`_abort_seq`) and what a finished sequence leaves for the
store (`_take_finished`).

No torch here: the mock worker runs this without it.
"""

from __future__ import annotations

import asyncio
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, Generic, Protocol, TypeVar

from tokenizers import Tokenizer

from services.decode.finish import Finisher
from services.decode.state import DecodeRequest, Finished
from shared import telemetry
from shared.bus import Bus, Context
from shared.logging import get_logger
from shared.schema import (
    BadRequest,
    CancelRequest,
    DecodeJob,
    InternalError,
    JobAccepted,
    NotFound,
    Overloaded,
    SamplingParams,
    ServiceError,
    SuffixReady,
    Unavailable,
)
from shared.streams import StreamWriter
from shared.tasks import cancel_and_wait
from worker.detokenizer import IncrementalDetokenizer
from worker.serving.checks import checked_prompt
from worker.serving.lifecycle import send_tokens

log = get_logger(__name__)


class SteppingEngine(Protocol):
    """What both engines offer here (the model's `Engine`, worker.mock_engine's `MockEngine`)."""

    def has_unfinished(self) -> bool: ...

    def abort(self, seq_id: int) -> bool: ...


class StepResult(Protocol):
    """One sequence's share of a step (`StepOutput`, `MockStepOutput`)."""

    @property
    def seq_id(self) -> int: ...

    @property
    def new_token_ids(self) -> tuple[int, ...]: ...

    @property
    def finished(self) -> bool: ...


EngineT = TypeVar("EngineT", bound=SteppingEngine)
OutputT = TypeVar("OutputT", bound=StepResult)


class DecodeJobsBase(ABC, Generic[EngineT, OutputT]):
    def __init__(
        self,
        bus: Bus,
        engine: EngineT,
        tokenizer: Tokenizer,
        finisher: Finisher,
        *,
        model_name: str,
        max_model_len: int,
        block_size_tokens: int,
        retry_after_s: float,
        suffix_timeout_s: float,
    ) -> None:
        self.bus = bus
        self.engine = engine
        self.tokenizer = tokenizer
        self.finisher = finisher
        self.counts = finisher.counts  # the worker's metrics, its endings' among them
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.block_size = block_size_tokens
        self.retry_after_s = retry_after_s
        self.suffix_timeout_s = suffix_timeout_s
        self.requests: dict[str, DecodeRequest] = {}
        self._by_seq: dict[int, DecodeRequest] = {}
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None

    # -- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        self._loop_task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        for state in list(self.requests.values()):
            await self._fail(state, Unavailable("decode worker stopping"))
        await cancel_and_wait(self._loop_task)
        await self.finisher.drain()

    @abstractmethod
    def kv_pages(self) -> tuple[int, int]:
        """The KV pool's pages: (total, free)."""

    def load_fields(self) -> dict[str, int | str]:
        joined = sum(r.joined for r in self.requests.values())
        num_pages_total, num_pages_free = self.kv_pages()
        return {
            "num_queued": len(self.requests) - joined,
            "num_running": joined,
            "num_kv_pages_total": num_pages_total,
            "num_kv_pages_free": num_pages_free,
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
        )
        if not request.stream_inbox:
            raise BadRequest("stream_inbox is required")
        if request.request_id in self.requests:
            raise BadRequest(f"request {request.request_id} is already decoding here")
        sampling = request.sampling
        params = self._sampling_params(sampling)
        num_pages = self._pages_to_admit(len(token_ids), sampling)
        num_pages_free = self.kv_pages()[1]
        if num_pages > num_pages_free:
            raise Overloaded(
                f"{num_pages} KV pages needed, {num_pages_free} free",
                retry_after_s=self.retry_after_s,
            )
        state = DecodeRequest(
            job,
            token_ids,
            StreamWriter(self.bus, request.stream_inbox, request_id=request.request_id),
            IncrementalDetokenizer(self.tokenizer, stop=sampling.stop),
            params,
            blocks,
        )
        state.span = telemetry.current_span()
        self._admit(state, num_pages)
        self.requests[request.request_id] = state
        return JobAccepted(request_id=request.request_id, instance_id=self.bus.instance_id)

    @abstractmethod
    def _pages_to_admit(self, num_prompt_tokens: int, sampling: SamplingParams) -> int:
        """KV pages a new request needs free, or it is refused (`Overloaded`)."""

    @abstractmethod
    def _sampling_params(self, sampling: SamplingParams) -> Any:
        """The engine's sampling parameters; `BadRequest` for ones it cannot honour."""

    def _admit(self, state: DecodeRequest, num_pages: int) -> None:
        """The request is accepted (about to be registered): take what it needs now."""

    # -- SuffixReady ---------------------------------------------------------------------
    async def handle_suffix(self, ready: SuffixReady, ctx: Context) -> JobAccepted:
        state = self.requests.get(ready.request_id)
        accepted = JobAccepted(request_id=ready.request_id, instance_id=self.bus.instance_id)
        if state is None:
            raise NotFound(f"no decode job {ready.request_id} here (cancelled or timed out)")
        if state.joined:
            return accepted  # a retried prefill's duplicate: the first suffix is in use
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
        state.seq_id, state.joined = seq_id, True
        state.generate_span = telemetry.child_span(state.span, "decode generate")
        self._by_seq[seq_id] = state
        self._wake.set()
        return accepted

    @abstractmethod
    async def _join(self, state: DecodeRequest, ready: SuffixReady) -> int:
        """Add the request's sequence to the engine, its prompt computed up to n - 1, or
        all n with its first output token (`ready.first_token_id`); returns its seq id."""

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

    @abstractmethod
    async def _abort_seq(self, seq_id: int) -> None:
        """Take the sequence out of the engine's batch; its pages are freed at once."""

    async def _fail(self, state: DecodeRequest, error: ServiceError | None) -> None:
        """End a request at once, in the batch or not (None: finish_reason cancelled)."""
        if self.requests.pop(state.request_id, None) is None:
            return
        if state.seq_id is not None:
            await self._abort_seq(state.seq_id)
            self._by_seq.pop(state.seq_id, None)
        await self._release(state)
        await self.finisher.end(state, None, error)

    async def _release(self, state: DecodeRequest) -> None:
        """Free what the request still holds once it has left the table and the batch."""

    # -- the batch loop ------------------------------------------------------------------
    @abstractmethod
    async def _step(self) -> Sequence[OutputT] | None:
        """One engine step's outputs; None: nothing can run until a request joins."""

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
            if outputs is None:
                self._wake.clear()
                await self._wake.wait()
                continue
            for out in outputs:
                state = self._by_seq.get(out.seq_id)
                if state is not None:
                    await self._emit(state, out)

    async def _emit(self, state: DecodeRequest, out: OutputT) -> None:
        token_ids = list(out.new_token_ids)
        if token_ids:
            self._time_tokens(state, len(token_ids))
        text = state.record_output(token_ids)
        stopped_by_string = state.detokenizer.stopped and not out.finished
        if not out.finished and not stopped_by_string:
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

    @abstractmethod
    def _take_finished(
        self, state: DecodeRequest, out: OutputT, stopped_by_string: bool
    ) -> Finished | None:
        """What the ended sequence leaves for the store (None: nothing, e.g. after a failed
        step); its reason is "stop" when a stop string ended it."""
