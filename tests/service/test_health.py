"""`/health` says what discovery says: 200 only while connected and SERVING -- 503 while the
service is still setting up, while it holds itself not ready (kv-index replaying its log),
and while draining. Ingress answers it on its API port from the same runtime state.
`/metrics` on the same port serves the registry discovery's STATS shows."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.ingress.config import IngressConfig
from services.ingress.main import setup as ingress_setup
from shared.bus import Context, Endpoint
from shared.config import ServiceConfig
from shared.discovery import discover
from shared.natsd import NatsServer
from shared.runtime import ServiceRuntime
from shared.schema import BadRequest, InstanceState
from shared.testing.fixtures import BusFactory
from tests.service.messages import Echo, EchoReply

pytestmark = pytest.mark.nats


async def get(url: str) -> tuple[int, dict[str, str]]:
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        return response.status, await response.json()


async def test_health_follows_setup_readiness_and_drain(
    nats_server: NatsServer, subject_root: str
) -> None:
    config = ServiceConfig(
        nats_url=nats_server.url,
        root=subject_root,
        instance_id="svc-0",
        metrics_port=0,
        shutdown_grace_s=0.5,
    )
    runtime = ServiceRuntime("svc", config)
    in_setup, finish_setup = asyncio.Event(), asyncio.Event()

    async def setup(rt: ServiceRuntime) -> None:
        in_setup.set()
        await finish_setup.wait()
        rt.hold_ready("replaying the event log up to 7")

    run = asyncio.create_task(runtime.run(setup))
    try:
        await asyncio.wait_for(in_setup.wait(), 10)
        url = runtime.metadata["health_url"]
        status, body = await get(url)
        assert (status, body["state"]) == (503, "starting")  # not set up yet
        base = url.removesuffix("/health")
        assert (await get(f"{base}/readyz"))[0] == 503
        # Alive all the same: liveness never waits on readiness (nor on NATS).
        assert await get(f"{base}/livez") == (
            200,
            {"status": "alive", "instance_id": "svc-0", "state": "starting"},
        )
        finish_setup.set()
        for _ in range(500):  # setup ends, then discovery starts: the reason shows from then on
            status, body = await get(url)
            if body.get("not_ready"):
                break
            await asyncio.sleep(0.01)
        assert (status, body["state"], body["status"]) == (503, "starting", "unavailable")
        assert body["not_ready"] == "replaying the event log up to 7"
        runtime.mark_ready()
        status, body = await get(url)
        assert (status, body["state"], body["nats_connected"]) == (200, "serving", True)
        assert "not_ready" not in body
    finally:
        runtime.request_stop()
        await asyncio.wait_for(run, 20)
    assert runtime.state is InstanceState.STOPPED  # it answered all it received
    assert runtime.health()[0] == 503


async def test_ingress_health_is_503_until_serving(
    nats_server: NatsServer, subject_root: str
) -> None:
    """Ingress's HTTP server is up (connected to NATS) before the instance is announced:
    a load balancer must not send it traffic yet."""
    config = IngressConfig(
        nats_url=nats_server.url,
        root=subject_root,
        instance_id="ingress-0",
        http_port=0,
        shutdown_grace_s=0.5,
    )
    runtime = ServiceRuntime("ingress", config)
    http_up, finish_setup = asyncio.Event(), asyncio.Event()

    async def slow_setup(rt: ServiceRuntime) -> None:
        await ingress_setup(rt)
        http_up.set()
        await finish_setup.wait()

    run = asyncio.create_task(runtime.run(slow_setup))
    try:
        await asyncio.wait_for(http_up.wait(), 10)
        url = f"{runtime.metadata['http_url']}/health"
        status, body = await get(url)
        assert (status, body["state"], body["nats_connected"]) == (503, "starting", True)
        assert (await get(f"{runtime.metadata['http_url']}/readyz"))[0] == 503
        assert await get(f"{runtime.metadata['http_url']}/livez") == (200, {"status": "alive"})
        finish_setup.set()
        for _ in range(500):
            status, body = await get(url)
            if status == 200:
                break
            await asyncio.sleep(0.01)
        assert (status, body["state"]) == (200, "serving")
    finally:
        runtime.request_stop()
        await asyncio.wait_for(run, 20)


async def test_metrics_are_served_beside_health_and_match_discovery(
    nats_server: NatsServer, subject_root: str, bus_factory: BusFactory
) -> None:
    """An endpoint's requests and errors by code, counted by the runtime for any service,
    in the text format with the instance's constant labels, and the same figures in STATS."""
    config = ServiceConfig(
        nats_url=nats_server.url,
        root=subject_root,
        instance_id="svc-0",
        metrics_port=0,
        shutdown_grace_s=0.5,
    )
    runtime = ServiceRuntime("svc", config)

    async def echo(request: Echo, ctx: Context) -> EchoReply:
        if request.fail_with:
            raise BadRequest(request.fail_with)
        return EchoReply(text=request.text, instance_id="svc-0")

    async def setup(rt: ServiceRuntime) -> None:
        await rt.bus.serve(Endpoint("ping", f"{rt.bus.subjects.root}.svc.ping", Echo, echo))

    run = asyncio.create_task(runtime.run(setup))
    try:
        for _ in range(500):
            if runtime.state is InstanceState.SERVING:
                break
            await asyncio.sleep(0.01)
        client = await bus_factory("test")
        for fail_with in ("", "refused", ""):
            with contextlib.suppress(BadRequest):
                await client.request(
                    f"{subject_root}.svc.ping", Echo("x", fail_with=fail_with), EchoReply
                )
        url = runtime.metadata["metrics_url"]
        async with aiohttp.ClientSession() as session, session.get(url) as response:
            assert response.status == 200
            assert response.headers["Content-Type"].startswith("text/plain")
            text = await response.text()
        series = {
            (s.name, s.labels.get("endpoint"), s.labels.get("code")): s
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }
        requests = series[("kvfabric_endpoint_requests_total", "ping", None)]
        assert requests.value == 3
        assert (requests.labels["service"], requests.labels["instance"]) == ("svc", "svc-0")
        assert series[("kvfabric_endpoint_errors_total", "ping", "BAD_REQUEST")].value == 1
        assert series[("kvfabric_endpoint_errors_total", "ping", "INTERNAL")].value == 0
        [instance] = await discover(client, service="svc")
        assert instance.metadata["metrics_url"] == runtime.metadata["metrics_url"]
        assert instance.metrics['kvfabric_endpoint_requests_total{endpoint="ping"}'] == 3
        key = 'kvfabric_endpoint_errors_total{endpoint="ping",code="BAD_REQUEST"}'
        assert instance.metrics[key] == 1
    finally:
        runtime.request_stop()
        await asyncio.wait_for(run, 20)


