"""main.setup under the shared runtime (in process): the pooled endpoint answers, discovery
shows the router's metrics, and SIGTERM's path (request_stop) ends it cleanly."""

from __future__ import annotations

import asyncio

import pytest

from services.router.config import RouterConfig
from services.router.main import setup
from shared.discovery import discover
from shared.natsd import NatsServer
from shared.runtime import ServiceRuntime
from shared.schema import RouteDecision
from shared.subjects import DECODE, PREFILL, ROUTER
from shared.testing.fixtures import BusFactory
from tests.service.router.fakes import eventually, make_request, start_workers

pytestmark = [pytest.mark.nats]


async def test_setup_serves_generate_and_reports_metrics(
    nats_server: NatsServer, subject_root: str, bus_factory: BusFactory
) -> None:
    [p1] = await start_workers(bus_factory, PREFILL, {})
    [d1] = await start_workers(bus_factory, DECODE, {})
    for worker in (p1, d1):
        await worker.serve()
        worker.beat_every(0.05)  # inside the router's warm-up (its heartbeat_s)
    config = RouterConfig(
        nats_url=nats_server.url,
        root=subject_root,
        instance_id="router-main",
        heartbeat_s=0.2,
        shutdown_grace_s=1.0,
        match_timeout_s=0.1,
    )
    runtime = ServiceRuntime(ROUTER, config)
    running = asyncio.create_task(runtime.run(setup))
    client = await bus_factory("ingress", "ingress-0")
    try:
        await eventually(lambda: runtime.state == "serving")
        decision = await client.request(
            client.subjects.router_generate, make_request(), RouteDecision
        )
        assert (decision.prefill_worker_id, decision.decode_worker_id) == ("prefill-1", "decode-1")
        await eventually(lambda: len(p1.jobs) == 1)
        [instance] = await discover(client, service=ROUTER)
        assert instance.instance_id == "router-main"
        assert instance.metrics['kvfabric_router_decisions_total{outcome="routed"}'] == 1
        assert instance.metrics["kvfabric_router_cold_index_total"] == 1  # no kv-index here
    finally:
        runtime.request_stop()
        await asyncio.wait_for(running, timeout=10)
        for worker in (p1, d1):
            await worker.stop_beating()
    assert running.exception() is None
