"""The simulated hardware: the shared store behind the production kv-index, each prefill
server's host-memory tier, and the prefill and decode GPUs, timed by the reference rates.

- Store: every writer's `BlocksStored` batch goes to kv-index's own `KvIndex` (its apply,
  match and evict), and a hit is what its match answers. Reads share the store's aggregate
  bandwidth as a backlog that drains at that rate, never faster than one GPU ingests.
- Host tier: per prefill server, an LRU of blocks (what `worker/engine/host_tier.py` keeps
  per worker; here per node, shared by its GPUs). What each node holds of a prompt's prefix
  is the router's `RequestFacts.local_hit_blocks`.
- Prefill GPU: two stages, first come first served: loading a job's prefix (host tier, then
  the store) overlaps computing the job before it, as the reference's 1.5M tokens/s at 96%
  hit (1.44M loaded + 60K computed in the same second) implies.
- Decode GPU: processor sharing: each sequence gets `user_tokens_per_s` while the GPU's
  `decode_tokens_per_s` covers them all, an equal share of it beyond.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from services.kv_index.index import KvIndex
from services.kv_index.table import DAY_S
from shared.schema import BlocksStored, KvEventBatch, LoadReport, StoredBlock
from shared.subjects import DECODE, PREFILL

TIER = "ssd"  # the store's tier, as worker/kvstore/writer.py names it


class Store:
    def __init__(self, capacity_bytes: int, read_bytes_per_s: float, block_bytes: int) -> None:
        self.index = KvIndex({TIER: capacity_bytes}, ttl_s=DAY_S)
        self.read_bytes_per_s = read_bytes_per_s
        self.block_bytes = block_bytes
        self.busy_until_s = 0.0
        self.bytes_read = 0
        self.num_blocks_written = 0
        self.num_blocks_evicted = 0
        self._seq: dict[str, int] = {}
        self._slot: dict[str, int] = {}

    def num_hit_blocks(self, hashes: Sequence[int], now_s: float) -> int:
        """kv-index's longest cached prefix of `hashes` (one shard: its own answer)."""
        if not hashes:
            return 0
        results = self.index.match(hashes, now_s)
        return next(r.first_miss_index for r in results if r.tier == TIER)

    def write(self, writer_id: str, hashes: Sequence[int], now_s: float) -> None:
        """What a writer logs after writing `hashes`: one batch, next in its sequence."""
        if not hashes:
            return
        seq = self._seq[writer_id] = self._seq.get(writer_id, 0) + 1
        slot = self._slot.get(writer_id, 0)
        self._slot[writer_id] = slot + len(hashes)
        blocks = tuple(
            StoredBlock(h, 0, slot + i, 0, self.block_bytes) for i, h in enumerate(hashes)
        )
        batch = KvEventBatch(
            writer_id=writer_id,
            seq=seq,
            ts_ms=round(now_s * 1000),
            events=(BlocksStored(tier=TIER, blocks=blocks),),
        )
        self.index.apply(batch, now_s)
        self.num_blocks_written += len(hashes)

    def read(self, start_s: float, num_bytes: int, floor_s: float) -> float:
        """When a read of `num_bytes` started at `start_s` ends; `floor_s`: its time on an
        idle store (one GPU's ingest rate)."""
        if num_bytes <= 0:
            return start_s + floor_s
        self.bytes_read += num_bytes
        self.busy_until_s = max(self.busy_until_s, start_s) + num_bytes / self.read_bytes_per_s
        return max(start_s + floor_s, self.busy_until_s)

    def evict(self, now_s: float) -> int:
        removed = sum(len(r.block_hashes) for r in self.index.evict(now_s))
        self.num_blocks_evicted += removed
        return removed


