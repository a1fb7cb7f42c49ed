"""One request's life in a decode worker, from `DecodeJob` to its last chunk and usage: what
worker.serving.lifecycle keeps for every streamed request, and what decode adds."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import msgspec
from opentelemetry.trace import INVALID_SPAN, Span

from shared.blocks import RequestBlocks
from shared.schema import DecodeStats, PrefillTimings
from worker.engine.outputs import FinishReason
from worker.serving.lifecycle import StreamedRequest

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
class DecodeRequest(StreamedRequest):
    params: Any  # the engine's own sampling parameters (the model's, or the mock's)
    blocks: RequestBlocks  # the prompt's block layout, extended over the answer at the end
    prefix_load_ms: float = 0.0
    prefill: PrefillTimings = PrefillTimings()
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the store, not prefill
    num_blocks_written: int = 0  # blocks 0..n-1 are in the store or on their way there
    writes: list[asyncio.Task[None]] = field(default_factory=list)  # write-through's, pending
    # The first suffix's join, once one came: whose it is (prefill worker, attempt) and its
    # outcome, which that prefill's resend of the same SuffixReady waits for.
    joining_from: tuple[str, int] | None = None
    join_done: asyncio.Future[None] | None = None
    joined: bool = False  # the suffix arrived and the sequence is in the engine
    seq_id: int | None = None
    last_token_s: float | None = None  # when its latest tokens were emitted (metrics' ITL)
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    # Its generation's span, from joining the batch to the last step.
    generate_span: Span = INVALID_SPAN

    @property
    def cached_tokens(self) -> int:
        return self.num_cached_tokens

    def stats(self) -> DecodeStats:
        return msgspec.structs.replace(
            super().stats(),
            prefill=self.prefill,
            prefix_load_ms=self.prefix_load_ms,
            num_draft_tokens=self.num_draft_tokens,
            num_accepted_draft_tokens=self.num_accepted_draft_tokens,
        )
