"""The shared store's read bandwidth as a router sees it: the bytes of the store reads it sent,
a backlog that drains at the store's aggregate rate. A read waits for the backlog ahead of it
and then moves at the aggregate rate, but never faster than one GPU ingests (the cost model's
load rate): on an idle store a read takes what the cost model says, on a saturated one it
queues. The offline replay times its simulated store with the same model.

Each router counts only its own reads (routers share work in flight through heartbeats, not
bytes): with R routers each sees about 1/R of the load, so a saturated store is seen late
rather than never. `bytes_per_s=None` is a store that never saturates.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StoreReads:
    bytes_per_s: float | None = None  # aggregate read bandwidth (None: unlimited)
    backlog_bytes: float = 0.0
    updated_s: float = 0.0
    bytes_read: int = 0  # every read added, for rates over a run

    def __post_init__(self) -> None:
        if self.bytes_per_s is not None and not self.bytes_per_s > 0:
            raise ValueError(f"bytes_per_s must be > 0 or None, got {self.bytes_per_s}")

    def _drain(self, now_s: float) -> None:
        if self.bytes_per_s is not None and now_s > self.updated_s:
            drained = (now_s - self.updated_s) * self.bytes_per_s
            self.backlog_bytes = max(self.backlog_bytes - drained, 0.0)
        self.updated_s = max(self.updated_s, now_s)

    def read_s(self, nbytes: int, floor_s: float, now_s: float) -> float:
        """How long a read of `nbytes` sent now takes; `floor_s` is its time on an idle store."""
        if self.bytes_per_s is None or nbytes <= 0:
            return floor_s
        self._drain(now_s)
        return max((self.backlog_bytes + nbytes) / self.bytes_per_s, floor_s)

    def add(self, nbytes: int, now_s: float) -> None:
        """A read of `nbytes` was sent now."""
        if nbytes <= 0:
            return
        self._drain(now_s)
        self.backlog_bytes += nbytes
        self.bytes_read += nbytes
