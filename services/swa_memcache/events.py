"""What this memcache holds, told to every router: `SwaHeld` batches on
`<root>.swa-memcache.events.<instance_id>` (docs/design.md, 'Sliding-window state': the
router keeps a map from these events instead of asking every node per request).

- After each handler that can change the key set (a put commits or evicts, a get drops an
  expired entry, the sweep expires), the net change since the last batch (`tracked`).
- Sequence numbers per instance start from the clock in microseconds, so a restarted
  instance shows a jump; a router that sees a gap (or an instance it does not know) asks
  with `SwaResync` on `<root>.swa-memcache.resync` and gets the full state (`is_full`).
- At start an empty full state (a restarted instance holds nothing), at shutdown another
  (routers stop preferring this node at once, before its heartbeats time out).
- Each sweep publishes a batch even when nothing expired, so a lost last batch shows as a gap
  within one `expire_interval_s` instead of lasting until the next put.

Core NATS, not JetStream: a lost batch costs a resync (and until then, at worst, a bounded
replay on a node without the snapshot), never a wrong answer.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import ParamSpec, TypeVar

from services.swa_memcache.cache import SnapshotCache
from shared.bus import Bus
from shared.logging import get_logger
from shared.schema import pack_block_hashes
from shared.schema.swa import SwaHeld, SwaResync

log = get_logger(__name__)

P = ParamSpec("P")
R = TypeVar("R")

# 8 bytes a hash: 65,536 of them are 512 KiB, within NATS' default 1 MiB max payload.
MAX_HASHES_PER_BATCH = 65_536


class SwaEventPublisher:
    def __init__(
        self,
        bus: Bus,
        cache: SnapshotCache,
        *,
        node_id: str,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.bus = bus
        self.cache = cache
        self.node_id = node_id
        self.clock = clock
        self.seq = time.time_ns() // 1000
        self.num_batches = 0
        self.num_resyncs = 0
        self._lock = asyncio.Lock()  # batches leave in sequence order

    @property
    def instance_id(self) -> str:
        return self.bus.instance_id

    async def start(self) -> None:
        """Answer resync requests, then announce the (empty) state of a fresh instance."""
        await self.bus.subscribe(self.bus.subjects.swa_resync, SwaResync, self._on_resync)
        await self.bus.flush()
        await self.publish_state()

    async def stop(self) -> None:
        """Tell the routers we hold nothing any more (we are shutting down)."""
        async with self._lock:
            await self._send(is_full=True, added=[], removed=[])

    def tracked(
        self, handler: Callable[P, Awaitable[R]], *, confirm: bool = False
    ) -> Callable[P, Awaitable[R]]:
        """`handler`, followed by a batch of what it changed (also when it failed: a NIXL put
        that failed may have evicted entries first). `confirm`: a batch even when nothing
        changed (the sweep's, see the module docstring)."""

        async def run(*args: P.args, **kwargs: P.kwargs) -> R:
            try:
                return await handler(*args, **kwargs)
            finally:
                await self.publish_changes(confirm=confirm)

        return run

    async def publish_changes(self, *, confirm: bool = False) -> None:
        async with self._lock:
            added, removed = self.cache.take_changes()
            if added or removed or confirm:
                await self._send(is_full=False, added=added, removed=removed)

    async def publish_state(self) -> None:
        """The full state: a first batch with `is_full`, the rest of a large one after it."""
        async with self._lock:
            await self._send(is_full=True, added=self.cache.take_state(self.clock()), removed=[])

    async def _on_resync(self, request: SwaResync) -> None:
        if request.instance_id not in ("", self.instance_id):
            return  # another memcache's
        self.num_resyncs += 1
        log.info("full state asked for", reason=request.reason)
        await self.publish_state()

    async def _send(self, *, is_full: bool, added: list[int], removed: list[int]) -> None:
        # A full state or a sweep may name more hashes than one batch carries: several
        # batches, only the first of a full state marked `is_full`.
        for start in range(0, max(len(added), len(removed), 1), MAX_HASHES_PER_BATCH):
            self.seq += 1
            self.num_batches += 1
            batch = SwaHeld(
                instance_id=self.instance_id,
                node_id=self.node_id,
                seq=self.seq,
                is_full=is_full and start == 0,
                added=pack_block_hashes(added[start : start + MAX_HASHES_PER_BATCH]),
                removed=pack_block_hashes(removed[start : start + MAX_HASHES_PER_BATCH]),
            )
            await self.bus.publish(self.bus.subjects.swa_events(self.instance_id), batch)
