"""Which nodes hold which sliding-window snapshots, as the memcaches' `SwaHeld` events tell.

Pure and synchronous (no NATS, no asyncio): handler.py feeds it batches and asks it per
request. It replaces asking every memcache `contains` per request, which at the reference
deployment's ~150 prefill nodes was ~150 NATS requests per generate (docs/design.md,
'Sliding-window state').

Per memcache instance: its node, the last sequence number seen and the hashes it holds.
- A full batch (`is_full`) replaces what was known of the instance, whatever its sequence
  (a restarted instance starts from a clock-based number and with a full batch).
- A batch from an instance not known, or after a gap in its sequence, is applied all the
  same (it is still the best knowledge) and `apply` says to ask that instance for its full
  state; once asked, not again for `resync_interval_s` unless a full state arrives first,
  so a burst of batches past one gap costs one resync, not one per batch.
- A repeated or older non-full batch is ignored.
Knowledge may lag or be wrong (a lost batch until the next one shows the gap): the price is
a prefill worker chosen without the snapshot (a bounded replay), or one chosen for a
snapshot that is gone (the same replay), never a wrong answer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.schema import unpack_block_hashes
from shared.schema.swa import SwaHeld


@dataclass
class SwaMapCounters:
    num_batches: int = 0
    num_full_batches: int = 0
    num_stale_batches: int = 0  # repeated or older: ignored
    num_gaps: int = 0
    num_unknown: int = 0  # a non-full batch from an instance not known
    num_resyncs_asked: int = 0


@dataclass
class _Instance:
    node_id: str
    seq: int
    held: set[int] = field(default_factory=set)
    resync_asked_at: float | None = None  # cleared by a full state


class SwaMap:
    def __init__(self, *, resync_interval_s: float = 1.0) -> None:
        self.resync_interval_s = resync_interval_s
        self.counters = SwaMapCounters()
        self._instances: dict[str, _Instance] = {}

    def __len__(self) -> int:
        return len(self._instances)

    def apply(self, batch: SwaHeld, now_s: float) -> bool:
        """Learn from one batch; True when its instance should be asked for a resync.

        Raises ValueError when `added` or `removed` is not packed u64 (nothing is applied)."""
        added = unpack_block_hashes(batch.added).tolist()
        removed = unpack_block_hashes(batch.removed).tolist()
        known = self._instances.get(batch.instance_id)
        self.counters.num_batches += 1
        if batch.is_full:
            self.counters.num_full_batches += 1
            self._instances[batch.instance_id] = _Instance(batch.node_id, batch.seq, set(added))
            return False
        if known is not None and batch.seq <= known.seq:
            self.counters.num_stale_batches += 1
            return False
        if known is None:
            self.counters.num_unknown += 1
            known = self._instances[batch.instance_id] = _Instance(batch.node_id, batch.seq)
            is_complete = False
        else:
            is_complete = batch.seq == known.seq + 1
            if not is_complete:
                self.counters.num_gaps += 1
            known.seq = batch.seq
            known.node_id = batch.node_id
        known.held.difference_update(removed)
        known.held.update(added)
        if is_complete:
            return False
        return self._should_ask(known, now_s)

    def holders(self, block_hash: int) -> frozenset[str]:
        """The nodes whose memcache holds `block_hash`'s snapshot.

        A scan of every instance: ~150 set lookups, some microseconds per request, and no
        reverse index to keep in step with every batch."""
        return frozenset(i.node_id for i in self._instances.values() if block_hash in i.held)

    def forget(self, instance_id: str) -> bool:
        """Drop an instance (its heartbeats stopped); whether it was known."""
        return self._instances.pop(instance_id, None) is not None

    def num_held(self, instance_id: str) -> int:
        known = self._instances.get(instance_id)
        return 0 if known is None else len(known.held)

    def _should_ask(self, known: _Instance, now_s: float) -> bool:
        asked_at = known.resync_asked_at
        if asked_at is not None and now_s - asked_at < self.resync_interval_s:
            return False  # asked already; its full state is on the way
        known.resync_asked_at = now_s
        self.counters.num_resyncs_asked += 1
        return True
