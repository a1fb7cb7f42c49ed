"""Routing on each worker's own cache, live: two prefill workers on the mock engine (the
production worker code over a simulated model) tell kv-index what their pools and host tiers
hold; an agent's next turn goes to the worker that holds its earlier turns in memory, where
the shared store holds them for both."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator

import pytest

from services.admin.launcher import Cluster
from shared.blocks import RequestBlocks
from shared.bus import Bus
from shared.client import GenerateResult
from shared.schema import LoadReport
from shared.subjects import BILLING, DECODE, INGRESS, PREFILL, ROUTER
from tests.e2e.cluster_helpers import connect, num_indexed_blocks, run_cluster
from tests.e2e.test_host_tier import BLOCK, MOCK_ARGS, MODEL, VOCAB, ask, held_by

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

NUM_SESSIONS, NUM_TURNS = 4, 3


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    yield from run_cluster(
        tmp_path_factory.mktemp("tier-routing"),
        replicas={PREFILL: 2, DECODE: 1, BILLING: 0, INGRESS: 0},
        extra_args={
            PREFILL: MOCK_ARGS,
            DECODE: MOCK_ARGS,
            ROUTER: ["--decode-page-size-tokens", str(BLOCK)],
        },
        ready_timeout_s=120,
        # Each worker a host of its own: neither prefill is nearer decode than the other.
        hosts={"prefill-0": "node-a", "prefill-1": "node-b", "decode-0": "node-c"},
    )


async def test_an_agents_next_turn_goes_to_the_worker_holding_its_context(
    cluster: Cluster,
) -> None:
    rng = random.Random(5)
    bus = await connect(cluster)
    try:
        sessions = [[rng.randrange(3, VOCAB) for _ in range(160)] for _ in range(NUM_SESSIONS)]
        served_by: list[list[str]] = [[] for _ in sessions]

        async def after(index: int, prompt: list[int], result: GenerateResult) -> None:
            """Record the turn; once kv-index has heard that its worker holds it, the
            session's next prompt (an agent's tool call outlasts that)."""
            worker = result.decision.prefill_worker_id
            served_by[index].append(worker)
            context = prompt + result.token_ids
            hashes = RequestBlocks.hash_prompt(context, model=MODEL, block_size_tokens=BLOCK).hashes
            num_complete = len(prompt) // BLOCK  # what prefill tagged in its pool
            assert await num_indexed_blocks(bus, hashes, timeout_s=10.0) >= num_complete
            own = await held_by(bus, hashes, worker, lambda h: h.num_blocks >= num_complete)
            assert own.num_blocks >= num_complete
            sessions[index] = context + [rng.randrange(3, VOCAB) for _ in range(40)]

        # First turns at once: the router spreads them over both workers by their queues.
        firsts = await asyncio.gather(*(ask(bus, prompt) for prompt in sessions))
        for index, (prompt, result) in enumerate(zip(list(sessions), firsts, strict=True)):
            await after(index, prompt, result)
        assert {turns[0] for turns in served_by} == {"prefill-0", "prefill-1"}, served_by
        # Then one at a time on idle workers, where only the cache tells them apart (a tie
        # goes to prefill-0): each session stays with the worker holding its context in
        # memory, though the store holds it for both.
        for _ in range(NUM_TURNS - 1):
            for index, prompt in enumerate(sessions):
                await idle_reported(bus)
                result = await ask(bus, prompt)
                assert result.decision.prefill_worker_id == served_by[index][-1], served_by
                await after(index, prompt, result)
    finally:
        await bus.close()


async def idle_reported(bus: Bus) -> None:
    """Until each prefill worker has beaten once more with nothing queued: the router weighs
    queues by these reports, and an agent's tool call outlasts a heartbeat."""
    idle: set[str] = set()
    done = asyncio.Event()

    async def on_beat(report: LoadReport) -> None:
        if report.num_queued == 0 and report.num_queued_tokens == 0:
            idle.add(report.instance_id)
            if len(idle) == 2:
                done.set()

    subscriptions = [
        await bus.subscribe(bus.subjects.load(PREFILL, f"prefill-{i}"), LoadReport, on_beat)
        for i in range(2)
    ]
    try:
        await asyncio.wait_for(done.wait(), 10.0)
    finally:
        for subscription in subscriptions:
            await bus.unsubscribe(subscription)
