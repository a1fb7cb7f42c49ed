"""The order a prefill worker computes its queued jobs in under `--queue-policy fair`
(docs/services.md, 'queue policy'); `fcfs`, the default, keeps arrival order.

Each job carries a queue level from the router (`PrefillJob.queue_level`,
services/router/sessions.py): 0 for a session that has used little of the cluster, one more
each time what it used (this job included) grows fourfold. Every forward pass hands its
token budget out in this order:

1. lower level first: a short session's turn is not stuck behind a long session's huge
   prefill (a multilevel feedback queue, as FastServe and Tiresias use, keyed on what the
   session consumed rather than on the job alone);
2. within a level, accounts in turn (each account's oldest job, then each one's second, ...),
   so one account's many sessions do not crowd out another account's;
3. then arrival.

No starvation: of the passes where jobs compete, one in `OLDEST_EVERY_PASSES` leads with
the oldest job, whatever its level. Work of any level keeps at least that share of the
passes, and a job, once the oldest, finishes within `OLDEST_EVERY_PASSES` times as many
passes as its chunks. The state is a pass counter: nothing grows with sessions or accounts.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

FCFS, FAIR = "fcfs", "fair"
QUEUE_POLICIES = (FCFS, FAIR)
NUM_QUEUE_LEVELS = 5  # the router's thresholds make this many (services/router/sessions.py)
# One contended pass in 4 goes to the oldest job first (its chunk may take the whole budget):
# a long session's prefill keeps a quarter of the passes however many short ones arrive,
# and a short one waits for at most one such pass in four.
OLDEST_EVERY_PASSES = 4

T = TypeVar("T")


@dataclass(frozen=True)
class QueuedJob:
    arrival: int  # any number that grows with arrival order (the engine's seq id)
    level: int
    account: str


class FairOrder:
    def __init__(self, oldest_every_passes: int = OLDEST_EVERY_PASSES) -> None:
        if oldest_every_passes < 2:
            raise ValueError(f"oldest_every_passes must be >= 2, got {oldest_every_passes}")
        self.oldest_every_passes = oldest_every_passes
        self.num_contended_passes = 0

    def order(self, items: Sequence[T], job_of: Callable[[T], QueuedJob]) -> list[T]:
        """`items` in the order the next pass serves them (call once per pass)."""
        jobs = sorted(((job_of(item), item) for item in items), key=lambda p: p[0].arrival)
        if len(jobs) < 2:
            return [item for _, item in jobs]
        self.num_contended_passes += 1
        turns: Counter[tuple[int, str]] = Counter()
        keyed = []
        for job, item in jobs:
            turn = turns[job.level, job.account]
            turns[job.level, job.account] += 1
            keyed.append(((job.level, turn, job.arrival), item))
        ordered = [item for _, item in sorted(keyed, key=lambda p: p[0])]
        if self.num_contended_passes % self.oldest_every_passes == 0:
            oldest = jobs[0][1]
            ordered.remove(oldest)
            ordered.insert(0, oldest)
        return ordered
