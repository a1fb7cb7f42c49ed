"""What the router measures (shown by /metrics, discovery's STATS and `kvfabric status --json`).

Per request, where it happens (handler.py, prefill_jobs.py): the decision (routed or
rejected, and a rejection's code), the prompt and its cache hit by tier, whether kv-index
answered, prefill retries and failures. Read when scraped: the snapshot map's counts (pure
`SwaMap`) and the prefill jobs awaited.
"""

from __future__ import annotations

from collections.abc import Callable

from services.router.swa_map import SwaMap
from shared.metrics import CACHE_TIERS, Metrics
from shared.schema import ErrorCode


class RouterMetrics:
    def __init__(self, metrics: Metrics) -> None:
        decisions = metrics.counter(
            "kvfabric_router_decisions_total",
            "Generate requests answered: routed (a decode worker took the job) or rejected.",
            labels={"outcome": ("routed", "rejected")},
        )
        self.routed = decisions.labels("routed")
        self.rejected = decisions.labels("rejected")
        self.rejections = metrics.counter(
            "kvfabric_router_rejections_total",
            "Generate requests rejected, by error code.",
            labels={"code": ErrorCode},
        )
        self.prompt_tokens = metrics.counter(
            "kvfabric_router_prompt_tokens_total", "Prompt tokens of the routed requests."
        )
        self.hit_tokens = metrics.counter(
            "kvfabric_router_cache_hit_tokens_total",
            "Prompt tokens of the routed requests that kv-index found cached, by tier.",
            labels={"tier": CACHE_TIERS},
        )
        self.cold_index = metrics.counter(
            "kvfabric_router_cold_index_total",
            "Requests routed without a kv-index answer (computed whole).",
        )
        self.prefill_retries = metrics.counter(
            "kvfabric_router_prefill_retries_total",
            "Prefill jobs sent again to another worker (the first one died).",
        )
        self.prefill_failures = metrics.counter(
            "kvfabric_router_prefill_failures_total",
            "Routed requests whose prefill failed for good (CancelRequest sent).",
        )
        self._metrics = metrics

    def observe(self, swa_map: SwaMap, num_prefill_jobs: Callable[[], int]) -> None:
        """The snapshot map's counts and the prefill jobs awaited, read when scraped."""
        m, c = self._metrics, swa_map.counters
        m.counter_from(
            "kvfabric_router_swa_batches_total",
            "SwaHeld batches received from the memcaches.",
            lambda: c.num_batches,
        )
        m.counter_from(
            "kvfabric_router_swa_full_batches_total",
            "SwaHeld batches carrying a memcache's full state.",
            lambda: c.num_full_batches,
        )
        m.counter_from(
            "kvfabric_router_swa_stale_batches_total",
            "SwaHeld batches ignored: repeated or older.",
            lambda: c.num_stale_batches,
        )
        m.counter_from(
            "kvfabric_router_swa_gaps_total",
            "Gaps seen in a memcache's event sequence.",
            lambda: c.num_gaps,
        )
        m.counter_from(
            "kvfabric_router_swa_unknown_batches_total",
            "Batches from a memcache not known yet.",
            lambda: c.num_unknown,
        )
        m.counter_from(
            "kvfabric_router_swa_resyncs_asked_total",
            "SwaResync requests sent to one memcache.",
            lambda: c.num_resyncs_asked,
        )
        m.gauge_from(
            "kvfabric_router_swa_memcaches",
            "Memcaches whose snapshots the map holds.",
            lambda: len(swa_map),
        )
        m.gauge_from(
            "kvfabric_router_prefill_jobs",
            "Prefill jobs being seen through (routed, prefill not done).",
            num_prefill_jobs,
        )
