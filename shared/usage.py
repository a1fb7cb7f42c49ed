"""Usage records on their way to billing: the JetStream log they go to, and the durable
local outbox every producer keeps them in until that log has them (docs/design.md, 'Usage
and billing': no usage record is dropped).

Producers: each decode worker (one record per request it accepted), and the caller of a
generation (`shared.client`) for a stream whose decode worker died. Each publishes with
"<service>:<request id>" as message id, so a producer's replay is dropped (within the
stream's duplicate window; billing dedupes by request id past it), while both producers'
records of one request are kept: the caller's estimate may be stored first, and billing
must still see decode's own count to prefer it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Protocol

from shared import telemetry
from shared.bus import Bus, NoStream, now_ms
from shared.logging import get_logger
from shared.schema import GenerateRequest, UsageRecord, UsageStatus
from shared.usage_outbox import OutboxLocked, UsageOutbox

log = get_logger(__name__)

USAGE_LOG_MAX_AGE_S = 7 * 24 * 3600.0


def cache_write_tokens(
    request: GenerateRequest, num_prompt_tokens: int, num_cached_tokens: int
) -> int:
    """What the request's pins (cache_control) wrote to the cache: the tokens of its longest
    pinned prefix, in whole blocks prefill stores, that were not cached already (Anthropic's
    `cache_creation_input_tokens`). 0 without a pin."""
    if not request.pins:
        return 0
    block = request.block_size_tokens
    storable = (num_prompt_tokens - 1) // block * block  # never the block of the last token
    pinned = min(max(p.num_tokens for p in request.pins) // block * block, storable)
    return max(pinned - num_cached_tokens, 0)


def usage_record(
    request: GenerateRequest,
    *,
    num_prompt_tokens: int,
    num_cached_tokens: int,
    num_output_tokens: int,
    status: UsageStatus,
    finish_reason: str | None,
    prefill_worker_id: str,
    decode_worker_id: str,
    started_ms: int | None = None,
    window_replayed: bool = False,
) -> UsageRecord:
    """The one record of a request, whoever writes it: its prompt split into the tokens a
    cache hit served and the tokens computed, and why the rest missed, finished now."""
    probe = request.cache_probe
    return UsageRecord(
        request_id=request.request_id,
        api_key_id=request.api_key_id,
        account=request.account,
        model=request.model,
        num_cache_hit_tokens=num_cached_tokens,
        num_cache_miss_tokens=num_prompt_tokens - num_cached_tokens,
        num_output_tokens=num_output_tokens,
        status=status,
        finish_reason=finish_reason,
        started_ms=request.arrival_ms if started_ms is None else started_ms,
        finished_ms=now_ms(),
        prefill_worker_id=prefill_worker_id,
        decode_worker_id=decode_worker_id,
        cache_miss_cause=(
            probe.cause_for(num_cached_tokens, window_replayed) if probe is not None else ""
        ),
        num_cache_write_tokens=cache_write_tokens(request, num_prompt_tokens, num_cached_tokens),
        pin_ttl_s=max((p.ttl_s for p in request.pins), default=0),
    )


class _Count(Protocol):
    def inc(self, amount: float = 1) -> None: ...


async def keep_record(
    outbox: UsageOutbox, record: UsageRecord, *, kept: _Count, lost: _Count
) -> bool:
    """A worker's record of a request it served, into its durable outbox (which publishes it
    until JetStream has it), counted kept or lost; the current span's context goes with it,
    so billing's span continues the request's trace. False only when the disk failed: the
    one way left to lose a record, said loudly."""
    telemetry.keep_context(record.request_id)
    try:
        await outbox.add(record)
    except Exception as exc:  # the disk itself failed: counted, logged with its traceback
        lost.inc()
        log.exception(
            "usage record not kept",
            request_id=record.request_id,
            record=str(record),
            error=repr(exc),
        )
        return False
    kept.inc()
    return True


async def ensure_usage_stream(bus: Bus) -> None:
    """Create the usage log, or bring it to this config (decode workers at start)."""
    subjects = bus.subjects
    await bus.js.ensure_stream(
        subjects.usage_stream, [subjects.usage_all], max_age_s=USAGE_LOG_MAX_AGE_S
    )


def usage_publisher(bus: Bus, service: str) -> Callable[[UsageRecord], Awaitable[None]]:
    """An acknowledged publish of one record on `service`'s usage subject, creating the log
    (with the decode workers' config, `ensure_usage_stream`) if a caller comes first."""
    subject = bus.subjects.usage(service)

    async def publish(record: UsageRecord) -> None:
        msg_id = f"{service}:{record.request_id}"
        # The request's trace context, kept when the record was made: billing's span joins it.
        headers = telemetry.take_context(record.request_id)
        try:
            await bus.js.publish(subject, record, msg_id=msg_id, headers=headers)
        except NoStream:
            await ensure_usage_stream(bus)
            await bus.js.publish(subject, record, msg_id=msg_id, headers=headers)

    return publish


async def open_usage_outbox(bus: Bus, service: str, directory: Path, name: str) -> UsageOutbox:
    """`<directory>/<name>.usage`, opened: what an earlier process left pending is replayed."""
    outbox = UsageOutbox(directory / f"{name}.usage", usage_publisher(bus, service))
    await outbox.open()
    return outbox


async def adopt_orphans(bus: Bus, service: str, directory: Path, *, timeout_s: float = 30.0) -> int:
    """Send what dead producers left in `directory`'s other outboxes, then remove them.

    An instance that comes back under another id (compose and clusters name instances at
    random) never reopens its old file; whoever shares the directory adopts it. An outbox
    still locked belongs to a live process and is left alone, one whose records cannot be
    sent within `timeout_s` stays for a later adopter. Returns how many records were sent."""
    num_sent = 0
    for path in sorted(directory.glob("*.usage")):
        outbox = UsageOutbox(path, usage_publisher(bus, service))
        try:
            num_pending = await outbox.open()
        except OutboxLocked:
            continue  # alive, or adopted by someone else right now
        if await outbox.flush(timeout_s):
            await outbox.close_and_remove()
            num_sent += num_pending
        else:
            await outbox.close(timeout_s=0.1)
    if num_sent:
        log.info("orphaned usage records sent", num_records=num_sent, directory=str(directory))
    return num_sent
