"""The lifecycle every service process shares (its main.py only wires its endpoints):

start: config logged once -> logging and tracing -> connect -> (`/metrics` and `/health`
when a `metrics_port` is set) -> `setup` (endpoints, HTTP, the service's metrics) -> the
endpoints' metrics -> discovery and heartbeats -> serve until SIGTERM/SIGINT.
stop: heartbeat says draining -> stop announcing (heartbeats, discovery) -> stop taking work
and finish in-flight requests within `shutdown_grace_s` -> a last report says STOPPED when
every request it received was answered (a caller still waiting sends again elsewhere) -> the
service's cleanup hooks -> drain the connection. Every step is safe to repeat.

drain (`DrainRequest` on the instance's drain subject, `kvfabric drain`, or SIGTERM when
`sigterm_drain_s` is set): planned maintenance. The instance reports DRAINING while it keeps
heartbeating and serving what it has (routers send it nothing new; callers watching its
heartbeats see it alive), waits until
`in_flight()` is 0 or the request's grace passes, then stops as above and exits 0 (its
launcher starts it again at once).

Ready: an instance is SERVING once set up, unless its setup said it is not ready yet
(`hold_ready(reason)`: kv-index still replaying its event log); it then reports STARTING, in
its heartbeats, in discovery (with the reason) and on `/health` (503), until `mark_ready()`.

Metrics: `runtime.metrics` is the process's one registry (shared/metrics.py). The service
declares its own in `setup`; the runtime adds every endpoint's requests, errors by code and
processing time, and the requests in flight. /metrics, discovery's STATS and `kvfabric
status --json` all read it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from aiohttp import web

from shared import telemetry
from shared.bus import Bus, now_ms
from shared.bus.wire import RawMessage
from shared.config import ServiceConfig
from shared.discovery import DiscoveryResponder
from shared.logging import configure_logging, get_logger
from shared.metrics import CONTENT_TYPE, Metrics
from shared.schema import (
    DrainAccepted,
    DrainRequest,
    ErrorCode,
    InstanceState,
    LoadReport,
    ServiceError,
    decode,
)
from shared.schema import base as schema_base
from shared.streams import stream_state
from shared.tasks import cancel_and_wait

VERSION = "0.1.0"
log = get_logger(__name__)


def process_age_s() -> float | None:
    """Seconds since this process started (Linux's /proc; None elsewhere): the interpreter's
    start and the imports, which a restart pays before `run` is reached."""
    try:
        with open("/proc/self/stat") as f:
            # Field 22 (starttime, clock ticks after boot); the name in field 2 may hold spaces.
            started_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime_s = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return uptime_s - started_ticks / os.sysconf("SC_CLK_TCK")


class ServiceRuntime:
    def __init__(self, service: str, config: ServiceConfig, *, description: str = "") -> None:
        self.service = service
        self.config = config
        self.instance_id = config.resolved_instance_id(service)
        self.description = description
        self.metadata: dict[str, str] = {"node_id": config.node_id}
        self.state = InstanceState.STARTING
        # A service sets this to report its own queue and KV figures in heartbeats.
        self.load_fields: Callable[[], dict[str, Any]] = dict
        # Work a drain waits for besides handlers in flight (a worker's running streams).
        self.in_flight: Callable[[], int] = lambda: 0
        self._draining: asyncio.Task[None] | None = None
        self.metrics = Metrics(service, self.instance_id)
        self._bus: Bus | None = None
        self._discovery: DiscoveryResponder | None = None
        self._heartbeat: asyncio.Task[None] | None = None
        self._cleanups: list[Callable[[], Awaitable[None]]] = []
        self._duties: list[asyncio.Task[None]] = []
        self._stop = asyncio.Event()
        self._num_heartbeats = 0
        self._is_set_up = False
        self._is_shut_down = False
        self.not_ready_reason: str | None = None
        self._http: web.AppRunner | None = None

    @property
    def bus(self) -> Bus:
        if self._bus is None:
            raise RuntimeError("runtime not started")
        return self._bus

    def on_stop(self, cleanup: Callable[[], Awaitable[None]]) -> None:
        """Run `cleanup` at shutdown, after in-flight requests finished (last added, first run)."""
        self._cleanups.append(cleanup)

    def every(self, interval_s: float, duty: Callable[[], Awaitable[Any]]) -> None:
        """Run `duty` every `interval_s` until shutdown (a failure is logged, not fatal)."""

        async def loop() -> None:
            while True:
                await asyncio.sleep(interval_s)
                try:
                    await duty()
                except Exception:
                    log.exception("periodic duty failed", duty=getattr(duty, "__qualname__", "?"))

        self._duties.append(asyncio.create_task(loop()))

    def request_stop(self) -> None:
        self._stop.set()

    def _on_sigterm(self) -> None:
        """Drain first when configured (and set up), as `kvfabric drain` would; a second
        SIGTERM, or one before the instance serves, stops at once."""
        if self.config.sigterm_drain_s > 0 and self._is_set_up and self._draining is None:
            self._draining = asyncio.create_task(self._drain(self.config.sigterm_drain_s))
        else:
            self.request_stop()

    # -- readiness -----------------------------------------------------------------------
    def hold_ready(self, reason: str) -> None:
        """Report STARTING, with `reason`, until `mark_ready` (the endpoints still serve)."""
        self.not_ready_reason = reason
        if self.state is InstanceState.SERVING:
            self.state = InstanceState.STARTING

    def mark_ready(self) -> None:
        self.not_ready_reason = None
        if self._is_set_up and self.state is InstanceState.STARTING:
            self.state = InstanceState.SERVING

    def health(self) -> tuple[int, dict[str, Any]]:
        """(HTTP status, body) of `/readyz` (and `/health`): 200 only while connected and
        SERVING."""
        connected = self._bus is not None and self._bus.is_connected
        is_ok = connected and self.state is InstanceState.SERVING
        body: dict[str, Any] = {
            "status": "ok" if is_ok else "unavailable",
            "instance_id": self.instance_id,
            "state": str(self.state),
            "nats_connected": connected,
        }
        if self.not_ready_reason:
            body["not_ready"] = self.not_ready_reason
        return (200 if is_ok else 503), body

    def liveness(self) -> tuple[int, dict[str, Any]]:
        """(HTTP status, body) of `/livez`: 200 while the process's event loop answers. Not
        tied to NATS: a server outage must not get every process restarted (readiness takes
        them out of rotation instead; they reconnect by themselves)."""
        return 200, {"status": "alive", "instance_id": self.instance_id, "state": str(self.state)}

    async def _serve_http(self, host: str, port: int) -> None:
        """`/readyz` (`/health` too), `/livez` and `/metrics` on the process's own port
        (`metrics_port`)."""

        def answer(check: Callable[[], tuple[int, dict[str, Any]]]) -> Callable:
            async def handler(_: web.Request) -> web.Response:
                status, body = check()
                return web.json_response(body, status=status)

            return handler

        health, live = answer(self.health), answer(self.liveness)

        async def metrics(_: web.Request) -> web.Response:
            response = web.Response(body=self.metrics.exposition())
            response.headers["Content-Type"] = CONTENT_TYPE
            return response

        app = web.Application()
        app.router.add_get("/health", health)
        app.router.add_get("/readyz", health)
        app.router.add_get("/livez", live)
        app.router.add_get("/metrics", metrics)
        self._http = web.AppRunner(app, access_log=None)
        await self._http.setup()
        await web.TCPSite(self._http, host, port).start()
        bound_host, bound_port = self._http.addresses[0][:2]
        self.metadata["health_url"] = f"http://{bound_host}:{bound_port}/health"
        self.metadata["metrics_url"] = f"http://{bound_host}:{bound_port}/metrics"

    def _declare_endpoint_metrics(self) -> None:
        """Every endpoint `setup` served: requests, errors by code, processing time (the
        bus's own counts, read when scraped); and the requests in flight."""
        bus = self.bus
        self.metrics.gauge_from(
            "kvfabric_nats_connected",
            "1 while the connection to NATS is up, 0 while it reconnects.",
            lambda: int(bus.is_connected),
        )
        self.metrics.gauge_from(
            "kvfabric_instance_serving",
            "1 while the instance takes new work (SERVING); 0 starting (kv-index replaying "
            "its log) or draining.",
            lambda: int(self.state is InstanceState.SERVING),
        )
        self.metrics.gauge_from(
            "kvfabric_inflight_requests",
            "Requests being handled now, every endpoint's.",
            lambda: bus.num_inflight,
        )
        kinds = tuple(t.__name__ for t in schema_base.message_types())
        self.metrics.counter_from(
            "kvfabric_malformed_messages_total",
            "Messages that did not decode as the type expected (requests answered "
            "BAD_REQUEST, events dropped), by that type: garbage on a subject this process "
            "listens on.",
            lambda: {k: n for k, n in schema_base.malformed.items() if k in kinds},
            labels={"message": kinds},
        )
        names = tuple(s.name for s in bus.endpoint_stats())
        if not names:
            return  # a service that serves no endpoint (ingress: HTTP only)

        def served() -> list[Any]:
            return [s for s in bus.endpoint_stats() if s.name in names]

        labels = {"endpoint": names}
        self.metrics.counter_from(
            "kvfabric_endpoint_requests_total",
            "Requests each endpoint received.",
            lambda: {s.name: s.num_requests for s in served()},
            labels=labels,
        )
        self.metrics.counter_from(
            "kvfabric_endpoint_errors_total",
            "Error replies of each endpoint, by error code.",
            lambda: {
                (s.name, code): n for s in served() for code, n in s.num_errors_by_code.items()
            },
            labels={"endpoint": names, "code": ErrorCode},
        )
        self.metrics.counter_from(
            "kvfabric_endpoint_processing_seconds_total",
            "Time each endpoint's handlers ran, summed over its requests.",
            lambda: {s.name: s.processing_time_ns / 1e9 for s in served()},
            labels=labels,
        )

    def load_report(self) -> LoadReport:
        self._num_heartbeats += 1
        return LoadReport(
            service=self.service,
            instance_id=self.instance_id,
            seq=self._num_heartbeats,
            ts_ms=now_ms(),
            state=self.state,
            node_id=self.config.node_id,
            num_inflight=self._bus.num_inflight if self._bus else 0,
            **self.load_fields(),
        )

    async def run(self, setup: Callable[[ServiceRuntime], Awaitable[None]]) -> None:
        started_at = time.monotonic()
        started_age_s = process_age_s()
        configure_logging(
            service=self.service, instance_id=self.instance_id, level=self.config.log_level
        )
        telemetry.setup_tracing(
            self.service,
            self.instance_id,
            otlp_endpoint=self.config.otlp_endpoint,
            trace_dir=self.config.trace_dir,
            sample_ratio=self.config.trace_sample_ratio,
        )
        log.info("config", **(self.config.to_log() | {"instance_id": self.instance_id}))
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self._on_sigterm)
        loop.add_signal_handler(signal.SIGINT, self.request_stop)
        try:
            self._bus = await Bus.connect(
                self.config.nats_url,
                service=self.service,
                instance_id=self.instance_id,
                root=self.config.root,
                connect_timeout_s=self.config.connect_timeout_s,
                creds=self.config.nats_creds,
                tls_ca=self.config.nats_tls_ca,
            )
            self._bus.js.replicas = self.config.js_replicas
            connected_at = time.monotonic()
            if self.config.metrics_port is not None:
                await self._serve_http(self.config.metrics_host, self.config.metrics_port)
            await setup(self)
            self._declare_endpoint_metrics()
            self._discovery = DiscoveryResponder(
                self._bus,
                version=VERSION,
                description=self.description,
                metadata=self.metadata,
                load_report=self.load_report,
                metrics=self.metrics.snapshot,
                not_ready=lambda: self.not_ready_reason,
            )
            await self._discovery.start()
            await self._bus.subscribe_raw(
                self._bus.subjects.drain(self.instance_id), self._on_drain
            )
            await self._bus.subscribe_raw(self._bus.subjects.ping(self.instance_id), self._on_ping)
            self._is_set_up = True
            if self.not_ready_reason is None:
                self.state = InstanceState.SERVING
            self._heartbeat = asyncio.create_task(self._beat())
            await self._bus.flush()
            # Where a restart's time goes (the start-up budget of a control-plane instance).
            now = time.monotonic()
            log.info(
                "serving",
                nats_url=self.config.nats_url,
                root=self.config.root,
                start_s=round(started_age_s, 3) if started_age_s is not None else None,
                connect_s=round(connected_at - started_at, 3),
                setup_s=round(now - connected_at, 3),
            )
            await self._stop.wait()
            log.info("stopping")
        finally:
            await self.shutdown()

    def num_in_flight(self) -> int:
        return (self._bus.num_inflight if self._bus else 0) + self.in_flight()

    async def _on_ping(self, msg: RawMessage) -> None:
        """Alive; a ping that names a request is answered whether its stream is still open
        here (the caller of a stalled stream probes)."""
        if msg.reply:
            request_id = msg.data.decode(errors="replace")
            await self.bus.publish_raw(
                msg.reply, stream_state(self.bus, request_id) if request_id else b""
            )

    async def _on_drain(self, msg: RawMessage) -> None:
        try:
            request = decode(msg.data, DrainRequest)
        except msgspec.DecodeError as exc:
            log.warning("malformed drain request", error=str(exc))
            return
        if msg.reply:
            accepted = DrainAccepted(
                instance_id=self.instance_id, num_in_flight=self.num_in_flight()
            )
            await self.bus.publish(msg.reply, accepted)
        if self._draining is None and not self._stop.is_set():
            self._draining = asyncio.create_task(self._drain(request.grace_s))

    async def _drain(self, grace_s: float) -> None:
        log.info("draining", num_in_flight=self.num_in_flight(), grace_s=grace_s)
        self.state = InstanceState.DRAINING
        await self.publish_load_report()  # routers stop choosing it now, not at the next beat
        deadline = asyncio.get_running_loop().time() + grace_s
        while self.num_in_flight() and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        log.info("drained", num_left=self.num_in_flight())
        self.request_stop()

    async def publish_load_report(self) -> None:
        """A heartbeat now, between the periodic ones: a worker whose load just dropped (a
        decode worker freed a finished sequence's pages) says so before its caller's next
        request reaches the router."""
        if self._bus is not None and self._bus.is_connected:
            await self._bus.publish(
                self._bus.subjects.load(self.service, self.instance_id), self.load_report()
            )

    async def _beat(self) -> None:
        while True:
            await self.publish_load_report()
            await asyncio.sleep(self.config.heartbeat_s)

    async def shutdown(self) -> None:
        if self._is_shut_down:
            return
        self._is_shut_down = True
        self.state = InstanceState.DRAINING
        await cancel_and_wait(self._heartbeat)
        await self.publish_load_report()  # draining: routers stop sending work at once
        if self._draining is not None and self._draining is not asyncio.current_task():
            await cancel_and_wait(self._draining)
        if self._discovery is not None:
            await self._discovery.stop()
        if self._bus is not None and await self._bus.stop_serving(self.config.shutdown_grace_s):
            self.state = InstanceState.STOPPED
            await self.publish_load_report()
        await cancel_and_wait(*self._duties)
        for cleanup in reversed(self._cleanups):
            try:
                await cleanup()
            except Exception:
                log.exception(
                    "cleanup failed", cleanup=getattr(cleanup, "__qualname__", str(cleanup))
                )
        if self._http is not None:
            await self._http.cleanup()
        if self._bus is not None:
            await self._bus.close()
        telemetry.shutdown_tracing()
        log.info("stopped")


def run_service(
    service: str,
    config: ServiceConfig,
    setup: Callable[[ServiceRuntime], Awaitable[None]],
    *,
    description: str = "",
) -> int:
    """Run one service process to completion; the exit status for `sys.exit`."""
    runtime = ServiceRuntime(service, config, description=description)
    try:
        asyncio.run(runtime.run(setup))
    except ServiceError as exc:
        log.error("service failed to start", error=exc.message)
        return 1
    return 0


def service_main(
    service: str,
    config_type: type[ServiceConfig],
    setup: Callable[[ServiceRuntime], Awaitable[None]],
    argv: list[str] | None,
    *,
    description: str = "",
) -> int:
    """`python -m services.<svc> [--flag value ...]`: load config (exit 2 on bad config), run."""
    import sys

    from shared.config import ConfigError, load_config

    try:
        config = load_config(
            config_type, sys.argv[1:] if argv is None else argv, prog=f"kvfabric serve {service}"
        )
    except ConfigError as exc:
        print(f"{service}: bad config: {exc}", file=sys.stderr)
        return 2
    return run_service(service, config, setup, description=description)
