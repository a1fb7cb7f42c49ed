"""What a prefill worker reports as its queue: every job it holds, including one still
restoring its prefix. The router counts a job it sends only until the worker's next heartbeat
covers it, so a job the worker left out of its report looked like an idle worker while its
prefix loaded (seconds, on a loaded machine) and every next turn piled onto it."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from services.prefill.restore import PrefixRestorer
from shared.client import build_request
from shared.schema import PrefillDone, PrefillJob, ServiceError
from shared.testing.fixtures import BusFactory
from tests.service.test_worker_errors import BLOCK, decision, prefill_worker
from worker.mock_engine.simulated import simulated_model

pytestmark = pytest.mark.nats


async def test_a_job_restoring_its_prefix_is_in_the_reported_queue(
    bus_factory: BusFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    entered, release = asyncio.Event(), asyncio.Event()
    restore = PrefixRestorer.restore

    async def held_restore(self: PrefixRestorer, *args: object, **kwargs: object) -> object:
        entered.set()
        await release.wait()
        return await restore(self, *args, **kwargs)

    monkeypatch.setattr(PrefixRestorer, "restore", held_restore)
    bus = await bus_factory("prefill", "prefill-0")
    async with prefill_worker(bus, tmp_path, simulated_model) as (worker, config):
        idle = worker.load_fields()
        assert (idle["num_queued"], idle["num_queued_tokens"]) == (0, 0)
        client = await bus_factory("router")
        request = build_request(
            list(range(3, 103)), model=config.model_name, block_size_tokens=BLOCK
        )
        sent = asyncio.create_task(
            client.request(
                client.subjects.instance(client.subjects.prefill_run, "prefill-0"),
                PrefillJob(request=request, decision=decision(request.request_id)),
                PrefillDone,
                timeout_s=60,
            )
        )
        await asyncio.wait_for(entered.wait(), timeout=30)
        loading = worker.load_fields()
        assert (loading["num_queued"], loading["num_queued_tokens"]) == (1, 100)
        release.set()
        # No decode worker takes the suffix: the job ends in an error, its queue with it.
        with pytest.raises(ServiceError):
            await sent
        done = worker.load_fields()
        assert (done["num_queued"], done["num_queued_tokens"]) == (0, 0)
