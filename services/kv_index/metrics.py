"""What kv-index measures: the index's own counts and its tiers' size (pure `KvIndex`, read
when scraped; the same figures `kvfabric cache stats` asks for), and the event log position.
"""

from __future__ import annotations

from collections.abc import Callable

from services.kv_index.handlers import KvIndexService
from shared.metrics import CACHE_TIERS, Metrics, tier_label


def observe(metrics: Metrics, service: KvIndexService) -> None:
    def count(name: str) -> Callable[[], float]:
        return lambda: getattr(service.index.counters, name)

    counters = (
        ("kvfabric_kv_index_event_batches_total", "KV event batches applied.", "num_batches"),
        (
            "kvfabric_kv_index_duplicate_batches_total",
            "KV event batches seen before: skipped.",
            "num_duplicate_batches",
        ),
        (
            "kvfabric_kv_index_gaps_total",
            "Gaps in a writer's event sequence (resync asked).",
            "num_gaps",
        ),
        (
            "kvfabric_kv_index_bad_batches_total",
            "Log entries that could not be applied (their writer was asked to resync).",
            "num_bad_batches",
        ),
        (
            "kvfabric_kv_index_blocks_stored_total",
            "Blocks the writers' events added.",
            "num_blocks_stored",
        ),
        (
            "kvfabric_kv_index_blocks_removed_total",
            "Blocks the writers' events removed.",
            "num_blocks_removed",
        ),
        ("kvfabric_kv_index_matches_total", "Prefix matches answered.", "num_matches"),
        (
            "kvfabric_kv_index_matched_blocks_total",
            "Blocks found by the matches.",
            "num_blocks_matched",
        ),
    )
    for name, documentation, field in counters:
        metrics.counter_from(name, documentation, count(field))
    metrics.gauge_from(
        "kvfabric_kv_index_tombstones",
        "Evicted blocks remembered, for the cache-miss diagnosis (bounded: --tombstones).",
        lambda: len(service.index.tombstones),
    )
    metrics.gauge_from(
        "kvfabric_kv_index_tombstone_bytes",
        "Memory the tombstones take (22 bytes an entry, allocated at start).",
        lambda: service.index.tombstones.nbytes,
    )
    metrics.counter_from(
        "kvfabric_kv_index_evicted_blocks_total",
        "Blocks evicted from the index, by why: TTL, or capacity (the high watermark).",
        lambda: {
            "ttl": service.index.counters.num_evicted_ttl,
            "capacity": service.index.counters.num_evicted_capacity,
        },
        labels={"reason": ("ttl", "capacity")},
    )

    def per_tier(field: str) -> Callable[[], dict[str, float]]:
        def read() -> dict[str, float]:
            values: dict[str, float] = {}
            for tier, stats in service.index.stats().items():
                label = tier_label(tier)
                values[label] = values.get(label, 0) + stats[field]
            return values

        return read

    tiers = {"tier": CACHE_TIERS}
    metrics.gauge_from(
        "kvfabric_kv_index_blocks", "Blocks indexed, by tier.", per_tier("num_blocks"), labels=tiers
    )
    metrics.gauge_from(
        "kvfabric_kv_index_used_bytes",
        "KV bytes the indexed blocks take in their tier.",
        per_tier("used_bytes"),
        labels=tiers,
    )
    metrics.gauge_from(
        "kvfabric_kv_index_capacity_bytes",
        "The tier's capacity this shard evicts under.",
        per_tier("capacity_bytes"),
        labels=tiers,
    )
    metrics.gauge_from(
        "kvfabric_kv_index_log_position",
        "The event log's stream sequence the index state covers.",
        lambda: service.last_stream_seq,
    )