class HostTiers:
    """Each node's DRAM tier: an LRU of block hashes, and which nodes hold each block."""

    def __init__(self, node_ids: Sequence[str], capacity_blocks: int) -> None:
        self.capacity_blocks = capacity_blocks
        self._lru: dict[str, OrderedDict[int, None]] = {n: OrderedDict() for n in node_ids}
        self._holders: dict[int, set[str]] = {}
        self.num_blocks_evicted = 0

    def hold(self, node_id: str, hashes: Sequence[int]) -> None:
        """The node's GPUs used these blocks: they are its most recent."""
        lru = self._lru[node_id]
        for h in hashes:
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
                self._holders.setdefault(h, set()).add(node_id)
        while len(lru) > self.capacity_blocks:
            h, _ = lru.popitem(last=False)
            holders = self._holders[h]
            holders.discard(node_id)
            if not holders:
                del self._holders[h]
            self.num_blocks_evicted += 1

    def leading_runs(self, hashes: Sequence[int]) -> dict[str, int]:
        """Per node holding the first block, how many leading blocks of `hashes` it holds."""
        if not hashes:
            return {}
        first = self._holders.get(hashes[0])
        if not first:
            return {}
        alive, runs = set(first), {}
        for i in range(1, len(hashes)):
            held = self._holders.get(hashes[i])
            if held is not None and alive <= held:
                continue
            lost = alive if held is None else alive - held
            for node_id in lost:
                runs[node_id] = i
            alive -= lost
            if not alive:
                return runs
        for node_id in alive:
            runs[node_id] = len(hashes)
        return runs


@dataclass(eq=False)
class PrefillGpu:
    worker_id: str
    node_id: str
    load_free_s: float = 0.0
    compute_free_s: float = 0.0
    num_queued_tokens: int = 0  # as the router counts a job: not computed yet
    num_jobs: int = 0
    report_seq: int = 0

    def schedule(self, now_s: float, load: Callable[[float], float], compute_s: float) -> float:
        """Queue a job; `load(start_s)` gives when its prefix is loaded. Returns when its
        compute starts (it ends `compute_s` later)."""
        loaded_s = load(max(now_s, self.load_free_s))
        self.load_free_s = loaded_s
        start_s = max(loaded_s, self.compute_free_s)
        self.compute_free_s = start_s + compute_s
        return start_s


@dataclass(eq=False)
class DecodeGpu:
    worker_id: str
    node_id: str
    num_pages_total: int
    decode_tokens_per_s: float
    user_tokens_per_s: float
    num_pages_used: int = 0
    report_seq: int = 0
    version: int = 0  # a scheduled check with another version is stale
    _attained: float = 0.0  # tokens every running sequence has received since the start
    _updated_s: float = 0.0
    _running: list[tuple[float, int, object]] = field(default_factory=list)
    _count: int = 0

    @property
    def num_running(self) -> int:
        return len(self._running)

    def rate(self) -> float:
        """Tokens/s of each running sequence."""
        n = len(self._running)
        return min(self.user_tokens_per_s, self.decode_tokens_per_s / n) if n else 0.0

    def advance(self, now_s: float, produced: Callable[[float, float, float], None]) -> None:
        """Run the batch until `now_s`; `produced(start_s, end_s, tokens_per_s)`."""
        if now_s > self._updated_s and self._running:
            rate = self.rate()
            self._attained += rate * (now_s - self._updated_s)
            produced(self._updated_s, now_s, rate * len(self._running))
        self._updated_s = max(self._updated_s, now_s)

    def start(self, job: object, num_tokens: int) -> None:
        """Add a sequence of `num_tokens` (call `advance` to now first)."""
        self._count += 1
        heapq.heappush(self._running, (self._attained + num_tokens, self._count, job))
        self.version += 1

    def take_finished(self) -> list[object]:
        done = []
        while self._running and self._running[0][0] <= self._attained + 1e-6:
            done.append(heapq.heappop(self._running)[2])
        if done:
            self.version += 1
        return done

    def next_finish_s(self) -> float | None:
        if not self._running:
            return None
        return self._updated_s + max(self._running[0][0] - self._attained, 0.0) / self.rate()


def load_report(gpu: PrefillGpu | DecodeGpu, now_s: float, model: str) -> LoadReport:
    """The GPU's next heartbeat, as its worker fills one in."""
    gpu.report_seq += 1
    if isinstance(gpu, PrefillGpu):
        fields = {
            "service": PREFILL,
            "num_queued": gpu.num_jobs,
            "num_queued_tokens": max(gpu.num_queued_tokens, 0),
        }
    else:
        fields = {
            "service": DECODE,
            "num_running": gpu.num_running,
            "num_kv_pages_total": gpu.num_pages_total,
            "num_kv_pages_free": max(gpu.num_pages_total - gpu.num_pages_used, 0),
        }
    return LoadReport(
        instance_id=gpu.worker_id,
        seq=gpu.report_seq,
        ts_ms=round(now_s * 1000),
        node_id=gpu.node_id,
        model=model,
        num_devices=1,
        **fields,
    )
