"""Defects found on review, each end to end on a small mock cluster (real processes, NATS,
store, JetStream): an agent's next turn is not refused for pages its last turn already gave
back, and a prefill worker that cannot store its blocks after the handoff does not take
down the request decode is serving. The destructive test (the KV event log deleted) is last.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from services.admin.launcher import Cluster
from shared.client import build_request, generate
from shared.discovery import discover
from shared.models import BUNDLED_MODEL_DIR
from shared.subjects import BILLING, INGRESS, PREFILL, ROUTER
from tests.e2e.cluster_helpers import connect, run_cluster, two_nodes, usage_records

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

BLOCK = 16
MODEL = BUNDLED_MODEL_DIR.name
# One decode worker with room for one request at a time: 100 prompt + 60 answer tokens are
# 10 pages of 16 tokens, of 12.
PAGES = 12
WORKER_ARGS = [
    "--engine",
    "mock",
    "--kv-block-size-tokens",
    str(BLOCK),
    "--store-file-nbytes",
    str(8 << 20),
]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    yield from run_cluster(
        tmp_path_factory.mktemp("defects"),
        replicas={BILLING: 0, INGRESS: 0},
        extra_args={
            PREFILL: WORKER_ARGS,
            "decode": [*WORKER_ARGS, "--num-kv-blocks", str(PAGES)],
            ROUTER: ["--decode-page-size-tokens", str(BLOCK)],
        },
        ready_timeout_s=120,
        hosts=two_nodes,
    )


def _prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 4000) for _ in range(100)]


async def _router_metrics(bus) -> dict:  # noqa: ANN001
    [router] = await discover(bus, service=ROUTER)
    return router.metrics


async def test_the_next_turn_finds_the_pages_the_last_one_gave_back(cluster: Cluster) -> None:
    """Each turn needs 10 of the decode worker's 12 pages. The next request follows the
    final chunk at once, well inside one heartbeat period: the router must already know the
    pages are free (decode reports its load before it ends the stream), or it refuses the
    turn OVERLOADED (which `overload_wait_s=0` turns into a failure here)."""
    bus = await connect(cluster)
    try:
        ids = []
        for turn in range(6):
            request = build_request(
                _prompt(turn), model=MODEL, block_size_tokens=BLOCK, max_tokens=60
            )
            result = await generate(bus, request, overload_wait_s=0, liveness_timeout_s=10)
            assert result.usage is not None and result.usage.num_prompt_tokens == 100
            ids.append(result.request_id)
        metrics = await _router_metrics(bus)
        assert metrics['kvfabric_router_rejections_total{code="OVERLOADED"}'] == 0
        assert metrics['kvfabric_router_decisions_total{outcome="routed"}'] >= 6
        records = await usage_records(bus, set(ids), timeout_s=15)
        assert all(r.status == "completed" for r in records.values())
    finally:
        await bus.close()


async def test_a_prefill_worker_that_cannot_store_its_blocks_still_serves(
    cluster: Cluster,
) -> None:
    """With the KV event log gone, every block a worker stores fails to be logged. Prefill
    has handed its suffix to decode by then: the request completes, the failure is counted."""
    bus = await connect(cluster)
    try:
        assert await bus.js.delete_stream(bus.subjects.kv_events_stream)
        request = build_request(_prompt(99), model=MODEL, block_size_tokens=BLOCK, max_tokens=60)
        result = await generate(bus, request, overload_wait_s=0, liveness_timeout_s=10)
        assert result.finish_reason in ("stop", "length") and result.token_ids
        [prefill] = await discover(bus, service=PREFILL)
        assert prefill.metrics["kvfabric_prefill_store_failures_total"] >= 1
        assert prefill.metrics['kvfabric_prefill_jobs_ended_total{outcome="done"}'] >= 1
        records = await usage_records(bus, {request.request_id}, timeout_s=15)
        assert records[request.request_id].status == "completed"
    finally:
        await bus.close()
