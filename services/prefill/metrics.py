"""What a prefill worker measures (worker.py counts it).

Its load (queue depth, jobs, KV pages) and its store's reads and writes are the worker
lifecycle's (worker/serving/metrics.py); these are the jobs': how each ended, the tokens
computed or restored, how its sliding window was restored (a memcache snapshot, or a bounded
or exact replay), what it left for the next turn, and how long it took.
"""

from __future__ import annotations

from shared.metrics import Metrics

JOB_OUTCOMES = ("done", "failed", "cancelled", "expired")
RESTORE_MODES = ("snapshot", "bounded", "exact", "none")  # PrefillTimings.swa_restore


class PrefillMetrics:
    def __init__(self, metrics: Metrics) -> None:
        self.jobs_received = metrics.counter(
            "kvfabric_prefill_jobs_received_total", "Prefill jobs taken (valid, not a repeat)."
        )
        ended = metrics.counter(
            "kvfabric_prefill_jobs_ended_total",
            "Prefill jobs ended: done (decode holds the suffix), failed, cancelled, expired "
            "(past the deadline while queued).",
            labels={"outcome": JOB_OUTCOMES},
        )
        self.done, self.failed, self.cancelled, self.expired = (
            ended.labels(o) for o in JOB_OUTCOMES
        )
        tokens = metrics.counter(
            "kvfabric_prefill_tokens_total",
            "Prompt tokens of the jobs: computed here, or cached (restored from the store).",
            labels={"source": ("computed", "cached")},
        )
        self.computed_tokens = tokens.labels("computed")
        self.cached_tokens = tokens.labels("cached")
        self.restores = metrics.counter(
            "kvfabric_prefill_window_restores_total",
            "How each job's sliding window was restored: a memcache snapshot, a bounded or an "
            "exact replay, or none (nothing cached, or no sliding layers).",
            labels={"mode": RESTORE_MODES},
        )
        self.replayed_tokens = metrics.counter(
            "kvfabric_prefill_replayed_tokens_total",
            "Tokens recomputed through the sliding layers to restore windows.",
        )
        self.staged_blocks = metrics.counter(
            "kvfabric_prefill_staged_blocks_total",
            "Blocks kept in the host tier for a session whose turn ended in a tool call "
            "(services/ingress/staging.py), counted once per staging.",
        )
        self.blocks_stored = metrics.counter(
            "kvfabric_prefill_blocks_stored_total", "New complete blocks written to the store."
        )
        self.snapshots_put = metrics.counter(
            "kvfabric_prefill_snapshots_put_total",
            "Window snapshots at the prompt's last block boundary kept by swa-memcache.",
        )
        self.store_failures = metrics.counter(
            "kvfabric_prefill_store_failures_total",
            "Jobs whose blocks or window could not be stored (the request still served).",
        )
        self.handoff_seconds = metrics.histogram(
            "kvfabric_prefill_handoff_seconds",
            "From telling decode the suffix is staged to decode's answer (it pulled it).",
        )
        self.job_seconds = metrics.histogram(
            "kvfabric_prefill_job_duration_seconds",
            "From a job's arrival to PrefillDone (restore, queue, compute, handoff, store).",
        )
