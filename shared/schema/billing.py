"""Usage: one record per request, published to JetStream, deduplicated by request id."""

from __future__ import annotations

from enum import StrEnum

from shared.schema.base import Message


class UsageStatus(StrEnum):
    COMPLETED = "completed"
    CANCELLED = "cancelled"
    FAILED = "failed"


class UsageRecord(Message, tag="usage_record"):
    request_id: str
    api_key_id: str
    model: str
    num_cache_hit_tokens: int
    num_cache_miss_tokens: int
    num_output_tokens: int
    status: UsageStatus = UsageStatus.COMPLETED
    finish_reason: str | None = None
    started_ms: int = 0
    finished_ms: int = 0
    prefill_worker_id: str = ""
    decode_worker_id: str = ""
    account: str = ""  # from the request: who is billed
    # Why the prompt missed the cache past the hit (`CacheProbe.cause_for`; "": no probe).
    cache_miss_cause: str = ""
    # What a pinned prefix (a cache_control breakpoint) wrote to the cache: its tokens that
    # were not cached yet, and the pin's time to live (priced as configured; default free).
    num_cache_write_tokens: int = 0
    pin_ttl_s: int = 0


class DeadLetter(Message, tag="dead_letter"):
    """A usage message billing could not ledger, kept with why (never dropped silently)."""

    subject: str  # where it was published (usage.<service>)
    stream_seq: int
    reason: str
    data: bytes  # the message as it came
    dead_ms: int = 0
