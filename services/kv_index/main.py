"""kv-index: the global prefix index (block hash -> KV location), longest-prefix match,
LRU/TTL/capacity eviction. docs/design.md, 'KV tiers'. Metadata only: KV bytes never pass here.

Serves (per shard, replicas of a shard in one queue group):
  <root>.kv-index.match.shard<N>   MatchRequest -> MatchReply
  <root>.kv-index.admin.shard<N>   CacheCommand (stats | evict | flush) -> CacheStats
  <root>.kv-index.rebuild.shard<N> RebuildBatch (slot headers, `kvfabric cache rebuild`)
Consumes: the JetStream stream of `KvEventBatch`es on <root>.kv.events.* (every replica of
  every shard reads all of it and keeps the hashes its shard owns).
Hears: workers' `HoldingsUpdate`s on <root>.kv.holdings.* (core NATS: what each one's pool
  and host tier hold, services/kv_index/holders.py); asks one for its holdings whole with
  `HoldingsSync` on <root>.kv.holdings_sync.<id> after a gap or a digest that differs.
Publishes: BlocksRemoved to <root>.kv.evict.<writer_id> after eviction (the writer frees the
  slots and logs the removal), ResyncRequest to <root>.kv.resync.<writer_id> on a sequence gap.
Recovery: a snapshot (JetStream object store) every `snapshot_interval_s` and at shutdown,
  then the event log from the snapshot's position; the log is bounded (`log_max_bytes`,
  `log_max_age_s`), so it never grows without bound. While the log still holds everything
  since the index began and is under `replay_whole_log_bytes`, a restart replays it whole
  instead (faster than loading the snapshot), unless the snapshot holds blocks adopted by a
  rebuild, which no log entry has. Start-up serves once the log is
  replayed; past `catch_up_timeout_s` it serves what it has and reports STARTING (discovery,
  heartbeats, /health with --metrics-port) until it has caught up.
A log entry that cannot be applied (malformed, or content the index rejects) is counted
  (`kvfabric_kv_index_bad_batches_total`, metrics.py), logged as an error with its writer and
  seq, and that writer is asked to resync: nothing it held is silently lost.
"""

from __future__ import annotations

import asyncio
import time

from services.kv_index import metrics, native
from services.kv_index.config import KvIndexConfig
from services.kv_index.handlers import KvIndexService
from shared.bus import Endpoint
from shared.logging import get_logger
from shared.runtime import ServiceRuntime, service_main
from shared.schema import KvEventBatch
from shared.schema.kv_index import CacheCommand, MatchRequest, RebuildBatch
from shared.subjects import KV_INDEX
from shared.tasks import cancel_and_wait

log = get_logger(__name__)
CATCH_UP_POLL_S = 0.01


async def setup(runtime: ServiceRuntime) -> None:
    config = runtime.config
    assert isinstance(config, KvIndexConfig)  # service_main built it from KvIndexConfig
    bus, subjects = runtime.bus, runtime.bus.subjects
    try:
        native.module()  # built now, once, rather than inside the first event batch
    except native.NativeUnavailable as exc:  # served by the dict index: said, not silent
        log.warning(
            "C row index unavailable: the dict index serves, ~4x the memory per block",
            reason=str(exc),
        )
    service = KvIndexService(bus, config)
    stream = subjects.kv_events_stream
    await bus.js.ensure_stream(
        stream,
        [subjects.kv_events_all],
        max_age_s=config.log_max_age_s,
        max_bytes=config.log_max_bytes,
    )
    first_seq, last_seq = await bus.js.stream_bounds(stream)
    # A log that still holds everything since the index began replays faster than the
    # snapshot loads (bench faults, 2.3M blocks: 1.2 s against 4.1 s from SIGKILL to
    # answering; the snapshot's object and its table rebuild dominate): take the snapshot
    # only once the log has been cut, has grown past what replays in a few seconds, or the
    # snapshot holds what no log entry does (a `kvfabric cache rebuild`).
    if (
        first_seq > 1
        or await bus.js.stream_bytes(stream) > config.replay_whole_log_bytes
        or await service.snapshot_holds_adopted()
    ):
        await service.load_snapshot()
    if service.last_stream_seq and first_seq > service.last_stream_seq + 1:
        log.warning(
            "event log no longer holds what followed the snapshot: blocks stored in between are "
            "unknown until writers resync or `kvfabric cache rebuild` runs",
            snapshot_seq=service.last_stream_seq,
            first_seq=first_seq,
        )
    start_seq = service.last_stream_seq + 1 if service.last_stream_seq else None
    await bus.js.consume(
        stream,
        subjects.kv_events_all,
        KvEventBatch,
        service.on_event_batch,
        start_seq=start_seq,
        on_error=service.on_bad_message,
    )
    # Answer only once the log is replayed: a restarted index gives the answers it gave
    # before. Past the timeout it answers what it has (a shorter hit is still correct) and
    # says it is not ready until it has caught up.
    deadline = time.monotonic() + config.catch_up_timeout_s
    while service.last_stream_seq < last_seq and time.monotonic() < deadline:
        await asyncio.sleep(CATCH_UP_POLL_S)
    if service.last_stream_seq < last_seq:
        log.error(
            "event log not replayed at start-up: serving, not ready",
            stream_seq=service.last_stream_seq,
            last_seq=last_seq,
            timeout_s=config.catch_up_timeout_s,
        )
        runtime.hold_ready(f"replaying the event log up to {last_seq}")

        async def until_caught_up() -> None:
            while service.last_stream_seq < last_seq:
                await asyncio.sleep(CATCH_UP_POLL_S)
            runtime.mark_ready()
            log.info("event log replayed: ready", stream_seq=service.last_stream_seq)

        catch_up = asyncio.create_task(until_caught_up())

        async def stop_catch_up() -> None:
            await cancel_and_wait(catch_up)

        runtime.on_stop(stop_catch_up)
    else:
        log.info("event log replayed", stream_seq=service.last_stream_seq, last_seq=last_seq)

    shard = config.shard_id
    await bus.serve(
        Endpoint("match", subjects.kv_index_match_shard(shard), MatchRequest, service.handle_match)
    )
    await bus.serve(
        Endpoint("admin", subjects.kv_index_admin(shard), CacheCommand, service.handle_admin)
    )
    await bus.serve(
        Endpoint("rebuild", subjects.kv_index_rebuild(shard), RebuildBatch, service.handle_rebuild)
    )
    await bus.subscribe_raw(subjects.kv_holdings_all, service.on_holdings)
    runtime.every(1.0, service.expire_holders)
    runtime.metadata["shard"] = f"{shard}/{config.num_shards}"
    runtime.every(config.evict_interval_s, service.evict_once)
    runtime.every(config.snapshot_interval_s, service.save_snapshot)
    runtime.on_stop(service.save_snapshot)
    metrics.observe(runtime.metrics, service)


def main(argv: list[str] | None = None) -> int:
    return service_main(KV_INDEX, KvIndexConfig, setup, argv, description=__doc__ or "")
