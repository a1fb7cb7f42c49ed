"""One streamed request's life in a worker that answers `DecodeJob`s: the decode worker
(over kvfabric's engine) and the vllm-worker (over vLLM's server) both run it.

From `JobAccepted` to its end, a request holds its stream and detokenizer, counts its output
(`record_output`), learns why it stops (`note_cancel`: the caller's cancel, with the error its
stream ends with; `expire`: its deadline), and ends once (`end_request`): the final chunk with
usage and stats, or the error; then one `UsageRecord` into the worker's durable outbox,
completed, cancelled or failed. What a worker does before the end (decode writes the
finished blocks to the store first) and how it stops its engine are its own.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from opentelemetry.trace import INVALID_SPAN, Span
from tokenizers import Tokenizer

from shared.logging import get_logger
from shared.metrics import Counter, Family, Histogram
from shared.schema import (
    CancelRequest,
    DeadlineExceeded,
    DecodeJob,
    DecodeStats,
    ErrorCode,
    ErrorReply,
    GenerateRequest,
    ServiceError,
    TokenChunk,
    TokenUsage,
    UsageStatus,
    error_from_wire,
    pack_token_ids,
)
from shared.streams import StreamWriter
from shared.usage import keep_record, usage_record
from shared.usage_outbox import UsageOutbox
from worker.detokenizer import IncrementalDetokenizer

log = get_logger(__name__)


class EndCounts(Protocol):
    """The metrics a worker counts its requests' ends into (decode's, the vllm-worker's)."""

    ended: Mapping[str, Counter]
    request_seconds: Histogram
    prompt_tokens: Counter
    output_tokens: Counter
    hit_tokens: Family[Counter]  # by tier
    usage_kept: Counter
    usage_lost: Counter


@dataclass(eq=False)
class StreamedRequest:
    job: DecodeJob
    token_ids: list[int]  # the prompt
    stream: StreamWriter
    detokenizer: IncrementalDetokenizer
    accepted_s: float = field(default_factory=time.perf_counter, kw_only=True)
    output_ids: list[int] = field(default_factory=list, kw_only=True)
    first_token_s: float | None = field(default=None, kw_only=True)
    num_forward_passes: int = field(default=0, kw_only=True)
    cancel_reason: str | None = field(default=None, kw_only=True)
    error: ServiceError | None = field(default=None, kw_only=True)  # set: the stream ends so
    # The job's span (the bus's, of the `run` endpoint): what runs after `JobAccepted` runs in
    # other tasks.
    span: Span = field(default=INVALID_SPAN, kw_only=True)

    @property
    def request_id(self) -> str:
        return self.job.request.request_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens billed as cache hits."""
        raise NotImplementedError

    def record_output(self, token_ids: list[int]) -> str:
        """Count one step's tokens; returns their new text (held back near a stop string)."""
        if token_ids and self.first_token_s is None:
            self.first_token_s = time.perf_counter()
        self.output_ids += token_ids
        self.num_forward_passes += 1 if token_ids else 0
        return self.detokenizer.push(token_ids)

    def note_cancel(self, cancel: CancelRequest) -> None:
        """Why it stops; with an error code, the error its stream ends with."""
        if cancel.error_code:
            reply = ErrorReply(code=ErrorCode(cancel.error_code), message=cancel.error_message)
            self.error = error_from_wire(None, cancel.error_message, reply)
        self.cancel_reason = cancel.reason

    def seconds_left(self) -> float | None:
        """Until the request's deadline (0 once past it); None: it has none."""
        deadline_ms = self.job.request.deadline_ms
        return None if deadline_ms is None else max(deadline_ms / 1000 - time.time(), 0.0)

    def expire(self, doing: str) -> None:
        """Its deadline passed while `doing`: it ends with DEADLINE_EXCEEDED."""
        self.cancel_reason = "deadline"
        self.error = DeadlineExceeded(f"deadline passed while {doing}")

    def usage(self) -> TokenUsage:
        """What the request is billed. A continuation after a failover (`request.resume`)
        bills the original's prompt and hits, and the output delivered before it too."""
        resume = self.job.request.resume
        if resume is None:
            return TokenUsage(
                num_prompt_tokens=self.num_prompt_tokens,
                num_cached_tokens=self.cached_tokens,
                num_output_tokens=len(self.output_ids),
            )
        return TokenUsage(
            num_prompt_tokens=resume.num_prompt_tokens,
            num_cached_tokens=resume.num_cached_tokens,
            num_output_tokens=resume.num_output_tokens + len(self.output_ids),
        )

    def stats(self) -> DecodeStats:
        now = time.perf_counter()
        first = self.first_token_s
        return DecodeStats(
            ttft_ms=((first or now) - self.accepted_s) * 1000,
            decode_ms=(now - first) * 1000 if first is not None else 0.0,
            num_forward_passes=self.num_forward_passes,
        )


