"""Device-hours from the workers' heartbeats: the denominator of revenue per GPU-hour.

Every prefill and decode worker says in its `LoadReport` (about once a second) how many
devices it holds. For each worker and each UTC hour, billing keeps the first and the last
heartbeat it saw in that hour; the device time of that hour is (last - first) x devices.
Billing replicas take the heartbeats in a queue group, so each replica sees some of them:
the ledger merges their spans with min / max, which makes the merge order-free and a repeat
harmless. A worker that stops for a while and comes back within the hour is counted through
its silence (an overcount of at most the gap).
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.schema import LoadReport

HOUR_MS = 3_600_000


@dataclass(frozen=True)
class DeviceSpan:
    hour_ms: int  # the UTC hour's start
    instance_id: str
    service: str
    model: str
    num_devices: int
    first_ms: int
    last_ms: int

    @property
    def device_ms(self) -> int:
        return (self.last_ms - self.first_ms) * self.num_devices

    def merged(self, other: DeviceSpan) -> DeviceSpan:
        return DeviceSpan(
            self.hour_ms,
            self.instance_id,
            self.service,
            self.model,
            self.num_devices,
            min(self.first_ms, other.first_ms),
            max(self.last_ms, other.last_ms),
        )


class DeviceSpans:
    """Spans seen since the last `drain`, merged per (hour, worker)."""

    def __init__(self) -> None:
        self._spans: dict[tuple[int, str], DeviceSpan] = {}

    def observe(self, report: LoadReport) -> None:
        if report.num_devices <= 0:
            return
        hour = report.ts_ms - report.ts_ms % HOUR_MS
        span = DeviceSpan(
            hour,
            report.instance_id,
            report.service,
            report.model,
            report.num_devices,
            report.ts_ms,
            report.ts_ms,
        )
        self._add(span)

    def drain(self) -> list[DeviceSpan]:
        spans, self._spans = list(self._spans.values()), {}
        return spans

    def put_back(self, spans: list[DeviceSpan]) -> None:
        """Spans a failed write returns, merged with what came since."""
        for span in spans:
            self._add(span)

    def _add(self, span: DeviceSpan) -> None:
        key = (span.hour_ms, span.instance_id)
        seen = self._spans.get(key)
        self._spans[key] = span if seen is None else seen.merged(span)
