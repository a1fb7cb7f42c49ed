"""One request's life in a decode worker, from `DecodeJob` to its last chunk and usage."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.trace import INVALID_SPAN, Span

from shared.blocks import RequestBlocks
from shared.schema import (
    CancelRequest,
    DecodeJob,
    DecodeStats,
    ErrorCode,
    ErrorReply,
    PrefillTimings,
    TokenUsage,
    UsageRecord,
    UsageStatus,
    error_from_wire,
)
from shared.streams import StreamWriter
from shared.usage import usage_record
from worker.detokenizer import IncrementalDetokenizer
from worker.engine.outputs import FinishReason

# An engine's finish reason -> the stream's (`TokenChunk.finish_reason`, usage records).
STREAM_FINISH_REASONS = {
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.ABORT: "cancelled",
}


@dataclass
class Finished:
    """What a finished sequence leaves behind, copied before the engine frees its pages."""

    reason: str  # stop | length | cancelled
    token_ids: list[int]
    blocks: list[tuple[int, bytes]]  # (block index, payload) to write to the store
    # The sliding-window snapshot at the end of the last block written (None: the model has
    # no sliding layers, or the engine tracked no window there).
    boundary_snapshot: bytes | None


@dataclass(eq=False)
class DecodeRequest:
    job: DecodeJob
    token_ids: list[int]  # the prompt
    blocks: RequestBlocks  # the prompt's block layout, extended over the answer at the end
    stream: StreamWriter
    detokenizer: IncrementalDetokenizer
    params: Any  # the engine's own sampling parameters (the model's, or the mock's)
    accepted_s: float = field(default_factory=time.perf_counter)
    prefix_load_ms: float = 0.0
    prefill: PrefillTimings = PrefillTimings()
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the store, not prefill
    joined: bool = False  # the suffix arrived and the sequence is in the engine
    seq_id: int | None = None
    output_ids: list[int] = field(default_factory=list)
    first_token_s: float | None = None
    last_token_s: float | None = None  # when its latest tokens were emitted (metrics' ITL)
    cancel_reason: str | None = None
    error: Exception | None = None  # set: the stream ends with this error
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    num_forward_passes: int = 0
    # The job's span (the bus's, of the `run` endpoint) and its generation's, from joining the
    # batch to the last step: the steps after the job was accepted run in other tasks.
    span: Span = INVALID_SPAN
    generate_span: Span = INVALID_SPAN

    @property
    def request_id(self) -> str:
        return self.job.request.request_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.token_ids)

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

    def usage(self) -> TokenUsage:
        return TokenUsage(
            num_prompt_tokens=self.num_prompt_tokens,
            num_cached_tokens=self.num_cached_tokens,
            num_output_tokens=len(self.output_ids),
        )

    def stats(self) -> DecodeStats:
        now = time.perf_counter()
        first = self.first_token_s
        return DecodeStats(
            prefill=self.prefill,
            prefix_load_ms=self.prefix_load_ms,
            ttft_ms=((first or now) - self.accepted_s) * 1000,
            decode_ms=(now - first) * 1000 if first is not None else 0.0,
            num_draft_tokens=self.num_draft_tokens,
            num_accepted_draft_tokens=self.num_accepted_draft_tokens,
            num_forward_passes=self.num_forward_passes,
        )

    def usage_record(
        self, status: UsageStatus, finish_reason: str | None, instance_id: str
    ) -> UsageRecord:
        return usage_record(
            self.job.request,
            num_prompt_tokens=self.num_prompt_tokens,
            num_cached_tokens=self.num_cached_tokens,
            num_output_tokens=len(self.output_ids),
            status=status,
            finish_reason=finish_reason,
            prefill_worker_id=self.job.decision.prefill_worker_id,
            decode_worker_id=instance_id,
        )