def stream_detokenizer(
    tokenizer: Tokenizer, request: GenerateRequest, token_ids: list[int]
) -> IncrementalDetokenizer:
    """The detokenizer of a request's stream; a continuation's (`request.resume`) takes up
    where the failed worker's reader stopped (the prompt ends with the output delivered)."""
    detokenizer = IncrementalDetokenizer(tokenizer, stop=request.sampling.stop)
    resume = request.resume
    if resume is not None and resume.num_output_tokens:
        delivered = token_ids[len(token_ids) - resume.num_output_tokens :]
        detokenizer.resume(delivered, resume.num_output_chars)
    return detokenizer


async def send_tokens(state: StreamedRequest, token_ids: list[int], text: str) -> None:
    chunk = TokenChunk(
        request_id=state.request_id,
        seq=state.stream.num_sent,
        token_ids=pack_token_ids(token_ids),
        text=text,
    )
    await state.stream.send(chunk)


async def end_request(
    state: StreamedRequest,
    reason: str | None,
    *,
    outbox: UsageOutbox,
    counts: EndCounts,
    hit_tokens: Mapping[str, int],
    decode_worker_id: str,
    prefill_worker_id: str,
    last_token_ids: list[int] | None = None,
    last_text: str = "",
) -> tuple[UsageStatus, str]:
    """Keep the request's usage record, then end the stream (the final chunk with
    `last_token_ids`, or `state.error`) and count the end; `reason` None: it was cancelled.
    Returns the record's status and finish reason.

    The record is on disk (the outbox) before the client can see the end: a worker killed
    between the two would otherwise have answered a request nobody bills (the fault suite's
    kill -9 of a decode worker found one)."""
    reason = reason or "cancelled"
    error = state.error
    if error is not None:
        status, reason = UsageStatus.FAILED, "error"
    elif reason == "cancelled":
        status = UsageStatus.CANCELLED
    else:
        status = UsageStatus.COMPLETED
    usage = state.usage()
    prefill = getattr(state, "prefill", None)  # a decode worker's: how prefill restored
    replayed = prefill is not None and prefill.swa_restore in ("bounded", "exact")
    record = usage_record(
        state.job.request,
        num_prompt_tokens=usage.num_prompt_tokens,
        num_cached_tokens=usage.num_cached_tokens,
        num_output_tokens=usage.num_output_tokens,
        status=status,
        finish_reason=reason,
        prefill_worker_id=prefill_worker_id,
        decode_worker_id=decode_worker_id,
        window_replayed=replayed,
    )
    await keep_record(outbox, record, kept=counts.usage_kept, lost=counts.usage_lost)
    try:
        if error is not None:
            await state.stream.fail(error)
        else:
            chunk = TokenChunk(
                request_id=state.request_id,
                seq=state.stream.num_sent,
                token_ids=pack_token_ids(last_token_ids or []),
                text=last_text + state.detokenizer.flush(),
                final=True,
                finish_reason=reason,
                usage=usage,
                stats=state.stats(),
                stop_sequence=state.detokenizer.matched_stop,
            )
            await state.stream.send(chunk, final=True)
    except Exception:
        log.exception("ending the stream failed", request_id=state.request_id)
    counts.ended[reason].inc()
    counts.request_seconds.observe(time.perf_counter() - state.accepted_s)
    counts.prompt_tokens.inc(state.num_prompt_tokens)
    counts.output_tokens.inc(len(state.output_ids))
    for tier, num_tokens in hit_tokens.items():
        if num_tokens:
            counts.hit_tokens.labels(tier).inc(num_tokens)
    return status, reason
