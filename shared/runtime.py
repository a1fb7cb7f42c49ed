"""The lifecycle every service process shares (its main.py only wires its endpoints):

start: config logged once -> logging and tracing -> connect -> `setup` (endpoints, HTTP) ->
discovery and heartbeats -> serve until SIGTERM/SIGINT.
stop: heartbeat says draining -> stop announcing (heartbeats, discovery) -> stop taking work
and finish in-flight requests within `shutdown_grace_s` -> the service's cleanup hooks ->
drain the connection. Every step is safe to repeat.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable
from typing import Any

from shared import telemetry
from shared.bus import Bus, now_ms
from shared.config import ServiceConfig
from shared.discovery import DiscoveryResponder
from shared.logging import configure_logging, get_logger
from shared.schema import InstanceState, LoadReport, ServiceError

VERSION = "0.1.0"
log = get_logger(__name__)


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
        # ...and its own counters, shown by discovery (STATS) and `kvfabric status --json`.
        self.counters: Callable[[], dict[str, Any]] = dict
        self._bus: Bus | None = None
        self._discovery: DiscoveryResponder | None = None
        self._heartbeat: asyncio.Task[None] | None = None
        self._cleanups: list[Callable[[], Awaitable[None]]] = []
        self._duties: list[asyncio.Task[None]] = []
        self._stop = asyncio.Event()
        self._num_heartbeats = 0
        self._is_shut_down = False

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
        configure_logging(
            service=self.service, instance_id=self.instance_id, level=self.config.log_level
        )
        telemetry.setup_tracing(
            self.service, self.instance_id, otlp_endpoint=self.config.otlp_endpoint
        )
        log.info("config", **(self.config.to_log() | {"instance_id": self.instance_id}))
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self.request_stop)
        try:
            self._bus = await Bus.connect(
                self.config.nats_url,
                service=self.service,
                instance_id=self.instance_id,
                root=self.config.root,
                connect_timeout_s=self.config.connect_timeout_s,
            )
            await setup(self)
            self._discovery = DiscoveryResponder(
                self._bus,
                version=VERSION,
                description=self.description,
                metadata=self.metadata,
                load_report=self.load_report,
                counters=lambda: self.counters(),
            )
            await self._discovery.start()
            self.state = InstanceState.SERVING
            self._heartbeat = asyncio.create_task(self._beat())
            await self._bus.flush()
            log.info("serving", nats_url=self.config.nats_url, root=self.config.root)
            await self._stop.wait()
            log.info("stopping")
        finally:
            await self.shutdown()

    async def _beat(self) -> None:
        subject = self.bus.subjects.load(self.service, self.instance_id)
        while True:
            await self.bus.publish(subject, self.load_report())
            await asyncio.sleep(self.config.heartbeat_s)

    async def shutdown(self) -> None:
        if self._is_shut_down:
            return
        self._is_shut_down = True
        self.state = InstanceState.DRAINING
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            await asyncio.gather(self._heartbeat, return_exceptions=True)
        if self._bus is not None and self._bus.is_connected:
            await self._bus.publish(
                self._bus.subjects.load(self.service, self.instance_id), self.load_report()
            )
        if self._discovery is not None:
            await self._discovery.stop()
        if self._bus is not None:
            await self._bus.stop_serving(self.config.shutdown_grace_s)
        for duty in self._duties:
            duty.cancel()
        await asyncio.gather(*self._duties, return_exceptions=True)
        for cleanup in reversed(self._cleanups):
            try:
                await cleanup()
            except Exception:
                log.exception(
                    "cleanup failed", cleanup=getattr(cleanup, "__qualname__", str(cleanup))
                )
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
