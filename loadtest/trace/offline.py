"""The trace replayed without NATS through the router's real `RoutePolicy` and `LoadTable`
and kv-index's real `KvIndex`, on a simulated clock, over two tiers: each prefill worker's own
memory (an LRU cache of `capacity_tokens`) and the shared store every worker writes what it
computes to and reads from (unbounded, as 100 PiB is for a day, at `store_gbps_per_gpu` x the
workers of aggregate read bandwidth).

Per request, at its (time-scaled) arrival: the router's facts (`RequestFacts`: the store's
longest hit, capped by `RequestBlocks` at the blocks a job may reuse; each worker's own hit;
the nodes holding that boundary's window), then the placement: the router's own (`kv`,
`least-loaded`, `round-robin`: `PolicyConfig.placement`, one copy of each, in the router), or
the oracle (each request to the worker with the longest own hit, ties by load). The decode
worker is always `choose`'s, and the in-flight deltas are recorded as the router records
them. The chosen worker's memory gives the hit it loads from its own tier (refreshed, as a
read is); the store gives the rest of the cached prefix.

Workers follow the cost model the router estimates with (`worker.cost_model`), as the mock
engine does: a prefill worker runs its jobs first come, first served, each taking compute of
the uncached tokens + the load of its own hit from host memory + the read of the rest from the
store (`StoreReads`: behind the reads before it at the store's bandwidth, never faster than
one GPU ingests) + a bounded replay without the window; when one ends, its new blocks go to
its memory and the store, its window to its node's memcache, and decode starts
(`output_length` steps at the batch's step time). At the end decode writes the prompt's last
complete block (the one holding its last token) to the store, as the real decode worker does;
answer blocks are not stored (synthetic prompts never contain them). Each worker reports its
load (`LoadReport`) every `heartbeat_s`.

Admission is off (no TTFT objective, no queue bound, decode pages without limit), so every
policy serves every request and the figures compare placement alone.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import msgspec

from loadtest.trace.caches import BlockCache, Caches, WindowMap
from loadtest.trace.synth import PromptHashes, TraceRequest, arrivals_s
from loadtest.trace.workers import Job, SimDecode, SimPrefill
from services.router.policy import (
    KV,
    LEAST_LOADED,
    PLACEMENTS,
    ROUND_ROBIN,
    PolicyConfig,
    Rejection,
    RequestFacts,
    RoutePolicy,
)
from services.router.store_reads import StoreReads
from shared.blocks import RequestBlocks
from shared.load_table import LoadTable
from shared.schema import LoadReport, RouteDecision
from shared.subjects import DECODE, PREFILL
from worker.cost_model import CostModel

ORACLE = "oracle"  # each request to the worker with the longest own hit, ties by load
POLICY_NAMES = (*PLACEMENTS, ORACLE)
BASELINES = (LEAST_LOADED, ROUND_ROBIN)
ROUTER_ID = "router-offline"
DECODE_PAGES = 1 << 40  # per decode worker: none ever waits for pages here
MIN_TTL_S = 600.0
# Event order at one instant: work ends, then heartbeats report it, then arrivals see it.
_DONE, _HEARTBEAT, _ARRIVAL = 0, 1, 2


@dataclass(frozen=True)
class ReplayConfig:
    num_workers: int = 8  # prefill workers (each on a node of its own), and as many decode
    capacity_tokens: int | None = None  # each worker's own memory (None: unlimited)
    # The store's read bandwidth per prefill GPU, GB/s (None: unlimited); the reference
    # deployment's 10 TiB/s over ~1,200 prefill GPUs is ~9.
    store_gbps_per_gpu: float | None = None
    speed: float = 1.0  # the trace replayed at this many times its rate
    cost: CostModel = field(default_factory=CostModel)
    heartbeat_s: float = 1.0
    max_output_tokens: int | None = None  # cap on each request's decode (None: the trace's)
    window_ttl_s: float = 180.0

    def __post_init__(self) -> None:
        if self.num_workers <= 0:
            raise ValueError(f"num_workers must be > 0, got {self.num_workers}")
        if self.capacity_tokens is not None and self.capacity_tokens <= 0:
            raise ValueError(f"capacity_tokens must be > 0, got {self.capacity_tokens}")
        if self.store_gbps_per_gpu is not None and not self.store_gbps_per_gpu > 0:
            raise ValueError(f"store_gbps_per_gpu must be > 0, got {self.store_gbps_per_gpu}")
        if not self.speed > 0 or not self.heartbeat_s > 0:
            raise ValueError("speed and heartbeat_s must be > 0")
        if self.max_output_tokens is not None and self.max_output_tokens <= 0:
            raise ValueError(f"max_output_tokens must be > 0, got {self.max_output_tokens}")

    @property
    def store_bytes_per_s(self) -> float | None:
        """The store's aggregate read bandwidth."""
        if self.store_gbps_per_gpu is None:
            return None
        return self.store_gbps_per_gpu * 1e9 * self.num_workers


