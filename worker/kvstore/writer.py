"""A writer's side of the KV event protocol: what prefill and decode workers run beside their
`KvStore` so that kv-index knows what they hold.

- `store_blocks`: write blocks to the store and log `BlocksStored` for those written.
- Every batch goes to the JetStream event log (`<root>.kv.events.<writer_id>`) with the next
  sequence number. Numbers start from the clock in microseconds, so a restarted writer keeps
  counting upward: kv-index sees a jump (a gap), asks for a resync, and gets the whole state.
- `<root>.kv.resync.<writer_id>`: kv-index saw a gap; answer with AllBlocksCleared and then
  every live block (in batches small enough for the max payload).
- `<root>.kv.evict.<writer_id>`: kv-index dropped these blocks; free their slots for reuse and
  log `BlocksRemoved`, which every index replica applies.
A restarted writer adopts the valid slots it finds in its files and announces them at start.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

from shared.bus import Bus
from shared.logging import get_logger
from shared.schema import (
    AllBlocksCleared,
    BlocksPinned,
    BlocksRemoved,
    BlocksStored,
    KvEvent,
    KvEventBatch,
    StoredBlock,
    pack_block_hashes,
    unpack_block_hashes,
)
from shared.schema.kv_index import ResyncRequest
from worker.kvstore.store import KvStore

log = get_logger(__name__)

# ~40 bytes a block on the wire: 20,000 blocks stay well under the 8 MB max payload.
MAX_BLOCKS_PER_BATCH = 20_000


class KvEventPublisher:
    def __init__(self, bus: Bus, store: KvStore, *, tier: str = "ssd") -> None:
        self.bus = bus
        self.store = store
        self.tier = tier
        self.writer_id = store.writer_id
        self.seq = time.time_ns() // 1000
        self.live: dict[int, StoredBlock] = {b.block_hash: b for b in store.adopted}
        self.num_resyncs = 0
        self._lock = asyncio.Lock()  # batches leave in sequence order

    async def start(self) -> None:
        subjects = self.bus.subjects
        await self.bus.subscribe(subjects.kv_resync(self.writer_id), ResyncRequest, self._on_resync)
        await self.bus.subscribe(subjects.kv_evict(self.writer_id), BlocksRemoved, self._on_evicted)
        await self.bus.flush()
        if self.live:
            log.info(
                "announcing adopted slots", writer_id=self.writer_id, num_blocks=len(self.live)
            )
            await self.resync()

    async def store_blocks(
        self, blocks: Sequence[tuple[int, bytes | memoryview]], parent_block_hash: int | None = None
    ) -> list[StoredBlock | None]:
        """Write (block_hash, payload) pairs and log the ones written; None where skipped."""
        stored = await self.store.write_blocks(blocks)
        written = tuple(b for b in stored if b is not None)
        if written:
            for block in written:
                self.live[block.block_hash] = block
            await self._publish(
                (BlocksStored(tier=self.tier, blocks=written, parent_block_hash=parent_block_hash),)
            )
        return stored

    async def pin(self, block_hashes: Sequence[int], until_ms: int) -> None:
        """Log a pin of these blocks (a request's cache_control prefix) until `until_ms`."""
        if block_hashes:
            pinned = BlocksPinned(
                tier=self.tier, block_hashes=pack_block_hashes(block_hashes), until_ms=until_ms
            )
            await self._publish((pinned,))

    async def resync(self) -> None:
        """Publish the whole state: AllBlocksCleared, then every live block."""
        self.num_resyncs += 1
        blocks = list(self.live.values())
        events: list[KvEvent] = [AllBlocksCleared(tier=self.tier)]
        async with self._lock:
            for start in range(0, max(len(blocks), 1), MAX_BLOCKS_PER_BATCH):
                chunk = tuple(blocks[start : start + MAX_BLOCKS_PER_BATCH])
                if chunk:
                    events.append(BlocksStored(tier=self.tier, blocks=chunk))
                await self._send(tuple(events))
                events = []

    async def _on_resync(self, request: ResyncRequest) -> None:
        log.warning(
            "kv-index asked for a resync",
            expected_seq=request.expected_seq,
            received_seq=request.received_seq,
        )
        await self.resync()

    async def _on_evicted(self, notice: BlocksRemoved) -> None:
        if notice.tier != self.tier:
            return
        evicted = [
            self.live.pop(h)
            for h in unpack_block_hashes(notice.block_hashes).tolist()
            if h in self.live
        ]
        if not evicted:
            return  # a replica's duplicate notice, or blocks already gone
        self.store.free_slots(evicted)
        removed = BlocksRemoved(
            tier=self.tier,
            block_hashes=pack_block_hashes([b.block_hash for b in evicted]),
            reason=notice.reason,
        )
        await self._publish((removed,))

    async def _publish(self, events: tuple[KvEvent, ...]) -> None:
        async with self._lock:
            await self._send(events)

    async def _send(self, events: tuple[KvEvent, ...]) -> None:
        self.seq += 1
        batch = KvEventBatch(
            writer_id=self.writer_id, seq=self.seq, ts_ms=time.time_ns() // 1_000_000, events=events
        )
        # The message id makes a retried publish a no-op in the log (JetStream dedupe).
        await self.bus.js.publish(
            self.bus.subjects.kv_events(self.writer_id),
            batch,
            msg_id=f"{self.writer_id}:{self.seq}",
        )
