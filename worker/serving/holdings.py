"""What a worker's own memory holds, told to kv-index: the blocks in its KV pool (tagged
pages) and in its host tier, by hash, so that the router can weigh a worker that holds a
prefix in memory against one that must read it from the shared store (docs/design.md,
'KV tiers').

`Holdings` records each change as the pool and the host tier make it (from any thread, under
their own locks: it takes only its own). `HoldingsPublisher` sends what changed on core NATS
every `interval_s`, numbered, and at least every `keepalive_s` with nothing changed (kv-index
forgets a worker it has not heard from for a while). A shard that missed an update, or whose
count and digest of the holdings it owns differ from the worker's, asks for them whole
(`HoldingsSync`). Updates are core NATS, not the JetStream log: they are many, small, and
only worth their latest value.
"""

from __future__ import annotations

import asyncio
import secrets
import threading
import time

import msgspec
import numpy as np

from shared.bus import Bus, RawMessage
from shared.logging import get_logger
from shared.schema import decode
from shared.schema.kv_index import HoldingsSync, HoldingsUpdate, digest_share

log = get_logger(__name__)


class Holdings:
    """Thread-safe: the pool's allocator and the host tier call `set` from whichever thread
    changes them; the publisher takes the changes on the event loop."""

    def __init__(self, holder: str) -> None:
        self.holder = holder
        self.epoch = secrets.randbits(63)
        self.seq = 0  # of the last update taken
        self._lock = threading.Lock()
        self._masks: dict[int, int] = {}  # hash -> HOLD_DEVICE | HOLD_HOST
        self._changed: dict[int, int] = {}  # since the last update: hash -> its mask now
        # For each shard count a kv-index shard asked about: per shard, [count, digest].
        self._digests: dict[int, list[list[int]]] = {}

    @property
    def num_blocks(self) -> int:
        return len(self._masks)

    @property
    def has_changes(self) -> bool:
        return bool(self._changed)

    def set(self, block_hash: int, tier: int, held: bool) -> None:
        """Block `block_hash` is now held (or no longer) in `tier` (HOLD_DEVICE, HOLD_HOST)."""
        with self._lock:
            old = self._masks.get(block_hash, 0)
            new = old | tier if held else old & ~tier
            if new == old:
                return
            if new:
                self._masks[block_hash] = new
            else:
                del self._masks[block_hash]
            self._changed[block_hash] = new
            for num_shards, shards in self._digests.items():
                shard = shards[block_hash % num_shards]
                if old:
                    shard[0] -= 1
                    shard[1] ^= digest_share(block_hash, old)
                if new:
                    shard[0] += 1
                    shard[1] ^= digest_share(block_hash, new)

    def take_update(self, *, final: bool = False) -> HoldingsUpdate:
        """The changes since the previous update (maybe none), numbered."""
        with self._lock:
            changed, self._changed = self._changed, {}
            self.seq += 1
            return HoldingsUpdate(
                holder=self.holder,
                epoch=self.epoch,
                seq=self.seq,
                block_hashes=np.fromiter(changed, np.uint64, len(changed)).tobytes(),
                masks=bytes(changed.values()),
                digests={n: [(c, d) for c, d in shards] for n, shards in self._digests.items()},
                final=final,
            )

    def snapshot(self, shard_id: int, num_shards: int) -> HoldingsUpdate:
        """Every holding shard `shard_id` of `num_shards` owns, numbered as the last update
        taken; from now on every update carries that shard count's digests. It may already
        hold changes the next update brings: an update says where a block is now, not what
        changed, so applying it again is harmless."""
        if not 0 <= shard_id < num_shards:
            raise ValueError(f"shard {shard_id} of {num_shards}")
        with self._lock:
            if num_shards not in self._digests:
                self._digests[num_shards] = _digests(self._masks, num_shards)
            owned = {h: m for h, m in self._masks.items() if h % num_shards == shard_id}
            return HoldingsUpdate(
                holder=self.holder,
                epoch=self.epoch,
                seq=self.seq,
                block_hashes=np.fromiter(owned, np.uint64, len(owned)).tobytes(),
                masks=bytes(owned.values()),
                full=True,
                digests={num_shards: [tuple(x) for x in self._digests[num_shards]]},
            )


def _digests(masks: dict[int, int], num_shards: int) -> list[list[int]]:
    shards = [[0, 0] for _ in range(num_shards)]
    for block_hash, mask in masks.items():
        shard = shards[block_hash % num_shards]
        shard[0] += 1
        shard[1] ^= digest_share(block_hash, mask)
    return shards


class HoldingsPublisher:
    """Sends `holdings`' changes every `interval_s` (at least every `keepalive_s`) and
    answers kv-index shards' `HoldingsSync`."""

    def __init__(
        self, bus: Bus, holdings: Holdings, *, interval_s: float = 0.25, keepalive_s: float = 1.0
    ) -> None:
        self.bus = bus
        self.holdings = holdings
        self.interval_s = interval_s
        self.keepalive_s = keepalive_s
        self._last_sent = 0.0
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        subject = self.bus.subjects.kv_holdings_sync(self.holdings.holder)
        await self.bus.subscribe_raw(subject, self._on_sync)
        await self.bus.flush()
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        """Stop sending; tell kv-index to forget this worker (best effort: kv-index forgets
        a silent one anyway)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        try:
            await self.bus.publish(self._subject, self.holdings.take_update(final=True))
        except Exception as exc:  # a closed connection: the keepalive's absence says it
            log.info("holdings goodbye not sent", error=str(exc))

    @property
    def _subject(self) -> str:
        return self.bus.subjects.kv_holdings(self.holdings.holder)

    async def send(self, *, force: bool = False) -> bool:
        """Send what changed (or nothing, when the keepalive is due); False: nothing sent."""
        due = time.monotonic() - self._last_sent >= self.keepalive_s
        if not (force or due or self.holdings.has_changes):
            return False
        await self.bus.publish(self._subject, self.holdings.take_update())
        self._last_sent = time.monotonic()
        return True

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.send()
            except Exception as exc:  # NATS down: the next tick sends it, numbered after
                log.warning("holdings update not sent", error=str(exc))

    async def _on_sync(self, msg: RawMessage) -> None:
        try:
            sync = decode(msg.data, HoldingsSync)
            snapshot = self.holdings.snapshot(sync.shard_id, sync.num_shards)
        except (msgspec.DecodeError, ValueError) as exc:
            log.warning("malformed holdings sync", error=str(exc))
            return
        if msg.reply:
            await self.bus.publish(msg.reply, snapshot)
