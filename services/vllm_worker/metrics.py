"""What a vllm-worker measures of its requests (worker.py counts it): latency as the worker
sees it, how each request ended, its tokens and cache hit, its usage records. Its load (queue
depth, sequences, KV pages) is the worker lifecycle's (worker/serving/metrics.py)."""

from __future__ import annotations

from shared.metrics import CACHE_TIERS, Metrics

OUTCOMES = ("stop", "length", "cancelled", "error")


class VllmWorkerMetrics:
    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.ttft_seconds = metrics.histogram(
            "kvfabric_vllm_worker_time_to_first_token_seconds",
            "From the job's acceptance to its first token from vLLM (prefill included).",
        )
        self.request_seconds = metrics.histogram(
            "kvfabric_vllm_worker_request_duration_seconds",
            "From the job's acceptance to its final chunk (or its error).",
        )
        ended = metrics.counter(
            "kvfabric_vllm_worker_requests_total",
            "Requests ended, by how: the stream's finish reason, or error.",
            labels={"outcome": OUTCOMES},
        )
        self.ended = {outcome: ended.labels(outcome) for outcome in OUTCOMES}
        self.prompt_tokens = metrics.counter(
            "kvfabric_vllm_worker_prompt_tokens_total", "Prompt tokens of the requests ended."
        )
        self.hit_tokens = metrics.counter(
            "kvfabric_vllm_worker_cache_hit_tokens_total",
            "Prompt tokens vLLM did not compute (its prefix cache or the store), by the tier "
            "the router found them in.",
            labels={"tier": CACHE_TIERS},
        )
        self.output_tokens = metrics.counter(
            "kvfabric_vllm_worker_output_tokens_total", "Tokens generated."
        )
        usage = metrics.counter(
            "kvfabric_vllm_worker_usage_records_total",
            "Usage records: kept (in the durable outbox) or lost (the disk failed).",
            labels={"outcome": ("kept", "lost")},
        )
        self.usage_kept, self.usage_lost = usage.labels("kept"), usage.labels("lost")
