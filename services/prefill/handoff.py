"""A finished prefill job's two messages out: `SuffixReady` to the job's decode worker,
which answers once it pulled what was staged, and the window snapshot at the prompt's last
block boundary into swa-memcache, where the next turn's restore looks first."""

from __future__ import annotations

import time

from services.prefill.jobs import JobState
from shared import telemetry
from shared.bus import Bus, now_ms
from shared.logging import get_logger
from shared.schema import (
    DeadlineExceeded,
    JobAccepted,
    PrefillTimings,
    ServiceError,
    SuffixReady,
)
from worker.swa_client import SwaClient

log = get_logger(__name__)

# How long the first SuffixReady waits for decode's answer before it is sent again; each
# resend waits twice as long, up to the last bound.
RESEND_AFTER_S = 1.0
MAX_RESEND_AFTER_S = 8.0


async def tell_decode(
    bus: Bus,
    entry: JobState,
    timings: PrefillTimings,
    *,
    num_blocks: int,
    block_nbytes: int,
    region_offset: int,
    window_nbytes: int,
    timeout_s: float,
) -> float:
    """`SuffixReady` for what is staged at `region_offset`; returns the milliseconds until
    decode answered (its pull included)."""
    request = entry.job.request
    ready = SuffixReady(
        request_id=request.request_id,
        attempt=entry.job.attempt,
        prefill_worker_id=bus.instance_id,
        num_computed_tokens=len(entry.token_ids),  # the whole prompt
        first_block_index=entry.num_cached_blocks,
        num_blocks=num_blocks,
        block_nbytes=block_nbytes,
        region_offset=region_offset,
        window_nbytes=window_nbytes,
        timings=timings,
        first_token_id=entry.first_token_id,
        sampler_state=entry.sampler_state,
    )
    decode_worker_id = entry.job.decision.decode_worker_id
    span = telemetry.current_span()  # prefill transfer
    if span.is_recording():
        span.set_attributes(
            {
                "kvfabric.decode_worker_id": decode_worker_id,
                "kvfabric.num_blocks": num_blocks,
                "kvfabric.bytes": num_blocks * block_nbytes + window_nbytes,
            }
        )
    subject = bus.subjects.instance(bus.subjects.decode_suffix, decode_worker_id)
    started = time.perf_counter()
    deadline = started + timeout_s
    wait_s = RESEND_AFTER_S
    while True:
        try:
            await bus.request(
                subject,
                ready,
                JobAccepted,
                timeout_s=min(wait_s, deadline - time.perf_counter()),
                request_id=request.request_id,
                deadline_ms=request.deadline_ms,
            )
            return (time.perf_counter() - started) * 1000
        except DeadlineExceeded:
            passed = request.deadline_ms is not None and now_ms() >= request.deadline_ms
            if time.perf_counter() >= deadline or passed:
                raise DeadlineExceeded(
                    f"{decode_worker_id} did not take the suffix within {timeout_s:g} s"
                ) from None
        # The message or its answer was lost (a NATS server died with it in flight), or the
        # pull is still running: decode answers a resend once the pull it resends for is done.
        log.info("no answer to SuffixReady yet: sending it again", request_id=request.request_id)
        wait_s = min(2 * wait_s, MAX_RESEND_AFTER_S)


async def put_window(swa: SwaClient, entry: JobState, snapshot: bytes) -> bool:
    """Put the window at the last block boundary before `entry`'s last prompt token (where
    the next turn's cache hit can end); False when it was not kept (logged: it only costs
    the next turn a replay)."""
    blocks = entry.blocks
    boundary_hash = blocks.boundary_hash(blocks.num_prefill_blocks)
    if boundary_hash is None:
        return False
    span = telemetry.current_span()  # prefill store
    if span.is_recording():
        span.set_attribute("kvfabric.swa_snapshot_bytes", len(snapshot))
    try:
        return await swa.put(boundary_hash, snapshot)
    except ServiceError as exc:
        log.warning("sliding-window snapshot not kept", error=str(exc))
        return False
