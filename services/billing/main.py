"""billing: consumes usage records, prices them and keeps the ledger. docs/design.md,
'Usage and billing'.

Wiring only: the ledger (SQLite embedded, PostgreSQL in production: `--ledger-url`), the
price book (`--pricing-file`, else the reference deployment's off-peak prices), and the
usage consumer (consumer.py: a durable JetStream pull consumer every billing replica shares,
batches priced and committed before they are acknowledged, malformed records dead-lettered).
It also turns the workers' heartbeats into device-hours (uptime.py), the denominator of
revenue per GPU-hour. Its metrics (records ledgered by source, duplicates, dead letters,
revenue by kind: metrics.py) are on /metrics and in discovery's STATS.
"""

from __future__ import annotations

import asyncio
import sys

from services.billing import metrics
from services.billing.config import BillingConfig
from services.billing.consumer import GIL_SWITCH_INTERVAL_S, UsageConsumer
from services.billing.ledger import open_ledger
from services.billing.pricing import PriceBook
from services.billing.uptime import DeviceSpans
from shared.runtime import ServiceRuntime, service_main
from shared.schema import LoadReport
from shared.subjects import BILLING, queue_group
from shared.usage import ensure_usage_stream

DEVICE_FLUSH_S = 5.0


async def setup(runtime: ServiceRuntime) -> None:
    config = runtime.config
    assert isinstance(config, BillingConfig)  # service_main built it from BillingConfig
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    ledger = await asyncio.to_thread(open_ledger, config.ledger_url)  # migrates
    prices = (
        PriceBook.from_file(config.pricing_file) if config.pricing_file else PriceBook.default()
    )
    await ensure_usage_stream(runtime.bus)
    consumer = UsageConsumer(
        runtime.bus,
        ledger,
        prices,
        batch_size=config.batch_size,
        fetch_timeout_s=config.fetch_timeout_s,
        ack_wait_s=config.ack_wait_s,
    )
    await consumer.start()
    task = asyncio.create_task(consumer.run())

    # Device time for revenue per GPU-hour: the workers' heartbeats, shared among replicas.
    spans = DeviceSpans()

    async def on_heartbeat(report: LoadReport) -> None:
        spans.observe(report)

    await runtime.bus.subscribe(
        runtime.bus.subjects.load_all, LoadReport, on_heartbeat, queue=queue_group(BILLING)
    )

    async def flush_spans() -> None:
        drained = spans.drain()
        try:
            await asyncio.to_thread(ledger.record_device_spans, drained)
        except Exception:  # kept for the next flush
            spans.put_back(drained)
            raise

    runtime.every(DEVICE_FLUSH_S, flush_spans)
    metrics.observe(runtime.metrics, consumer.counts)
    runtime.metadata["ledger"] = config.ledger_url.split("://", 1)[0]

    async def stop() -> None:  # the batch in hand is committed and acked first
        await consumer.stop()
        await task
        await flush_spans()
        await asyncio.to_thread(ledger.close)

    runtime.on_stop(stop)


def main(argv: list[str] | None = None) -> int:
    return service_main(BILLING, BillingConfig, setup, argv, description=__doc__ or "")
