"""What every prefill and decode worker measures, whatever its engine, read when scraped:
its load (the figures its heartbeats carry), its store's reads and writes, its usage outbox.
Ingress keeps an outbox too (usage for streams whose decode worker died) and exports it the
same way. Each value comes from the object that already counts it: nothing per request.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from shared.metrics import Metrics
from shared.usage_outbox import UsageOutbox
from worker.engine.host_tier import HostTier
from worker.kvstore.slots import MissReason
from worker.kvstore.store import KvStore, SkipReason


def observe_load(metrics: Metrics, load_fields: Callable[[], dict[str, Any]]) -> None:
    """The worker's heartbeat figures as gauges (decode reports no queued tokens: 0)."""

    def field(name: str) -> Callable[[], float]:
        return lambda: load_fields().get(name, 0)

    def used() -> float:
        load = load_fields()
        return load.get("num_kv_pages_total", 0) - load.get("num_kv_pages_free", 0)

    metrics.gauge_from(
        "kvfabric_worker_queue_depth",
        "Prefill: jobs with tokens still to compute. Decode: requests waiting for their suffix.",
        field("num_queued"),
    )
    metrics.gauge_from(
        "kvfabric_worker_queued_tokens",
        "Prefill: prompt tokens still to compute.",
        field("num_queued_tokens"),
    )
    metrics.gauge_from(
        "kvfabric_worker_running_requests",
        "Prefill: jobs held (computing or handing off). Decode: sequences in the batch.",
        field("num_running"),
    )
    metrics.gauge_from("kvfabric_worker_kv_pages_used", "KV pool pages in use.", used)
    metrics.gauge_from(
        "kvfabric_worker_kv_pages_capacity", "KV pool pages in all.", field("num_kv_pages_total")
    )
    metrics.gauge_from(
        "kvfabric_worker_devices",
        "Accelerators this worker occupies (what revenue per GPU-hour divides by).",
        field("num_devices"),
    )


def observe_store(metrics: Metrics, store: KvStore) -> None:
    """The SSD tier as this worker reads and writes it (`KvStore.stats()`)."""

    def stat(name: str) -> Callable[[], float]:
        return lambda: store.stats()[name]

    def by_reason(prefix: str, reasons: type[MissReason] | type[SkipReason]) -> Callable:
        return lambda: {str(r): store.stats()[f"{prefix}.{r}"] for r in reasons}

    m = metrics
    m.counter_from(
        "kvfabric_store_read_bytes_total",
        "Payload bytes read from the store.",
        stat("num_bytes_read"),
    )
    m.counter_from(
        "kvfabric_store_read_seconds_total",
        "Time spent in store reads.",
        lambda: store.stats()["read_time_ns"] / 1e9,
    )
    m.counter_from(
        "kvfabric_store_read_blocks_total", "Blocks read back whole and valid.", stat("num_hits")
    )
    m.counter_from(
        "kvfabric_store_read_misses_total",
        "Blocks asked for that could not be used, by reason (a torn, corrupt, "
        "truncated or reused slot is a miss).",
        by_reason("num_misses", MissReason),
        labels={"reason": MissReason},
    )
    m.counter_from(
        "kvfabric_store_write_bytes_total",
        "Payload bytes written to the store.",
        stat("num_bytes_written"),
    )
    m.counter_from(
        "kvfabric_store_write_seconds_total",
        "Time spent in store writes.",
        lambda: store.stats()["write_time_ns"] / 1e9,
    )
    m.counter_from(
        "kvfabric_store_write_blocks_total",
        "Blocks written to the store.",
        stat("num_blocks_written"),
    )
    m.counter_from(
        "kvfabric_store_write_skips_total",
        "Blocks not written, by reason.",
        by_reason("num_skipped", SkipReason),
        labels={"reason": SkipReason},
    )
    m.counter_from(
        "kvfabric_store_slots_freed_total",
        "Slots of evicted blocks made free for reuse.",
        stat("num_slots_freed"),
    )
    m.gauge_from(
        "kvfabric_store_slots_used", "This writer's slots holding a block.", stat("num_slots_used")
    )
    m.gauge_from(
        "kvfabric_store_slots_capacity",
        "This writer's share of the store, in slots.",
        stat("num_slots_capacity"),
    )


def observe_outbox(metrics: Metrics, outbox: UsageOutbox) -> None:
    """The durable usage outbox: records kept on disk until JetStream has them."""

    def count(name: str) -> Callable[[], float]:
        return lambda: outbox.counters()[name]

    m = metrics
    m.counter_from(
        "kvfabric_usage_outbox_added_total",
        "Usage records written to the outbox.",
        count("num_added"),
    )
    m.counter_from(
        "kvfabric_usage_outbox_bypassed_total",
        "Records the disk could not take, published directly and acknowledged instead.",
        count("num_bypassed"),
    )
    m.counter_from(
        "kvfabric_usage_outbox_published_total",
        "Usage records JetStream acknowledged.",
        count("num_published"),
    )
    m.counter_from(
        "kvfabric_usage_outbox_publish_failures_total",
        "Publishes that failed (retried).",
        count("num_publish_failures"),
    )
    m.counter_from(
        "kvfabric_usage_outbox_replayed_total",
        "Records found pending on disk at open (a previous run's).",
        count("num_replayed"),
    )
    m.counter_from(
        "kvfabric_usage_outbox_compactions_total",
        "Outbox file compactions.",
        count("num_compactions"),
    )
    m.gauge_from(
        "kvfabric_usage_outbox_pending",
        "Records not yet acknowledged by JetStream.",
        lambda: outbox.num_pending,
    )


def observe_host_tier(metrics: Metrics, host: HostTier) -> None:
    """The host-memory tier behind the KV pool (worker/engine/host_tier.py)."""
    metrics.gauge_from(
        "kvfabric_worker_host_tier_bytes",
        "KV bytes kept in the host-memory tier.",
        lambda: host.nbytes,
    )
    metrics.counter_from(
        "kvfabric_worker_host_tier_blocks_total",
        "Blocks into the host-memory tier (saved: pages the pool handed out again), out of it "
        "(evicted: least recently used past its capacity) and back into the pool (restored).",
        lambda: {
            "saved": host.num_saved,
            "evicted": host.num_evicted,
            "restored": host.num_restored,
        },
        labels={"outcome": ("saved", "evicted", "restored")},
    )