@dataclass(frozen=True)
class Outcome:
    index: int  # the request's position in the trace
    num_prompt_tokens: int
    num_cached_tokens: int  # from the worker's own memory and the store
    prefill_worker_id: str
    ttft_s: float  # arrival -> the first decode step's end, on the simulated clock
    num_local_tokens: int = 0  # of the cached, from the worker's own memory


@dataclass
class ReplayResult:
    policy: str
    config: ReplayConfig
    outcomes: list[Outcome]  # in trace order
    num_blocks_evicted: int  # from the workers' memories
    utilization: float  # of the prefill workers: busy time over theirs from 0 to the last end
    store_bytes_read: int = 0
    end_s: float = 0.0  # the last prefill's end

    @property
    def hit_rate(self) -> float:
        """Cached prompt tokens (both tiers) over all prompt tokens."""
        total = sum(o.num_prompt_tokens for o in self.outcomes)
        return sum(o.num_cached_tokens for o in self.outcomes) / total

    @property
    def local_hit_rate(self) -> float:
        """Prompt tokens loaded from the workers' own memory over all prompt tokens."""
        total = sum(o.num_prompt_tokens for o in self.outcomes)
        return sum(o.num_local_tokens for o in self.outcomes) / total

    @property
    def store_hit_rate(self) -> float:
        return self.hit_rate - self.local_hit_rate

    @property
    def store_bytes_per_s(self) -> float:
        return self.store_bytes_read / self.end_s if self.end_s else 0.0

    def ttft_s(self, quantile: float) -> float:
        ordered = sorted(o.ttft_s for o in self.outcomes)
        return ordered[min(len(ordered) - 1, int(quantile * len(ordered)))]

    @property
    def mean_ttft_s(self) -> float:
        return sum(o.ttft_s for o in self.outcomes) / len(self.outcomes)


