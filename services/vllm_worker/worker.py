"""A vllm-worker's requests: the router's `DecodeJob` in, vLLM's tokens out on the request's
stream, usage into the durable outbox -- the same messages as a decode worker's, over a vLLM
engine that prefills and decodes the job itself (an aggregated worker: no prefill job, no
KV handoff).

Per job: the same checks as a decode worker (`checked_prompt`: model, block size, chain,
room to generate), then a task streams the completion from vLLM's HTTP API
(vllm_client.py), handing the connector the prompt's chain and the router's kv-index match
in `kv_transfer_params` (it neither hashes the prompt nor asks kv-index again), and sends
each step's ids with their text (our detokenizer, so text and stop strings behave as on
kvfabric's engine; a matched stop string closes vLLM's stream). Cancellation
(`CancelRequest`), the request's deadline and a worker shutdown cancel the task: the closed
HTTP stream makes vLLM abort the request and free its blocks. The final chunk carries the
usage vLLM reports (cached tokens: its own prefix cache plus what the connector loaded from
the store); a request that ends without vLLM's usage (cancelled, failed) is billed with the
prompt tokens the router found cached. Every request accepted leaves one usage record,
published as decode's (`usage.decode`): billing takes the engine's own count over the
caller's estimate.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import aiohttp
from opentelemetry.trace import INVALID_SPAN, Span, StatusCode
from tokenizers import Tokenizer

from services.vllm_worker.config import VllmWorkerConfig
from services.vllm_worker.connector.params import RoutedPrefix, to_kv_transfer_params
from services.vllm_worker.metrics import VllmWorkerMetrics
from services.vllm_worker.vllm_client import VllmClient, VllmError, completion_body
from shared import telemetry
from shared.bus import Bus, Context
from shared.logging import get_logger
from shared.metrics import tier_label
from shared.schema import (
    BadRequest,
    CancelRequest,
    DeadlineExceeded,
    DecodeJob,
    DecodeStats,
    ErrorCode,
    ErrorReply,
    InternalError,
    JobAccepted,
    Overloaded,
    ServiceError,
    TokenChunk,
    TokenUsage,
    Unavailable,
    UsageRecord,
    UsageStatus,
    error_from_wire,
    pack_token_ids,
)
from shared.streams import StreamWriter
from shared.usage import keep_record, usage_record
from shared.usage_outbox import UsageOutbox
from worker.detokenizer import IncrementalDetokenizer
from worker.serving.checks import checked_prompt

log = get_logger(__name__)


def routed_prefix(job: DecodeJob) -> dict[str, str]:
    """The prompt's chain and the router's kv-index match, as `kv_transfer_params`: with them
    the connector neither hashes the prompt nor asks kv-index again."""
    prefix = RoutedPrefix(block_hashes=job.request.block_hashes, cached_blocks=job.cached_blocks)
    return to_kv_transfer_params(prefix)


@dataclass(eq=False)
class VllmRequest:
    job: DecodeJob
    token_ids: list[int]
    stream: StreamWriter
    detokenizer: IncrementalDetokenizer
    accepted_s: float = field(default_factory=time.perf_counter)
    output_ids: list[int] = field(default_factory=list)
    first_token_s: float | None = None
    num_cached_tokens: int | None = None  # vLLM's count, from its usage
    finish_reason: str | None = None
    # The ids and text of the step a stop string ended: they go in the final chunk.
    held: tuple[list[int], str] = ([], "")
    error: ServiceError | None = None  # set: the stream ends with it
    cancel_reason: str | None = None
    task: asyncio.Task[None] | None = None
    span: Span = INVALID_SPAN

    @property
    def request_id(self) -> str:
        return self.job.request.request_id

    @property
    def cached_tokens(self) -> int:
        """vLLM's count when it gave one, else what the router found on the store."""
        if self.num_cached_tokens is not None:
            return self.num_cached_tokens
        return self.job.decision.num_cached_tokens

    def usage(self) -> TokenUsage:
        return TokenUsage(
            num_prompt_tokens=len(self.token_ids),
            num_cached_tokens=self.cached_tokens,
            num_output_tokens=len(self.output_ids),
        )

    def stats(self) -> DecodeStats:
        now = time.perf_counter()
        first = self.first_token_s
        return DecodeStats(
            ttft_ms=((first or now) - self.accepted_s) * 1000,
            decode_ms=(now - first) * 1000 if first is not None else 0.0,
            num_forward_passes=len(self.output_ids),
        )

    def usage_record(self, status: UsageStatus, reason: str, instance_id: str) -> UsageRecord:
        return usage_record(
            self.job.request,
            num_prompt_tokens=len(self.token_ids),
            num_cached_tokens=self.cached_tokens,
            num_output_tokens=len(self.output_ids),
            status=status,
            finish_reason=reason,
            prefill_worker_id=instance_id,
            decode_worker_id=instance_id,
        )


