"""One prefill job, from its `PrefillJob` to its `PrefillDone`: what the worker (worker.py)
keeps of it while it is restored, computed in chunks, handed off and stored."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import msgspec
from opentelemetry.trace import INVALID_SPAN, Span

from shared.blocks import RequestBlocks
from shared.schema import PrefillDone, PrefillJob, PrefillTimings
from worker.engine.sampler import SamplingParams as EngineSampling
from worker.engine.sequence import Sequence


@dataclass(eq=False)
class JobState:
    job: PrefillJob
    token_ids: list[int]
    blocks: RequestBlocks  # the prompt's block layout, from the request
    done: asyncio.Future[PrefillDone]
    accepted_s: float
    restored: PrefillTimings  # load_ms, restore_ms, swa_restore, num_replay_tokens
    num_cached_blocks: int  # the restored prefix: the first block this worker computes
    seq: Sequence  # the engine scheduler's: its pages, window and computed tokens
    sampling: EngineSampling  # the request's, for its first output token
    first_chunk_s: float | None = field(default=None, kw_only=True)
    compute_s: float = field(default=0.0, kw_only=True)
    finishing: bool = field(default=False, kw_only=True)  # computed: being handed off
    released: bool = field(default=False, kw_only=True)  # its pages freed
    # The job's span (the bus's, of the `run` endpoint): the parent of the steps that run in the
    # compute loop's and the handoff's tasks.
    span: Span = field(default=INVALID_SPAN, kw_only=True)
    # The first output token, sampled once the whole prompt is computed, and the sampler's
    # state after it (b"": greedy).
    first_token_id: int | None = field(default=None, kw_only=True)
    sampler_state: bytes = field(default=b"", kw_only=True)

    @property
    def request_id(self) -> str:
        return self.job.request.request_id

    @property
    def num_left(self) -> int:
        """Prompt tokens still to compute."""
        return len(self.token_ids) - self.seq.num_computed_tokens

    def timings(self) -> PrefillTimings:
        """The restore's times with the queue and compute times so far."""
        queue_s = (self.first_chunk_s or time.perf_counter()) - self.accepted_s
        return msgspec.structs.replace(
            self.restored, queue_ms=queue_s * 1000, compute_ms=self.compute_s * 1000
        )