class Replay:
    """One replay of `requests` under one policy and config; `run` once."""

    def __init__(
        self,
        requests: Sequence[TraceRequest],
        prompts: PromptHashes,
        config: ReplayConfig,
        policy: str = KV,
    ) -> None:
        if policy not in POLICY_NAMES:
            raise ValueError(f"unknown policy {policy!r}; known: {', '.join(POLICY_NAMES)}")
        if not requests:
            raise ValueError("no requests to replay")
        if any(a.timestamp_ms > b.timestamp_ms for a, b in itertools.pairwise(requests)):
            raise ValueError("requests must be in arrival order")
        self.requests, self.prompts, self.config, self.policy_name = (
            requests,
            prompts,
            config,
            policy,
        )
        self.model = prompts.hasher.model_id
        self.policy = RoutePolicy(
            config.cost,
            PolicyConfig(
                ttft_objective_s=None,
                max_queued_tokens=1 << 62,
                decode_page_size_tokens=prompts.block_size,
                placement=KV if policy == ORACLE else policy,
                store_read_bytes_per_s=config.store_bytes_per_s,
            ),
        )
        # The store as it is (the router's `policy.store` is its own view of it).
        self.store_reads = StoreReads(config.store_bytes_per_s)
        # The router's: a worker is gone after three missed heartbeats (1 s and 3 s there).
        self.table = LoadTable(ROUTER_ID, heartbeat_timeout_s=3 * config.heartbeat_s)
        n = config.num_workers
        self.prefill = {f"prefill-{i}": SimPrefill(f"prefill-{i}", f"node-{i}") for i in range(n)}
        self.decode = {f"decode-{i}": SimDecode(f"decode-{i}") for i in range(n)}
        capacity = config.capacity_tokens
        num_blocks = None if capacity is None else max(capacity // prompts.block_size, 1)
        self.arrivals_s = arrivals_s(requests, config.speed)
        # Past the replay's end, so only capacity evicts (caches.py on the resolution).
        ttl_s = max(2 * self.arrivals_s[-1], MIN_TTL_S)
        self.caches = Caches(list(self.prefill), num_blocks, ttl_s, shared=False)
        self.store = BlockCache(None, ttl_s)
        self.windows = WindowMap(config.window_ttl_s)
        self.now_s = 0.0
        self._events: list[tuple[float, int, int, Callable[..., None], object]] = []
        self._order = itertools.count()
        self._num_beats = 0
        self._next_tick = 0  # of the heartbeat clock: every heartbeat_s from 0
        self._outcomes: dict[int, Outcome] = {}

    def run(self) -> ReplayResult:
        for request, at_s in zip(self.requests, self.arrivals_s, strict=True):
            self._at(at_s, _ARRIVAL, self._arrive, request)
        while self._events:
            at_s, kind, _, handler, arg = heapq.heappop(self._events)
            self._heartbeat_before(at_s, kind)
            self.now_s = at_s
            handler(arg)
        outcomes = [self._outcomes[r.index] for r in self.requests]
        workers = self.prefill.values()
        end_s = max(p.free_at_s for p in workers)
        utilization = sum(p.busy_s for p in workers) / (len(workers) * end_s) if end_s else 0.0
        return ReplayResult(
            self.policy_name,
            self.config,
            outcomes,
            self.caches.num_blocks_evicted,
            utilization,
            self.store_reads.bytes_read,
            end_s,
        )

    def _at(self, at_s: float, kind: int, handler: Callable[..., None], arg: object) -> None:
        heapq.heappush(self._events, (at_s, kind, next(self._order), handler, arg))

    # -- routing -------------------------------------------------------------------------
    def _facts(self, request: TraceRequest, blocks: RequestBlocks) -> RequestFacts:
        """What the router knows: the store's hit, and each worker's own."""
        now_s = self.now_s
        num_blocks = blocks.num_reusable_blocks(
            self.store.num_hit_blocks(blocks.hashes, now_s, refresh=False)
        )
        local = {}
        for worker_id in self.prefill:
            hit = self.caches.of(worker_id).num_hit_blocks(blocks.hashes, now_s, refresh=False)
            if hit:
                local[worker_id] = blocks.num_reusable_blocks(hit)
        return RequestFacts(
            request_id=str(request.index),
            num_prompt_tokens=request.input_length,
            num_cached_blocks=num_blocks,
            max_tokens=self._num_output(request),
            block_size_tokens=blocks.block_size,
            boundary_block_hash=blocks.boundary_hash(num_blocks),
            model=self.model,
            local_hit_blocks=local,
        )

    def _choose(self, facts: RequestFacts) -> RouteDecision:
        swa_node_ids = self.windows.holders(facts.boundary_block_hash, self.now_s)
        decision = self.policy.choose(facts, self.table, swa_node_ids, self.now_s)
        if isinstance(decision, Rejection):  # admission is off: only a broken setup gets here
            raise RuntimeError(f"request {facts.request_id} refused: {decision.reason}")
        return decision

    def _arrive(self, request: TraceRequest) -> None:
        now_s = self.now_s
        blocks = self.prompts.blocks(request)
        facts = self._facts(request, blocks)
        decision = self._choose(facts)
        if self.policy_name == ORACLE:
            worker_id = self._longest_own_hit(facts)
            has_window = facts.num_cached_blocks > 0 and self.prefill[
                worker_id
            ].node_id in self.windows.holders(facts.boundary_block_hash, now_s)
            decision = msgspec.structs.replace(
                decision, prefill_worker_id=worker_id, has_swa_snapshot=has_window
            )
        for delta in self.policy.inflight_deltas(ROUTER_ID, decision, facts):
            self.table.record_sent(delta, now_s)
        worker_id = decision.prefill_worker_id
        # Read, so refreshed: the worker's own memory and the store.
        self.caches.of(worker_id).num_hit_blocks(blocks.hashes, now_s, refresh=True)
        self.store.num_hit_blocks(blocks.hashes, now_s, refresh=True)
        self._start(
            request,
            blocks,
            self.prefill[worker_id],
            self.decode[decision.decode_worker_id],
            facts,
            facts.num_local_blocks(worker_id),
            decision.has_swa_snapshot,
        )

    def _longest_own_hit(self, facts: RequestFacts) -> str:
        views = self.table.workers(PREFILL, self.now_s, self.model)
        best = max(
            views,
            key=lambda w: (
                facts.local_hit_blocks.get(w.instance_id, 0),
                -w.num_queued_tokens,
                w.instance_id,
            ),
        )
        return best.instance_id

    # -- workers -------------------------------------------------------------------------
    def _start(
        self,
        request: TraceRequest,
        blocks: RequestBlocks,
        prefill: SimPrefill,
        decode: SimDecode,
        facts: RequestFacts,
        num_local_blocks: int,
        has_window: bool,
    ) -> None:
        cost, block = self.config.cost, blocks.block_size
        cached, local = facts.num_cached_blocks * block, num_local_blocks * block
        start_s = max(self.now_s, prefill.free_at_s)
        store_bytes = cost.kv_bytes(cached - local)
        read_s = self.store_reads.read_s(store_bytes, cost.store_load_s(cached - local), start_s)
        self.store_reads.add(store_bytes, start_s)
        replayed = cost.num_replay_tokens(cached, has_window)
        duration_s = cost.prefill_s(request.input_length - cached, 0, replayed, local) + read_s
        num_tokens = round(duration_s * cost.prefill_tokens_per_s)
        end_s = prefill.enqueue(self.now_s, duration_s, num_tokens)
        num_pages = self.policy.pages_needed(facts)
        decode.num_pages_used += num_pages
        job = Job(
            request,
            blocks,
            self.now_s,
            prefill,
            decode,
            facts.num_cached_blocks,
            num_pages,
            num_local_blocks,
        )
        self._at(end_s, _DONE, self._prefill_done, job)

    def _prefill_done(self, job: Job) -> None:
        prefill, decode, blocks = job.prefill, job.decode, job.blocks
        prefill.finish()
        end = blocks.num_prefill_blocks
        new = blocks.hashes[job.num_cached_blocks : end]
        # Its memory holds the whole computed prefix now (the loaded part, the computed).
        self.caches.of(prefill.worker_id).store(
            prefill.worker_id, blocks.hashes[job.num_local_blocks : end], self.now_s
        )
        self.store.store(prefill.worker_id, new, self.now_s)
        if new:
            self.windows.put(blocks.hashes[end - 1], prefill.node_id, self.now_s)
        step_s = self.config.cost.decode_step_s(decode.num_running + 1)
        decode.num_running += 1
        request = job.request
        self._outcomes[request.index] = Outcome(
            request.index,
            request.input_length,
            job.num_cached_blocks * blocks.block_size,
            prefill.worker_id,
            self.now_s + step_s - job.arrival_s,
            job.num_local_blocks * blocks.block_size,
        )
        end_s = self.now_s + self._num_output(request) * step_s
        self._at(end_s, _DONE, self._decode_done, job)

    def _decode_done(self, job: Job) -> None:
        blocks, decode = job.blocks, job.decode
        last = blocks.hashes[blocks.num_prefill_blocks :]
        self.store.store(decode.worker_id, last, self.now_s)
        decode.num_running -= 1
        decode.num_pages_used -= job.num_pages

    def _num_output(self, request: TraceRequest) -> int:
        cap = self.config.max_output_tokens
        return max(min(request.output_length, cap or request.output_length), 1)

    def _heartbeat_before(self, at_s: float, kind: int) -> None:
        """Every worker's heartbeat at the last `heartbeat_s` tick before the event at `at_s`
        (of `kind`), unless already sent. The ticks in between are skipped: nothing happened
        since the previous event, and a heartbeat replaces the one before it in the table
        (and settles the same work in flight), so only the last one can be seen. An idle
        stretch of an hour costs one heartbeat, not 3,600."""
        step_s = self.config.heartbeat_s
        tick = int(at_s // step_s)
        if tick * step_s == at_s and kind < _HEARTBEAT:
            tick -= 1  # work ending at the tick is reported by it, so it comes first
        if tick < self._next_tick:
            return
        self._next_tick = tick + 1
        self.now_s = now_s = tick * step_s
        self._num_beats += 1
        common = {"seq": self._num_beats, "ts_ms": round(now_s * 1000), "model": self.model}
        for p in self.prefill.values():
            queued = p.num_queued_tokens(now_s)
            report = LoadReport(
                service=PREFILL,
                instance_id=p.worker_id,
                node_id=p.node_id,
                num_queued=len(p.jobs),
                num_queued_tokens=queued,
                **common,
            )
            self.table.observe(report, now_s)
        for d in self.decode.values():
            free = DECODE_PAGES - d.num_pages_used
            report = LoadReport(
                service=DECODE,
                instance_id=d.worker_id,
                num_running=d.num_running,
                num_kv_pages_total=DECODE_PAGES,
                num_kv_pages_free=free,
                **common,
            )
            self.table.observe(report, now_s)


def replay(
    requests: Sequence[TraceRequest],
    prompts: PromptHashes,
    config: ReplayConfig,
    policy: str = KV,
) -> ReplayResult:
    return Replay(requests, prompts, config, policy).run()
