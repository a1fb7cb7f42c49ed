"""The fair prefill queue's order (worker/serving/fair_queue.py) and the engine scheduler
serving in it: lower levels first, accounts in turn, arrival; the oldest job leading one
contended pass in four, so a heavy job finishes under any stream of light ones; no state that
grows with jobs, sessions or accounts."""

from __future__ import annotations

import math
from dataclasses import dataclass

from worker.engine.block_allocator import BlockAllocator
from worker.engine.block_manager import BlockManager
from worker.engine.scheduler import Scheduler, SchedulerConfig
from worker.engine.sequence import Sequence
from worker.serving.fair_queue import OLDEST_EVERY_PASSES, FairOrder, QueuedJob

BUDGET = 2048  # a prefill pass's tokens (PrefillConfig.max_batch_tokens)


def job(arrival: int, level: int, account: str = "a") -> QueuedJob:
    return QueuedJob(arrival, level, account)


def arrivals(order: FairOrder, jobs: list[QueuedJob]) -> list[int]:
    return [j.arrival for j in order.order(jobs, lambda j: j)]


def test_lower_levels_first_then_accounts_in_turn_then_arrival() -> None:
    jobs = [job(0, 2), job(1, 0), job(2, 0), job(3, 0, "b"), job(4, 1, "b"), job(5, 0)]
    # level 0: a's first (1), b's first (3), a's second (2), a's third (5); then 1; then 2
    assert arrivals(FairOrder(), jobs) == [1, 3, 2, 5, 4, 0]


def test_one_contended_pass_in_four_leads_with_the_oldest() -> None:
    order = FairOrder()
    jobs = [job(7, 0), job(3, 3), job(9, 1)]
    firsts = [arrivals(order, jobs)[0] for _ in range(2 * OLDEST_EVERY_PASSES)]
    assert firsts == [7, 7, 7, 3] * 2
    alone = arrivals(order, [job(1, 4)])  # one job: no contention, not counted
    assert alone == [1] and order.num_contended_passes == 2 * OLDEST_EVERY_PASSES


@dataclass
class Simulated:
    job: QueuedJob
    num_left: int


def passes_until_done(order: FairOrder, heavy_tokens: int, max_passes: int) -> tuple[int, int]:
    """A heavy job (level 3) queued first, then a light job (level 0) of a whole pass arriving
    before every pass: light demand alone fills the worker. Each pass hands its budget out in
    `order`'s order. -> (passes until the heavy job is computed, or max_passes; its tokens)."""
    heavy = Simulated(job(0, 3), heavy_tokens)
    queued = [heavy]
    for n in range(1, max_passes + 1):
        queued.append(Simulated(job(n, 0, f"light-{n}"), BUDGET))
        budget = BUDGET
        for entry in order.order(queued, lambda s: s.job):
            took = min(entry.num_left, budget)
            entry.num_left -= took
            budget -= took
        queued = [s for s in queued if s.num_left]
        if heavy.num_left == 0:
            return n, heavy_tokens
    return max_passes, heavy_tokens - heavy.num_left


def test_a_heavy_job_finishes_under_any_stream_of_light_ones() -> None:
    heavy_tokens = 5 * BUDGET
    chunks = math.ceil(heavy_tokens / BUDGET)
    num_passes, _ = passes_until_done(FairOrder(), heavy_tokens, max_passes=1000)
    # one pass in four is the oldest job's while it is the oldest (it is, from the start)
    assert num_passes == OLDEST_EVERY_PASSES * chunks
    # without the oldest job's share it would wait for as long as light jobs keep coming
    _, computed = passes_until_done(FairOrder(oldest_every_passes=10**9), heavy_tokens, 1000)
    assert computed == 0


def test_the_order_keeps_no_state_per_job_session_or_account() -> None:
    order = FairOrder()
    before = set(vars(order))
    for n in range(2000):
        order.order([job(n, n % 5, f"acct-{n}"), job(n + 1, 0, f"acct-{n + 1}")], lambda j: j)
    assert set(vars(order)) == before
    assert vars(order)["num_contended_passes"] == 2000


def test_the_engine_scheduler_serves_in_the_given_order() -> None:
    manager = BlockManager(BlockAllocator(64), block_size_tokens=16)
    scheduler = Scheduler(manager, SchedulerConfig(max_num_batched_tokens=300, max_num_seqs=8))
    seqs = [Sequence(i, list(range(100))) for i in range(4)]
    for seq in seqs[:3]:
        scheduler.add(seq)
    rank = {2: 0, 0: 1, 1: 2}
    scheduler.reorder(lambda seq: rank[seq.seq_id])
    first = scheduler.schedule()
    assert [s.seq_id for s in first.prefill_seqs] == [2, 0, 1]
    for seq in seqs[:3]:
        seq.num_computed_tokens = 10  # as if each pass computed less (the scheduler cannot tell)
    scheduler.add(seqs[3])  # a newcomer, ranked first: served before those running
    rank = {3: 0, 1: 1, 2: 2, 0: 3}
    scheduler.reorder(lambda seq: rank[seq.seq_id])
    second = scheduler.schedule()
    # the newcomer first, then the running ones in their new order, the last with what is left
    assert [s.seq_id for s in second.prefill_seqs] == [3, 1, 2, 0]
    assert second.prefill_num_tokens == [100, 90, 90, 20]
