"""Which worker holds which block in its own memory (KV pool, host tier), for the blocks this
shard owns: what workers tell in `HoldingsUpdate`s (worker/serving/holdings.py), so that a
match answers each worker's own hit beside the shared store's.

One entry per (block, holder): `blocks[hash][holder] = mask` (HOLD_DEVICE | HOLD_HOST), and
per holder the set of its hashes, to drop them all when it goes away (a goodbye, or silence
for `ttl_s`). A holder whose updates skip a number, come from a new process (epoch) or whose
count and digest of this shard's part differ from its own asks for a sync (the caller sends
`HoldingsSync`; updates that come meanwhile wait for the answer).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from shared.schema.kv_index import HOLD_DEVICE, HolderMatch, HoldingsUpdate, digest_share

MAX_HELD_BACK = 256  # updates kept while a sync is awaited (a sync that fails drops them)


@dataclass
class _Holder:
    epoch: int
    seq: int = 0
    last_heard_s: float = 0.0
    hashes: set[int] = field(default_factory=set)
    digest: int = 0  # of this shard's part (with len(hashes)): compared with the holder's own
    syncing: bool = False  # a sync asked and not answered: updates wait in `held_back`
    held_back: list[HoldingsUpdate] = field(default_factory=list)


@dataclass
class HolderIndex:
    shard_id: int = 0
    num_shards: int = 1
    ttl_s: float = 5.0  # a holder not heard from for this long is forgotten
    blocks: dict[int, dict[str, int]] = field(default_factory=dict)
    holders: dict[str, _Holder] = field(default_factory=dict)
    num_syncs: int = 0

    @property
    def num_entries(self) -> int:
        """(block, holder) pairs."""
        return sum(len(h.hashes) for h in self.holders.values())

    def owns(self, block_hash: int) -> bool:
        return block_hash % self.num_shards == self.shard_id

    # -- updates ------------------------------------------------------------------------
    def apply(self, update: HoldingsUpdate, now_s: float) -> bool:
        """Take one update (or a sync's answer); True: the holder must be synced (the caller
        sends `HoldingsSync` and brings the answer here)."""
        if update.final:
            self.drop(update.holder)
            return False
        holder = self.holders.get(update.holder)
        if update.full:
            return self._take_snapshot(update, holder, now_s)
        if holder is None or holder.epoch != update.epoch:
            self.drop(update.holder)  # a new process: what the old one held is gone
            self.holders[update.holder] = _Holder(update.epoch, syncing=True, last_heard_s=now_s)
            self.holders[update.holder].held_back.append(update)
            return True
        holder.last_heard_s = now_s
        if holder.syncing:
            if len(holder.held_back) < MAX_HELD_BACK:
                holder.held_back.append(update)
            return False
        return self._step(update.holder, holder, update)

    def _step(self, name: str, holder: _Holder, update: HoldingsUpdate) -> bool:
        """The next update in order; True: out of order or disagreeing (a sync is due)."""
        if update.seq <= holder.seq:
            return False  # the snapshot already held it
        if update.seq == holder.seq + 1:
            self._change(name, holder, update)
            if self._agrees(holder, update):
                return False
        holder.syncing, holder.held_back = True, []
        return True

    def _take_snapshot(self, update: HoldingsUpdate, holder: _Holder | None, now_s: float) -> bool:
        held_back = holder.held_back if holder is not None and holder.epoch == update.epoch else []
        self.drop(update.holder)
        holder = self.holders[update.holder] = _Holder(update.epoch, last_heard_s=now_s)
        self.num_syncs += 1
        self._change(update.holder, holder, update)
        if not self._agrees(holder, update):
            holder.syncing = True
            return True
        return any(self._step(update.holder, holder, later) for later in held_back)

    def _change(self, name: str, holder: _Holder, update: HoldingsUpdate) -> None:
        hashes = np.frombuffer(update.block_hashes, np.uint64).tolist()
        for block_hash, mask in zip(hashes, update.masks, strict=True):
            if not self.owns(block_hash):
                continue
            entry = self.blocks.get(block_hash)
            old = entry.get(name, 0) if entry is not None else 0
            if old:
                holder.digest ^= digest_share(block_hash, old)
            if mask:
                holder.digest ^= digest_share(block_hash, mask)
                if entry is None:
                    entry = self.blocks[block_hash] = {}
                entry[name] = mask
                holder.hashes.add(block_hash)
            elif old:
                del entry[name]  # type: ignore[union-attr]
                if not entry:
                    del self.blocks[block_hash]
                holder.hashes.discard(block_hash)
        holder.seq = update.seq

    def _agrees(self, holder: _Holder, update: HoldingsUpdate) -> bool:
        """The holder's count and digest of this shard's part, where it sent them, are ours."""
        shards = update.digests.get(self.num_shards)
        if shards is None or len(shards) != self.num_shards:
            return True  # not asked for yet (the sync that follows a first update asks)
        return tuple(shards[self.shard_id]) == (len(holder.hashes), holder.digest)

    def drop(self, name: str) -> None:
        """Forget everything `name` holds."""
        holder = self.holders.pop(name, None)
        if holder is None:
            return
        for block_hash in holder.hashes:
            entry = self.blocks.get(block_hash)
            if entry is not None:
                entry.pop(name, None)
                if not entry:
                    del self.blocks[block_hash]

    def expire(self, now_s: float) -> list[str]:
        """Forget the holders not heard from for `ttl_s`; their names."""
        gone = [n for n, h in self.holders.items() if now_s - h.last_heard_s > self.ttl_s]
        for name in gone:
            self.drop(name)
        return gone

    # -- match --------------------------------------------------------------------------
    def match(self, hashes: np.ndarray) -> tuple[int, list[HolderMatch]]:
        """For the request's chain `hashes`: the first position this shard owns (len if
        none), and for each holder of that block how far, over the positions this shard
        owns, its memory (and its device pool alone) holds the chain."""
        positions = np.flatnonzero(hashes % np.uint64(self.num_shards) == self.shard_id)
        if len(positions) == 0:
            return len(hashes), []
        first_owned = int(positions[0])
        keys = hashes[positions].tolist()
        held = self.blocks.get(keys[0])
        if not held:
            return first_owned, []
        end = len(hashes)
        memory = dict.fromkeys(held, end)
        device = {name: first_owned for name, mask in held.items() if not mask & HOLD_DEVICE}
        device_alive = {name for name, mask in held.items() if mask & HOLD_DEVICE}
        alive = set(held)
        for position, block_hash in zip(positions[1:].tolist(), keys[1:], strict=True):
            entry = self.blocks.get(block_hash, {})
            for name in [n for n in alive if n not in entry]:
                alive.discard(name)
                memory[name] = position
            for name in [n for n in device_alive if not entry.get(n, 0) & HOLD_DEVICE]:
                device_alive.discard(name)
                device[name] = position
            if not alive:
                break
        return first_owned, [
            HolderMatch(
                holder=name,
                first_miss_index=memory[name],
                first_device_miss_index=device.get(name, memory[name]),
            )
            for name in memory
        ]

    def counters(self) -> dict[str, int]:
        """For `kvfabric cache stats` (summed over shards)."""
        return {"num_holder_entries": self.num_entries, "num_holder_syncs": self.num_syncs}
