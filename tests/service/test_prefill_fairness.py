"""A prefill worker's queue policy, on a real worker over the mock's simulated model and a
real nats-server: a short session's job that arrives while a heavy session's long prompt is
being computed is handed to decode first under `--queue-policy fair`, last under `fcfs`; a
fair worker reports its queue by level. The decode worker is a stand-in that records which
suffix it was told of first and accepts it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from services.prefill.config import PrefillConfig
from services.prefill.restore import PrefixRestorer, RestorePolicy
from services.prefill.worker import PrefillWorker
from shared.bus import Bus, Context, Endpoint
from shared.client import build_request
from shared.schema import JobAccepted, PrefillDone, PrefillJob, RouteDecision, SuffixReady
from shared.subjects import PREFILL
from shared.testing.fixtures import BusFactory
from worker.engine.worker import ModelThread, build_runner
from worker.kvstore.backends import alloc_staging
from worker.kvstore.writer import KvEventPublisher
from worker.mock_engine.simulated import simulated_model
from worker.serving.fair_queue import FAIR, FCFS, NUM_QUEUE_LEVELS
from worker.serving.kv_io import open_store
from worker.serving.staging import StagingSpace
from worker.transfer import KvTransferAgent

pytestmark = pytest.mark.nats

BLOCK = 16
PASS_TOKENS = 512  # a pass's budget: the long prompt takes three
LONG, SHORT = 1500, 100  # prompt tokens
# 3,000 simulated tokens/s: a pass of 512 takes 0.17 s, time for the short job to arrive
SPEEDUP = 0.05
STAGING_NBYTES = 32 << 20


@contextlib.asynccontextmanager
async def prefill_worker(bus: Bus, tmp_path: Path, policy: str) -> AsyncIterator[PrefillWorker]:
    config = PrefillConfig(
        engine="mock",
        store_dir=tmp_path,
        kv_block_size_tokens=BLOCK,
        mock_speedup=SPEEDUP,
        max_model_len=4096,
        max_batch_tokens=PASS_TOKENS,
        queue_policy=policy,
    )
    runner = build_runner(config, simulated_model)
    store = await open_store(config, bus.instance_id, runner.layout.block_nbytes)
    agent = KvTransferAgent(bus, alloc_staging(STAGING_NBYTES), service=PREFILL)
    thread, lock = ModelThread(), asyncio.Lock()
    worker = PrefillWorker(
        bus,
        runner,
        PrefixRestorer(runner, store, None, RestorePolicy(), lock, thread),
        KvEventPublisher(bus, store),
        None,
        agent,
        StagingSpace(0, STAGING_NBYTES),
        model_name=config.model_name,
        max_batch_tokens=config.max_batch_tokens,
        max_model_len=config.max_model_len,
        handoff_timeout_s=config.handoff_timeout_s,
        compute_lock=lock,
        model_thread=thread,
        queue_policy=config.queue_policy,
    )
    worker.start()
    try:
        await bus.serve(Endpoint("run", bus.subjects.prefill_run, PrefillJob, worker.handle_job))
        yield worker
    finally:
        await worker.stop()
        await thread.close()
        agent.close()
        store.close()


def job(name: str, token_ids: list[int], level: int) -> PrefillJob:
    request = build_request(
        token_ids, model="tiny-coder", block_size_tokens=BLOCK, max_tokens=4, request_id=name
    )
    decision = RouteDecision(
        request_id=name,
        prefill_worker_id="prefill-0",
        decode_worker_id="decode-0",
        num_prompt_tokens=len(token_ids),
        num_cached_blocks=0,
    )
    return PrefillJob(request=request, decision=decision, queue_level=level)


async def until(condition, timeout_s: float = 30.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.005)


@pytest.mark.parametrize(("policy", "first"), [(FCFS, "long"), (FAIR, "short")])
async def test_a_short_sessions_job_passes_a_heavy_ones_only_under_the_fair_policy(
    bus_factory: BusFactory, tmp_path: Path, policy: str, first: str
) -> None:
    told: list[str] = []

    async def decode_suffix(ready: SuffixReady, ctx: Context) -> JobAccepted:
        told.append(ready.request_id)
        return JobAccepted(request_id=ready.request_id, instance_id="decode-0")

    decode = await bus_factory("decode", "decode-0")
    await decode.serve(
        Endpoint(
            "suffix",
            decode.subjects.instance(decode.subjects.decode_suffix, "decode-0"),
            SuffixReady,
            decode_suffix,
        )
    )
    bus = await bus_factory("prefill", "prefill-0")
    # The log the worker writes its blocks' events to (kv-index makes it in a cluster).
    await bus.js.ensure_stream(bus.subjects.kv_events_stream, [bus.subjects.kv_events_all])
    async with prefill_worker(bus, tmp_path, policy) as worker:
        client = await bus_factory("router")
        run = client.subjects.instance(client.subjects.prefill_run, "prefill-0")

        def send(prefill_job: PrefillJob) -> asyncio.Task[PrefillDone]:
            return asyncio.create_task(client.request(run, prefill_job, PrefillDone, timeout_s=60))

        # A heavy session's long prompt (the router put it at level 2) starts computing...
        long = send(job("long", [3 + i % 4000 for i in range(LONG)], level=2))
        await until(lambda: 0 < worker.load_fields()["num_queued_tokens"] <= LONG - PASS_TOKENS)
        # ...and a new session's short one (level 0) arrives while it is.
        short = send(job("short", [4001 + i for i in range(SHORT)], level=0))
        if policy == FAIR:
            await until(lambda: worker.load_fields()["num_queued"] == 2)
            by_level = worker.load_fields()["num_queued_tokens_by_level"]
            assert len(by_level) == NUM_QUEUE_LEVELS
            assert by_level[0] == SHORT and by_level[2] > 0 and sum(by_level[3:]) == 0
        else:
            assert "num_queued_tokens_by_level" not in worker.load_fields()
        done = await asyncio.gather(long, short)
    assert [d.request_id for d in done] == ["long", "short"]  # both computed and handed off
    assert told[0] == first and sorted(told) == ["long", "short"]
