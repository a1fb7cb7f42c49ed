"""Discovery through the NATS micro service API, so any NATS tool lists our instances.

Each instance answers `$SRV.PING|INFO|STATS`, `$SRV.<VERB>.<service>` and
`$SRV.<VERB>.<service>.<instance_id>` with the micro JSON documents
(`io.nats.micro.v1.*_response`). Its metadata carries the subject root, so clusters (and
tests) sharing one server tell their instances apart, and the URLs of its HTTP port
(`metrics_url`, `health_url`) when it has one; it is read at each reply, so what a service
adds after start shows. STATS adds the instance's current `LoadReport` under `load`, its
metrics under `metrics` (`shared.metrics.Metrics.snapshot`: the registry /metrics serves)
and, while it holds itself not ready, why under `not_ready`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import msgspec

from shared.bus import Bus, RawMessage
from shared.logging import get_logger
from shared.schema import LoadReport
from shared.subjects import DISCOVERY_VERBS, discovery

log = get_logger(__name__)

PING_TYPE = "io.nats.micro.v1.ping_response"
INFO_TYPE = "io.nats.micro.v1.info_response"
STATS_TYPE = "io.nats.micro.v1.stats_response"


class DiscoveryResponder:
    def __init__(
        self,
        bus: Bus,
        *,
        version: str,
        description: str,
        metadata: dict[str, str],
        load_report: Callable[[], LoadReport],
        metrics: Callable[[], dict[str, float]] = dict,
        not_ready: Callable[[], str | None] = lambda: None,
    ) -> None:
        self._bus = bus
        self._version = version
        self._description = description
        self._metadata = metadata  # the service's own dict: read at each reply
        self._load_report = load_report
        self._metrics = metrics
        self._not_ready = not_ready
        self._started = datetime.now(UTC)
        self._subscriptions: list[Any] = []

    def _identity(self, doc_type: str) -> dict[str, Any]:
        return {
            "type": doc_type,
            "name": self._bus.service,
            "id": self._bus.instance_id,
            "version": self._version,
            "metadata": {"root": self._bus.subjects.root, **self._metadata},
        }

    def ping(self) -> dict[str, Any]:
        return self._identity(PING_TYPE)

    def info(self) -> dict[str, Any]:
        endpoints = [
            {"name": s.name, "subject": s.subject, "queue_group": s.queue_group, "metadata": None}
            for s in self._bus.endpoint_stats()
        ]
        return self._identity(INFO_TYPE) | {
            "description": self._description,
            "endpoints": endpoints,
        }

    def stats(self) -> dict[str, Any]:
        endpoints = [
            {
                "name": s.name,
                "subject": s.subject,
                "queue_group": s.queue_group,
                "num_requests": s.num_requests,
                "num_errors": s.num_errors,
                "last_error": s.last_error,
                "processing_time": s.processing_time_ns,
                "average_processing_time": s.processing_time_ns // max(s.num_requests, 1),
            }
            for s in self._bus.endpoint_stats()
        ]
        doc = self._identity(STATS_TYPE) | {
            "started": self._started.strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z",
            "endpoints": endpoints,
            "load": msgspec.to_builtins(self._load_report()),
            "metrics": self._metrics(),
        }
        not_ready = self._not_ready()
        if not_ready:
            doc["not_ready"] = not_ready
        return doc

    async def start(self) -> None:
        documents = {"PING": self.ping, "INFO": self.info, "STATS": self.stats}
        for verb in DISCOVERY_VERBS:
            make_document = documents[verb]

            async def respond(
                msg: RawMessage, make_document: Callable[[], dict[str, Any]] = make_document
            ) -> None:
                if msg.reply:
                    await self._bus.publish_raw(msg.reply, json.dumps(make_document()).encode())

            for subject in (
                discovery(verb),
                discovery(verb, self._bus.service),
                discovery(verb, self._bus.service, self._bus.instance_id),
            ):
                self._subscriptions.append(await self._bus.subscribe_raw(subject, respond))

    async def stop(self) -> None:
        subscriptions, self._subscriptions = self._subscriptions, []
        for subscription in subscriptions:
            await subscription.unsubscribe()


@dataclass(frozen=True)
class Instance:
    service: str
    instance_id: str
    version: str
    metadata: dict[str, str]
    load: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)  # Metrics.snapshot()
    endpoints: list[dict[str, Any]] = field(default_factory=list)
    not_ready: str | None = None  # why it holds itself not ready (state STARTING)


async def discover(
    bus: Bus, *, service: str | None = None, timeout_s: float = 0.5, stall_s: float | None = None
) -> list[Instance]:
    """Every live instance under this bus's root (from `$SRV.STATS`), sorted by service.
    `stall_s`: end early once the replies pause that long (`Bus.scatter`)."""
    instances = []
    subject = discovery("STATS", service)
    async for msg in bus.scatter(subject, b"", timeout_s=timeout_s, stall_s=stall_s):
        try:
            doc = json.loads(msg.data)
        except ValueError:
            log.warning("non-JSON discovery reply ignored")
            continue
        metadata = doc.get("metadata") or {}
        if metadata.get("root") != bus.subjects.root:
            continue  # another cluster (or test) on the same server, or a foreign micro service
        instances.append(
            Instance(
                service=doc.get("name", ""),
                instance_id=doc.get("id", ""),
                version=doc.get("version", ""),
                metadata=metadata,
                load=doc.get("load") or {},
                metrics=doc.get("metrics") or {},
                endpoints=doc.get("endpoints") or [],
                not_ready=doc.get("not_ready"),
            )
        )
    return sorted(instances, key=lambda i: (i.service, i.instance_id))
