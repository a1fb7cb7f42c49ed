"""kv-index handlers: decode -> the core index -> encode. The service's state and its
background duties (event log consumption, eviction, snapshots) live in `KvIndexService`."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import msgspec

from services.kv_index.config import KvIndexConfig
from services.kv_index.holders import HolderIndex
from services.kv_index.index import KvIndex, Removal
from shared import telemetry
from shared.bus import Bus, Context, RawMessage
from shared.kv_index_client import to_wire
from shared.logging import get_logger
from shared.schema import (
    BadRequest,
    BlocksRemoved,
    KvEventBatch,
    ServiceError,
    decode,
    pack_block_hashes,
    unpack_block_hashes,
)
from shared.schema.kv_index import (
    CacheCommand,
    CacheStats,
    HoldingsSync,
    HoldingsUpdate,
    MatchReply,
    MatchRequest,
    RebuildBatch,
    RebuildReply,
    ResyncRequest,
)

log = get_logger(__name__)
SNAPSHOT_VERSION = 1
ADOPTED = "holds blocks adopted from slot headers"  # a snapshot's description


class KvIndexService:
    def __init__(self, bus: Bus, config: KvIndexConfig) -> None:
        self.bus = bus
        self.config = config
        self.index = KvIndex(
            capacity_bytes=config.capacity_bytes(),
            shard_id=config.shard_id,
            num_shards=config.num_shards,
            ttl_s=config.ttl_s,
            high_watermark=config.high_watermark,
            low_watermark=config.low_watermark,
            tombstone_capacity=config.tombstones,
        )
        self.last_stream_seq = 0  # the event log position the state covers
        # Each worker's own memory (pool, host tier), from its HoldingsUpdates; not
        # snapshotted: workers are synced again after a restart.
        self.holders = HolderIndex(
            shard_id=config.shard_id, num_shards=config.num_shards, ttl_s=config.holder_ttl_s
        )
        self._syncing: set[str] = set()
        self._sync_tasks: set[asyncio.Task[None]] = set()
        # Blocks adopted from slot headers are in no log: once any are, every snapshot says
        # so and a restart must load it rather than replay the log alone.
        self.holds_adopted = False

    @property
    def snapshot_bucket(self) -> str:
        return f"{self.bus.subjects.kv_events_stream}_SNAPSHOTS"

    @property
    def snapshot_name(self) -> str:
        return f"shard{self.config.shard_id}-of-{self.config.num_shards}"

    # -- requests ------------------------------------------------------------------------
    async def handle_match(self, request: MatchRequest, ctx: Context) -> MatchReply:
        try:
            hashes = unpack_block_hashes(request.block_hashes)  # uint64, used without a copy
        except ValueError as exc:
            raise BadRequest(str(exc)) from exc
        with telemetry.span("kv-index match") as span:
            results = self.index.match(hashes, time.time(), refresh=request.refresh)
            if span.is_recording():
                span.set_attributes(
                    {"kvfabric.shard_id": self.config.shard_id, "kvfabric.num_blocks": len(hashes)}
                )
                for r in results:  # this shard's hits of the prefix, and where it ends
                    span.set_attribute(f"kvfabric.hit_blocks.{r.tier}", len(r.indices))
                    span.set_attribute(f"kvfabric.first_miss.{r.tier}", r.first_miss_index)
            first_owned, holders = self.holders.match(hashes)
        return MatchReply(
            shard_id=self.config.shard_id,
            num_shards=self.config.num_shards,
            tiers=tuple(
                to_wire(r.tier, r.first_miss_index, r.indices, r.locations, r.evicted)
                for r in results
            ),
            first_owned_index=first_owned,
            holders=tuple(holders),
        )

    async def handle_admin(self, command: CacheCommand, ctx: Context) -> CacheStats:
        tier = command.tier or None
        if command.action == "evict":
            if not 0 <= command.fraction <= 1:
                raise BadRequest(f"evict fraction must be in [0, 1], got {command.fraction}")
            await self.notify_writers(self.index.evict_fraction(tier, command.fraction))
        elif command.action == "flush":
            await self.notify_writers(self.index.evict_fraction(tier, 1.0))
        elif command.action != "stats":
            raise BadRequest(f"unknown cache action {command.action!r}: stats, evict or flush")
        return self.stats()

    async def handle_rebuild(self, batch: RebuildBatch, ctx: Context) -> RebuildReply:
        num_indexed = self.index.adopt(batch.tier, batch.writer_id, batch.blocks, time.time())
        self.holds_adopted = True
        if batch.is_last:
            # The log that would have replayed this is gone: persist it at once.
            await self.save_snapshot()
        return RebuildReply(num_indexed=num_indexed)

    def stats(self) -> CacheStats:
        return CacheStats(
            shard_id=self.config.shard_id,
            instance_id=self.bus.instance_id,
            tiers=self.index.stats(),
            counters=dataclasses.asdict(self.index.counters) | self.holders.counters(),
        )

    # -- workers' own memory -------------------------------------------------------------
    async def on_holdings(self, msg: RawMessage) -> None:
        try:
            update = decode(msg.data, HoldingsUpdate)
        except msgspec.DecodeError as exc:
            log.warning("malformed holdings update", error=str(exc))
            return
        if self.holders.apply(update, time.monotonic()) and update.holder not in self._syncing:
            self._syncing.add(update.holder)
            task = asyncio.create_task(self._sync(update.holder))
            self._sync_tasks.add(task)
            task.add_done_callback(self._sync_tasks.discard)

    async def _sync(self, holder: str) -> None:
        """Ask `holder` for what this shard owns of its holdings, whole; on no answer forget
        it (its next update starts over)."""
        sync = HoldingsSync(shard_id=self.config.shard_id, num_shards=self.config.num_shards)
        try:
            snapshot = await self.bus.request(
                self.bus.subjects.kv_holdings_sync(holder), sync, HoldingsUpdate, timeout_s=2.0
            )
        except ServiceError as exc:
            log.info("holdings sync not answered: forgotten", holder=holder, error=exc.message)
            self.holders.drop(holder)
            return
        finally:
            self._syncing.discard(holder)
        if self.holders.apply(snapshot, time.monotonic()):
            await self._sync(holder)  # changed again meanwhile: once more

    async def expire_holders(self) -> None:
        for holder in self.holders.expire(time.monotonic()):
            log.info("worker silent: its holdings forgotten", holder=holder)

    # -- the event log -------------------------------------------------------------------
    async def on_event_batch(self, batch: KvEventBatch, stream_seq: int) -> None:
        self.last_stream_seq = stream_seq
        try:
            gap = self.index.apply(batch, time.time())
        except Exception:  # a batch whose content cannot be applied (half applied, maybe)
            log.exception(
                "kv event batch not applied: resyncing its writer",
                writer_id=batch.writer_id,
                seq=batch.seq,
                stream_seq=stream_seq,
            )
            await self._bad_batch(batch.writer_id, batch.seq)
            return
        if gap is not None:
            log.warning(
                "kv event gap, asking for resync",
                writer_id=gap.writer_id,
                expected_seq=gap.expected_seq,
                received_seq=gap.received_seq,
            )
            await self._resync(gap.writer_id, gap.expected_seq, gap.received_seq)

    async def on_bad_message(self, message: RawMessage, stream_seq: int, exc: Exception) -> None:
        """A log entry that is no `KvEventBatch` at all: its writer (the subject's last
        token) is asked for its whole state, which replaces whatever the entry held."""
        self.last_stream_seq = max(self.last_stream_seq, stream_seq)
        writer_id = message.subject.rsplit(".", 1)[-1]
        log.error(
            "malformed kv event batch: resyncing its writer",
            writer_id=writer_id,
            stream_seq=stream_seq,
            error=str(exc),
        )
        await self._bad_batch(writer_id, None)

    async def _bad_batch(self, writer_id: str, seq: int | None) -> None:
        self.index.counters.num_bad_batches += 1
        expected = self.index.writer_seq.get(writer_id, 0) + 1
        await self._resync(writer_id, expected, seq if seq is not None else expected)

    async def _resync(self, writer_id: str, expected_seq: int, received_seq: int) -> None:
        request = ResyncRequest(
            writer_id=writer_id, expected_seq=expected_seq, received_seq=received_seq
        )
        await self.bus.publish(self.bus.subjects.kv_resync(writer_id), request)

    # -- duties --------------------------------------------------------------------------
    async def evict_once(self) -> int:
        removals = self.index.evict(time.time())
        await self.notify_writers(removals)
        return sum(len(r.block_hashes) for r in removals)

    async def notify_writers(self, removals: list[Removal]) -> None:
        """Tell each writer which of its blocks left the index, so it reuses their slots and
        logs the removal as BlocksRemoved in its own sequence (which all replicas apply)."""
        for removal in removals:
            notice = BlocksRemoved(
                tier=removal.tier,
                block_hashes=pack_block_hashes(removal.block_hashes),
                reason=removal.reason,
            )
            await self.bus.publish(self.bus.subjects.kv_evict(removal.writer_id), notice)

    async def save_snapshot(self) -> None:
        if not self.bus.is_connected:  # a stop with the server gone: the log still has it all
            log.warning("snapshot not saved: not connected", stream_seq=self.last_stream_seq)
            return
        state = msgspec.msgpack.encode(
            {
                "version": SNAPSHOT_VERSION,
                "stream_seq": self.last_stream_seq,
                "index": self.index.snapshot(),
            }
        )
        description = ADOPTED if self.holds_adopted else None
        await self.bus.js.put_object(self.snapshot_bucket, self.snapshot_name, state, description)
        log.info("snapshot saved", stream_seq=self.last_stream_seq, num_bytes=len(state))

    async def snapshot_holds_adopted(self) -> bool:
        """Whether the saved snapshot holds blocks the event log never had (a rebuild)."""
        description = await self.bus.js.object_description(self.snapshot_bucket, self.snapshot_name)
        return description == ADOPTED

    async def load_snapshot(self) -> None:
        data = await self.bus.js.get_object(self.snapshot_bucket, self.snapshot_name)
        if data is None:
            return
        state = msgspec.msgpack.decode(data)
        if state.get("version") != SNAPSHOT_VERSION:
            log.warning("snapshot of another version ignored", version=state.get("version"))
            return
        self.index.restore(state["index"])
        self.last_stream_seq = int(state["stream_seq"])
        self.holds_adopted = await self.snapshot_holds_adopted()
        log.info("snapshot loaded", stream_seq=self.last_stream_seq)