async def test_sigterm_drains_first_when_configured(
    nats_server: NatsServer, subject_root: str
) -> None:
    """With `sigterm_drain_s` (Kubernetes' rolling updates): SIGTERM reports DRAINING and
    waits for what the instance holds, then stops; unheld, it would have stopped at once."""
    config = ServiceConfig(
        nats_url=nats_server.url,
        root=subject_root,
        instance_id="svc-0",
        shutdown_grace_s=0.5,
        sigterm_drain_s=30.0,
    )
    runtime = ServiceRuntime("svc", config)
    streams = [1]  # one stream running until the test ends it
    runtime.in_flight = lambda: len(streams)
    serving = asyncio.Event()

    async def setup(rt: ServiceRuntime) -> None:
        serving.set()

    run = asyncio.create_task(runtime.run(setup))
    try:
        await asyncio.wait_for(serving.wait(), 10)
        while runtime.state is not InstanceState.SERVING:
            await asyncio.sleep(0.01)
        os.kill(os.getpid(), signal.SIGTERM)
        while runtime.state is not InstanceState.DRAINING:
            await asyncio.sleep(0.01)
        assert runtime.health()[0] == 503
        # Draining, not stopping: it holds a stream and keeps serving it.
        done, _ = await asyncio.wait({run}, timeout=0.5)
        assert not done
        streams.clear()  # the stream ends: the drain completes and the instance stops
        await asyncio.wait_for(run, 20)
        assert runtime.state is InstanceState.STOPPED
    finally:
        runtime.request_stop()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(run, 20)
