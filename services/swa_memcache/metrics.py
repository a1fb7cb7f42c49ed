"""What swa-memcache measures. The snapshot cache (pure `SnapshotCache`) keeps its own counts,
read when scraped with its size and the events' (`observe`); the NIXL leg's counts are the
handlers' (handlers.py), updated where they happen.
"""

from __future__ import annotations

from services.swa_memcache.cache import SnapshotCache
from services.swa_memcache.events import SwaEventPublisher
from shared.metrics import Metrics


class SwaMemcacheMetrics:
    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        pulls = metrics.counter(
            "kvfabric_swa_memcache_pulls_total",
            "Large puts pulled over NIXL from the caller: stored, failed (timeout, dead caller, "
            "UCX error) or mismatched (checksum); only stored ones are kept.",
            labels={"outcome": ("stored", "failed", "mismatched")},
        )
        self.pulled = pulls.labels("stored")
        self.pull_failed = pulls.labels("failed")
        self.pull_mismatched = pulls.labels("mismatched")
        self.pulled_bytes = metrics.counter(
            "kvfabric_swa_memcache_pulled_bytes_total", "Snapshot bytes pulled over NIXL."
        )
        self.pull_seconds = metrics.histogram(
            "kvfabric_swa_memcache_pull_seconds", "One snapshot pulled over NIXL from a caller."
        )
        self.leased_gets = metrics.counter(
            "kvfabric_swa_memcache_leased_gets_total",
            "Large gets answered with a lease on the snapshot's range (the reader pulls it).",
        )
        self.released = metrics.counter(
            "kvfabric_swa_memcache_leases_released_total",
            "Leases ended by their reader before they ran out.",
        )
        self.too_large_inline = metrics.counter(
            "kvfabric_swa_memcache_too_large_inline_total",
            "Gets refused: a reader without NIXL asked for more than a NATS message carries.",
        )

    def observe(self, cache: SnapshotCache, events: SwaEventPublisher) -> None:
        """The cache's counts and size, and the events published, read when scraped."""
        m, c = self.metrics, cache.counters
        counters = (
            (
                "kvfabric_swa_memcache_hits_total",
                "Gets that found a live snapshot.",
                lambda: c.num_hits,
            ),
            (
                "kvfabric_swa_memcache_misses_total",
                "Gets that found none (expired ones included).",
                lambda: c.num_misses,
            ),
            (
                "kvfabric_swa_memcache_expired_total",
                "Snapshots dropped by their TTL, at a get or a sweep.",
                lambda: c.num_expired,
            ),
            (
                "kvfabric_swa_memcache_evicted_total",
                "Snapshots evicted, least recently used first, to make room.",
                lambda: c.num_evicted,
            ),
            ("kvfabric_swa_memcache_puts_total", "Snapshots stored.", lambda: c.num_puts),
            (
                "kvfabric_swa_memcache_rejected_total",
                "Puts larger than the whole capacity.",
                lambda: c.num_rejected,
            ),
            (
                "kvfabric_swa_memcache_no_room_total",
                "Puts with no room left even after evicting every unpinned entry.",
                lambda: c.num_no_room,
            ),
            (
                "kvfabric_swa_memcache_leases_total",
                "Leases taken on snapshots being read.",
                lambda: c.num_leases,
            ),
            (
                "kvfabric_swa_memcache_event_batches_total",
                "SwaHeld batches published.",
                lambda: events.num_batches,
            ),
            (
                "kvfabric_swa_memcache_resyncs_total",
                "Full states published on a router's request.",
                lambda: events.num_resyncs,
            ),
        )
        for name, documentation, read in counters:
            m.counter_from(name, documentation, read)
        m.gauge_from("kvfabric_swa_memcache_entries", "Snapshots held.", lambda: len(cache))
        m.gauge_from(
            "kvfabric_swa_memcache_pinned_entries",
            "Snapshots pinned by a reader's lease.",
            lambda: cache.num_pinned,
        )
        m.gauge_from(
            "kvfabric_swa_memcache_used_bytes",
            "Bytes the snapshots take.",
            lambda: cache.used_bytes,
        )
        m.gauge_from(
            "kvfabric_swa_memcache_capacity_bytes",
            "Bytes the cache may hold.",
            lambda: cache.capacity_bytes,
        )
