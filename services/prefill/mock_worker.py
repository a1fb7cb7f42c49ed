"""The mock prefill worker (`--engine mock`): the real worker's endpoints and messages, with
simulated compute (docs/request-flow.md; what both mock workers share: worker/mock_engine/;
what this shares with the model's worker -- the job table, batching, deadlines, the
handoff's messages -- jobs.py).

One job: "restore" the cached prefix (sleep CostModel's load of it, plus a bounded replay
when the router found no window snapshot) -> wait its turn -> "compute" every prompt token
but the last, in chunks under `max_batch_tokens` per simulated forward pass, each pass slept
for its simulated time -> `SuffixReady` to decode, with nothing staged (decode pulls no
bytes) -> write the new complete blocks (placeholder bytes) to the real store and log them for
kv-index, put a placeholder window snapshot at the last block boundary into swa-memcache (so
the router sees it, as it would the real one) -> `PrefillDone`.

The KV pool is only counted (the model's allocator, no bytes): a job holds ceil(n / block)
pages from its first chunk until it is done, and jobs start first come, first served while
pages last. No torch, no NIXL.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field

from services.prefill.config import PrefillConfig
from services.prefill.handoff import put_window, tell_decode
from services.prefill.jobs import JobState, PrefillJobsBase
from shared import telemetry
from shared.blocks import RequestBlocks
from shared.bus import Bus
from shared.metrics import Metrics
from shared.schema import PrefillJob, PrefillTimings
from worker.cost_model import CostModel
from worker.engine.block_allocator import BlockAllocator
from worker.kvstore.writer import KvEventPublisher
from worker.mock_engine import MockModel, sleep_simulated
from worker.serving.kv_io import store_payloads
from worker.swa_client import SwaClient

# swa-memcache keeps it inline; a real window's size (96 KiB for tiny-coder) is not simulated.
MOCK_SNAPSHOT_NBYTES = 1024


@dataclass(eq=False)
class MockJob(JobState):
    num_computed_tokens: int  # from the restored prefix on
    pages: list[int] = field(default_factory=list)  # the pool's, held from the first chunk on

    @property
    def num_left(self) -> int:
        return self.target - self.num_computed_tokens


class MockPrefillWorker(PrefillJobsBase[MockJob]):
    def __init__(
        self,
        bus: Bus,
        publisher: KvEventPublisher,
        swa: SwaClient | None,
        config: PrefillConfig,
        model: MockModel,
        cost: CostModel | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        super().__init__(
            bus,
            publisher,
            swa,
            model_name=model.name,
            max_model_len=model.max_model_len,
            block_size_tokens=config.kv_block_size_tokens,
            max_batch_tokens=config.max_batch_tokens,
            handoff_timeout_s=config.handoff_timeout_s,
            metrics=metrics,
        )
        self.config = config
        self.model = model
        self.cost = cost or CostModel()
        self.allocator = BlockAllocator(config.pool_pages(config.mock_block_nbytes))
        self._payload = bytes(config.mock_block_nbytes)

    def kv_pages(self) -> tuple[int, int]:
        return self.allocator.num_blocks, self.allocator.num_free_blocks

    # -- jobs ----------------------------------------------------------------------------
    async def _admit(
        self,
        job: PrefillJob,
        token_ids: list[int],
        blocks: RequestBlocks,
        num_cached_blocks: int,
        accepted_s: float,
    ) -> MockJob:
        num_cached_tokens = num_cached_blocks * self.block_size
        restored = await self._restore(num_cached_tokens, job.decision.has_swa_snapshot)
        return MockJob(
            job,
            token_ids,
            blocks,
            asyncio.get_running_loop().create_future(),
            accepted_s,
            restored,
            num_cached_blocks,
            num_cached_tokens,
        )

    async def _restore(self, num_cached_tokens: int, has_snapshot: bool) -> PrefillTimings:
        """Sleep the simulated store read of the prefix and the window's restore."""
        if num_cached_tokens == 0:
            return PrefillTimings(swa_restore="none")
        speedup = self.config.mock_speedup
        with telemetry.span("prefill load") as span:
            load_s = await sleep_simulated(self.cost.prefill_s(0, num_cached_tokens), speedup)
            if span.is_recording():  # simulated: the mock reads nothing back
                num_blocks = num_cached_tokens // self.block_size
                span.set_attributes(
                    {
                        "kvfabric.tier": "ssd",
                        "kvfabric.simulated": True,
                        "kvfabric.num_blocks": num_blocks,
                    }
                )
        num_replay = self.cost.num_replay_tokens(num_cached_tokens, has_snapshot)
        with telemetry.span("prefill window") as span:
            restore_s = await sleep_simulated(self.cost.prefill_s(0, 0, num_replay), speedup)
            if span.is_recording():
                mode = "snapshot" if has_snapshot else "bounded"
                span.set_attributes(
                    {"kvfabric.swa_restore": mode, "kvfabric.num_replay_tokens": num_replay}
                )
        return PrefillTimings(
            load_ms=load_s * 1000,
            restore_ms=restore_s * 1000,
            swa_restore="snapshot" if has_snapshot else "bounded",
            num_replay_tokens=num_replay,
        )

    def _release(self, entry: MockJob) -> None:
        self.allocator.free(entry.pages)
        entry.pages = []
        self._wake.set()  # the head of the queue may have waited for these pages

    # -- the simulated model -------------------------------------------------------------
    def _schedule(self) -> list[tuple[MockJob, int]]:
        """Jobs in arrival order, each taking its pages at its first chunk, while the budget
        lasts; first come, first served: nobody overtakes a job that waits for pages. 0
        tokens: a fully cached prompt, done after this pass."""
        budget, batch = self.max_batch_tokens, []
        for entry in self._jobs.values():
            if budget == 0:
                break
            if entry.finishing:
                continue
            if not entry.pages:
                num_pages = math.ceil(len(entry.token_ids) / self.block_size)
                if not self.allocator.can_allocate(num_pages):
                    break
                entry.pages = self.allocator.allocate(num_pages)
            num_tokens = min(entry.num_left, budget)
            batch.append((entry, num_tokens))
            budget -= num_tokens
        return batch

    async def _forward(self, batch: list[tuple[MockJob, int]]) -> float:
        num_tokens = sum(n for _, n in batch)
        return await sleep_simulated(self.cost.prefill_s(num_tokens), self.config.mock_speedup)

    def _advance(self, entry: MockJob, num_tokens: int) -> None:
        entry.num_computed_tokens += num_tokens

    # -- handoff -------------------------------------------------------------------------
    async def _send_suffix(self, entry: MockJob) -> tuple[PrefillTimings, float]:
        """Nothing is staged: decode pulls no bytes and answers at once."""
        timings = entry.timings()
        transfer_ms = await tell_decode(
            self.bus,
            entry,
            timings,
            num_blocks=0,
            block_nbytes=self.config.mock_block_nbytes,
            region_offset=0,
            window_nbytes=0,
            timeout_s=self.handoff_timeout_s,
        )
        return timings, transfer_ms

    async def _persist(self, entry: MockJob) -> None:
        """Placeholder blocks and window, at the places the model's would go."""
        first_block, end_block = entry.num_cached_blocks, entry.blocks.num_prefill_blocks
        payloads = [self._payload] * max(end_block - first_block, 0)
        num_stored = await store_payloads(
            self.publisher, entry.token_ids, entry.blocks, first_block, payloads
        )
        self.counts.blocks_stored.inc(num_stored)
        span = telemetry.current_span()  # prefill store
        if span.is_recording():
            span.set_attributes(
                {
                    "kvfabric.num_blocks": num_stored,
                    "kvfabric.bytes": num_stored * len(self._payload),
                }
            )
        if self.swa is None or not payloads:
            return  # the boundary lies in the restored prefix: its snapshot was put before
        if await put_window(self.swa, entry, bytes(MOCK_SNAPSHOT_NBYTES)):
            self.counts.snapshots_put.inc()