class VllmWorker:
    def __init__(
        self,
        bus: Bus,
        client: VllmClient,
        tokenizer: Tokenizer,
        outbox: UsageOutbox,
        config: VllmWorkerConfig,
        metrics: VllmWorkerMetrics,
    ) -> None:
        self.bus = bus
        self.client = client
        self.tokenizer = tokenizer
        self.outbox = outbox
        self.config = config
        self.counts = metrics
        self.model_name = config.model_name
        self.requests: dict[str, VllmRequest] = {}
        self.num_kv_pages_total = 0  # vLLM's KV blocks, from its /metrics
        self.kv_cache_usage = 0.0

    # -- load ----------------------------------------------------------------------------
    async def poll_load(self) -> None:
        """vLLM's KV blocks in all and in use (periodic, like a heartbeat)."""
        load = await self.client.load()
        self.num_kv_pages_total = load.num_kv_blocks_total
        self.kv_cache_usage = load.kv_cache_usage

    def load_fields(self) -> dict[str, int | str]:
        waiting = [r for r in self.requests.values() if r.first_token_s is None]
        queued_tokens = sum(len(r.token_ids) - r.job.decision.num_cached_tokens for r in waiting)
        total = self.num_kv_pages_total
        used = round(total * self.kv_cache_usage)
        # What accepted requests not yet running will take (their prompt's pages at least).
        pending = sum(-(-len(r.token_ids) // self.config.kv_block_size_tokens) for r in waiting)
        return {
            "num_queued": len(waiting),
            "num_queued_tokens": queued_tokens,
            "num_running": len(self.requests) - len(waiting),
            "num_kv_pages_total": total,
            "num_kv_pages_free": max(total - used - pending, 0),
            "model": self.model_name,
            "num_devices": 1,
        }

    # -- DecodeJob -----------------------------------------------------------------------
    async def handle_job(self, job: DecodeJob, ctx: Context) -> JobAccepted:
        request = job.request
        token_ids, _ = checked_prompt(
            request,
            model_name=self.model_name,
            block_size_tokens=self.config.kv_block_size_tokens,
            max_model_len=self.config.max_model_len,
        )
        if not request.stream_inbox:
            raise BadRequest("stream_inbox is required")
        if request.request_id in self.requests:
            raise BadRequest(f"request {request.request_id} is already running here")
        sampling = request.sampling
        if sampling.logprobs:
            raise BadRequest("logprobs are not served by vllm-worker yet")
        if len(self.requests) >= self.config.max_num_seqs:
            raise Overloaded(
                f"{len(self.requests)} requests running (max_num_seqs {self.config.max_num_seqs})",
                retry_after_s=self.config.retry_after_s,
            )
        state = VllmRequest(
            job,
            token_ids,
            StreamWriter(self.bus, request.stream_inbox, request_id=request.request_id),
            IncrementalDetokenizer(self.tokenizer, stop=sampling.stop),
        )
        state.span = telemetry.current_span()
        self.requests[request.request_id] = state
        state.task = asyncio.create_task(self._run(state))
        return JobAccepted(request_id=request.request_id, instance_id=self.bus.instance_id)

    async def on_cancel(self, cancel: CancelRequest) -> None:
        state = self.requests.get(cancel.request_id)
        if state is None or state.task is None:
            return
        if cancel.error_code:
            reply = ErrorReply(code=ErrorCode(cancel.error_code), message=cancel.error_message)
            state.error = error_from_wire(None, cancel.error_message, reply)
        state.cancel_reason = cancel.reason
        state.task.cancel()

    async def stop(self) -> None:
        for state in list(self.requests.values()):
            state.error = Unavailable("vllm worker stopping")
            if state.task is not None:
                state.task.cancel()
        await asyncio.gather(
            *(s.task for s in list(self.requests.values()) if s.task), return_exceptions=True
        )

    # -- one request ---------------------------------------------------------------------
    async def _run(self, state: VllmRequest) -> None:
        request = state.job.request
        generate = telemetry.child_span(state.span, "vllm generate")
        try:
            deadline_s = None
            if request.deadline_ms is not None:
                deadline_s = max(request.deadline_ms / 1000 - time.time(), 0.0)
            async with asyncio.timeout(deadline_s):
                await self._stream(state)
        except TimeoutError:
            state.cancel_reason = "deadline"
            state.error = DeadlineExceeded("deadline passed while generating")
        except asyncio.CancelledError:  # cancelled or stopping: the state says why
            log.debug(
                "vllm request cancelled",
                request_id=state.request_id,
                reason=state.cancel_reason,
                error=str(state.error),
            )
        except VllmError as exc:
            log.warning("vLLM failed the request", request_id=state.request_id, error=str(exc))
            state.error = (
                BadRequest(str(exc)) if exc.status == 400 else InternalError("vLLM failed")
            )
        except (aiohttp.ClientError, ConnectionError) as exc:
            log.warning("vLLM unreachable", request_id=state.request_id, error=repr(exc))
            state.error = Unavailable("the vLLM engine is unreachable")
        except Exception:
            log.exception("vllm request failed", request_id=state.request_id)
            state.error = InternalError("generation failed")
        finally:
            if generate.is_recording():
                generate.set_attributes(
                    {
                        "kvfabric.num_output_tokens": len(state.output_ids),
                        "kvfabric.hit_tokens": state.cached_tokens,
                    }
                )
                if state.error is not None:
                    generate.set_status(StatusCode.ERROR, state.error.message)
            generate.end()
            self.requests.pop(state.request_id, None)
            # Shielded: a shutdown's cancel must not cut the final chunk or the usage record.
            await asyncio.shield(self._finish(state))

    async def _stream(self, state: VllmRequest) -> None:
        request = state.job.request
        body = completion_body(
            self.model_name,
            state.token_ids,
            request.sampling,
            request_id=request.request_id,
            cache_salt=request.cache_salt,
            # Nothing reads them without the connector.
            kv_transfer_params=routed_prefix(state.job) if self.config.connector else None,
        )
        async for delta in self.client.generate(body):
            if delta.num_cached_tokens is not None:
                state.num_cached_tokens = delta.num_cached_tokens
            if delta.finish_reason is not None:
                state.finish_reason = delta.finish_reason
            if not delta.token_ids:
                continue
            if state.first_token_s is None:
                state.first_token_s = time.perf_counter()
                self.counts.ttft_seconds.observe(state.first_token_s - state.accepted_s)
            ids = list(delta.token_ids)
            state.output_ids += ids
            text = state.detokenizer.push(ids)
            if state.detokenizer.stopped:
                state.finish_reason = "stop"
                state.held = (ids, text)
                return  # leaving the `async with` closes the stream: vLLM aborts it
            await state.stream.send(
                TokenChunk(
                    request_id=state.request_id,
                    seq=state.stream.num_sent,
                    token_ids=pack_token_ids(ids),
                    text=text,
                )
            )

    async def _finish(self, state: VllmRequest) -> None:
        with telemetry.span("vllm finish", parent=state.span):
            await self._end(state)

    async def _end(self, state: VllmRequest) -> None:
        last_ids, last_text = state.held
        error = state.error
        if error is None and state.finish_reason is None:
            reason = "cancelled"
        else:
            reason = state.finish_reason or "cancelled"
        try:
            if error is not None:
                await state.stream.fail(error)
            else:
                chunk = TokenChunk(
                    request_id=state.request_id,
                    seq=state.stream.num_sent,
                    token_ids=pack_token_ids(last_ids),
                    text=last_text + state.detokenizer.flush(),
                    final=True,
                    finish_reason=reason,
                    usage=state.usage(),
                    stats=state.stats(),
                    stop_sequence=state.detokenizer.matched_stop,
                )
                await state.stream.send(chunk, final=True)
        except Exception:
            log.exception("ending the stream failed", request_id=state.request_id)
        if error is not None:
            status, outcome = UsageStatus.FAILED, "error"
        elif reason == "cancelled":
            status, outcome = UsageStatus.CANCELLED, "cancelled"
        else:
            status, outcome = UsageStatus.COMPLETED, reason
        self._count(state, outcome)
        record = state.usage_record(status, "error" if error else reason, self.bus.instance_id)
        await keep_record(
            self.outbox, record, kept=self.counts.usage_kept, lost=self.counts.usage_lost
        )

    def _count(self, state: VllmRequest, outcome: str) -> None:
        counts = self.counts
        counts.ended[outcome].inc()
        counts.request_seconds.observe(time.perf_counter() - state.accepted_s)
        counts.prompt_tokens.inc(len(state.token_ids))
        counts.output_tokens.inc(len(state.output_ids))
        # Up to what the router found on the store, the store's tier; beyond it, vLLM's own
        # prefix cache (device memory).
        stored = min(state.cached_tokens, state.job.decision.num_cached_tokens)
        if stored:
            counts.hit_tokens.labels(tier_label(state.job.cached_blocks.tier)).inc(stored)
        if state.cached_tokens > stored:
            counts.hit_tokens.labels("device").inc(state.cached_tokens - stored)
