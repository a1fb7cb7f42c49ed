"""What a decode worker measures (worker.py and finish.py count it).

Its load (queue depth, sequences, KV pages), store and usage outbox are the worker
lifecycle's (worker/serving/metrics.py); these are the requests': latency as the worker
sees it (time to first token from the job's acceptance, the gap between a sequence's steps
per token, the whole request), how each ended, its tokens and cache hit by tier, what it
left for the next turn, the suffix pulled from prefill. The model's engine adds its own
(speculative drafts, preemptions, scheduler queues), read when scraped (`observe_engine`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shared.metrics import CACHE_TIERS, Metrics

if TYPE_CHECKING:  # the engine imports torch: not at import time
    from worker.engine.engine import Engine

OUTCOMES = ("stop", "length", "cancelled", "error")  # TokenChunk.finish_reason, or an error


class DecodeMetrics:
    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.ttft_seconds = metrics.histogram(
            "kvfabric_decode_time_to_first_token_seconds",
            "From the job's acceptance to its first token streamed (prefill, pull, first step).",
        )
        self.itl_seconds = metrics.histogram(
            "kvfabric_decode_inter_token_latency_seconds",
            "Per step of a sequence after its first: the time since its previous tokens, "
            "divided by the tokens the step emitted (several with speculative drafts).",
        )
        self.request_seconds = metrics.histogram(
            "kvfabric_decode_request_duration_seconds",
            "From the job's acceptance to its final chunk (or its error).",
        )
        ended = metrics.counter(
            "kvfabric_decode_requests_total",
            "Requests ended, by how: the stream's finish reason, or error.",
            labels={"outcome": OUTCOMES},
        )
        self.ended = {outcome: ended.labels(outcome) for outcome in OUTCOMES}
        self.prompt_tokens = metrics.counter(
            "kvfabric_decode_prompt_tokens_total", "Prompt tokens of the requests ended."
        )
        self.hit_tokens = metrics.counter(
            "kvfabric_decode_cache_hit_tokens_total",
            "Prompt tokens whose KV came from the cache, not prefill (billed as hits), by tier.",
            labels={"tier": CACHE_TIERS},
        )
        self.output_tokens = metrics.counter(
            "kvfabric_decode_output_tokens_total", "Tokens generated."
        )
        self.blocks_stored = metrics.counter(
            "kvfabric_decode_blocks_stored_total",
            "Complete blocks of finished sequences (answers included) written to the store.",
        )
        self.snapshots_put = metrics.counter(
            "kvfabric_decode_snapshots_put_total",
            "Window snapshots at a finished sequence's last block boundary kept by swa-memcache.",
        )
        usage = metrics.counter(
            "kvfabric_decode_usage_records_total",
            "Usage records: kept (in the durable outbox) or lost (the disk failed).",
            labels={"outcome": ("kept", "lost")},
        )
        self.usage_kept, self.usage_lost = usage.labels("kept"), usage.labels("lost")
        self.transfer_bytes = metrics.counter(
            "kvfabric_decode_transfer_bytes_total", "Suffix KV and window bytes pulled over NIXL."
        )
        self.transfer_seconds = metrics.histogram(
            "kvfabric_decode_transfer_seconds", "One suffix pull from a prefill worker."
        )

    def observe_engine(self, engine: Engine) -> None:
        """The model engine's own counts, read when scraped."""
        m = self.metrics
        m.counter_from(
            "kvfabric_decode_spec_draft_tokens_total",
            "Speculative draft tokens proposed.",
            lambda: engine.spec_stats.num_draft_tokens,
        )
        m.counter_from(
            "kvfabric_decode_spec_accepted_tokens_total",
            "Speculative draft tokens accepted.",
            lambda: engine.spec_stats.num_accepted_tokens,
        )
        m.counter_from(
            "kvfabric_decode_sequence_steps_total",
            "Sequence-steps that emitted tokens (tokens per step: emitted / steps).",
            lambda: engine.spec_stats.num_forwards,
        )
        m.counter_from(
            "kvfabric_decode_emitted_tokens_total",
            "Tokens the engine's steps emitted.",
            lambda: engine.spec_stats.num_emitted_tokens,
        )
        m.counter_from(
            "kvfabric_decode_preemptions_total",
            "Sequences preempted (pages freed, recomputed later).",
            lambda: engine.num_preemptions,
        )
        scheduler = engine.scheduler
        m.gauge_from(
            "kvfabric_decode_engine_sequences",
            "The engine scheduler's sequences: running, or waiting (new or preempted).",
            lambda: {"running": len(scheduler.running), "waiting": len(scheduler.waiting)},
            labels={"state": ("running", "waiting")},
        )
