"""The simulated workers of the offline replay: what a prefill and a decode worker hold and
report, timed by the cost model (offline.py drives them)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from loadtest.trace.synth import TraceRequest
from shared.blocks import RequestBlocks


@dataclass(eq=False)
class SimPrefill:
    """A prefill worker running its jobs one after another, first come, first served."""

    worker_id: str
    node_id: str
    free_at_s: float = 0.0  # when its last queued job ends
    busy_s: float = 0.0  # the duration of every job it was given
    jobs: deque[tuple[float, float, int]] = field(default_factory=deque)  # start, end, tokens

    def enqueue(self, now_s: float, duration_s: float, num_tokens: int) -> float:
        """Queue a job of `num_tokens` (compute-token equivalents); returns when it ends."""
        start_s = max(now_s, self.free_at_s)
        self.free_at_s = start_s + duration_s
        self.busy_s += duration_s
        self.jobs.append((start_s, self.free_at_s, num_tokens))
        return self.free_at_s

    def finish(self) -> None:
        """The job at the head ended (first come, first served: always the head)."""
        self.jobs.popleft()

    def num_queued_tokens(self, now_s: float) -> int:
        """What its heartbeat reports: tokens still to compute, in queued jobs and what is
        left of the running one."""
        total = 0.0
        for start_s, end_s, num_tokens in self.jobs:
            left = 1.0 if start_s >= now_s else (end_s - now_s) / max(end_s - start_s, 1e-12)
            total += num_tokens * left
        return round(total)


@dataclass(eq=False)
class SimDecode:
    worker_id: str
    num_running: int = 0
    num_pages_used: int = 0


@dataclass(eq=False)
class Job:
    """One request between its routing and the end of its decode."""

    request: TraceRequest
    blocks: RequestBlocks
    arrival_s: float
    prefill: SimPrefill
    decode: SimDecode
    num_cached_blocks: int
    num_pages: int
    num_local_blocks: int = 0  # of the cached, loaded from the prefill worker's own memory
