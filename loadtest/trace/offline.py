"""The trace replayed without NATS through the router's real `RoutePolicy` and `LoadTable`
and kv-index's real `KvIndex`, on a simulated clock.

Per request, at its (time-scaled) arrival: the router's facts (`RequestFacts`: the longest
hit any cache holds, capped by `RequestBlocks` at the blocks a job may reuse; the nodes
holding that boundary's window), then the prefill worker from `RoutePolicy.choose` (ours),
from a baseline that ignores the cache (policies.py), or from RoutePolicy's estimate given
each worker's own hit (`ours-per-worker-hit`, what the router could do if its facts were per
worker); the decode worker is always `choose`'s, and the in-flight deltas are recorded as
the router records them. The chosen worker's own cache gives the hit it really gets
(refreshed, as a read is).

Workers follow the cost model the router estimates with (`worker.cost_model`), as the mock
engine does: a prefill worker runs its jobs first come, first served, each taking compute
of the uncached tokens + load of the cached ones + a bounded replay without the window;
when one ends, its new blocks go to its cache as a BlocksStored batch and its window to its
node's memcache, and decode starts (`output_length` steps at the batch's step time). At the
end decode writes the prompt's last complete block (the one holding its last token) into
the same cache, as the real decode worker writes it to the store; answer blocks are not
stored (synthetic prompts never contain them). Each worker reports its load (`LoadReport`)
every `heartbeat_s`.

Admission is off (no TTFT objective, no queue bound, decode pages without limit), so every
policy serves every request and the hit rates compare placement alone.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import msgspec

from loadtest.trace.caches import Caches, WindowMap
from loadtest.trace.policies import BASELINES, OURS, OURS_PER_WORKER, POLICY_NAMES, baseline
from loadtest.trace.synth import PromptHashes, TraceRequest, arrivals_s
from loadtest.trace.workers import Job, SimDecode, SimPrefill
from services.router.policy import PolicyConfig, Rejection, RequestFacts, RoutePolicy
from shared.blocks import RequestBlocks
from shared.load_table import LoadTable
from shared.schema import LoadReport, RouteDecision
from shared.subjects import DECODE, PREFILL
from worker.cost_model import CostModel

ROUTER_ID = "router-offline"
DECODE_PAGES = 1 << 40  # per decode worker: none ever waits for pages here
MIN_TTL_S = 600.0
# Event order at one instant: work ends, then heartbeats report it, then arrivals see it.
_DONE, _HEARTBEAT, _ARRIVAL = 0, 1, 2


@dataclass(frozen=True)
class ReplayConfig:
    num_workers: int = 8  # prefill workers (each on a node of its own), and as many decode
    capacity_tokens: int | None = None  # each cache's (None: unlimited)
    shared_cache: bool = False  # one store all workers read, instead of a cache per worker
    speed: float = 1.0  # the trace replayed at this many times its rate
    cost: CostModel = field(default_factory=CostModel)
    heartbeat_s: float = 1.0
    max_output_tokens: int | None = None  # cap on each request's decode (None: the trace's)
    window_ttl_s: float = 180.0
    seed: int = 0  # of the random baseline

    def __post_init__(self) -> None:
        if self.num_workers <= 0:
            raise ValueError(f"num_workers must be > 0, got {self.num_workers}")
        if self.capacity_tokens is not None and self.capacity_tokens <= 0:
            raise ValueError(f"capacity_tokens must be > 0, got {self.capacity_tokens}")
        if not self.speed > 0 or not self.heartbeat_s > 0:
            raise ValueError("speed and heartbeat_s must be > 0")
        if self.max_output_tokens is not None and self.max_output_tokens <= 0:
            raise ValueError(f"max_output_tokens must be > 0, got {self.max_output_tokens}")


@dataclass(frozen=True)
class Outcome:
    index: int  # the request's position in the trace
    num_prompt_tokens: int
    num_cached_tokens: int
    prefill_worker_id: str
    ttft_s: float  # arrival -> the first decode step's end, on the simulated clock


@dataclass
class ReplayResult:
    policy: str
    config: ReplayConfig
    outcomes: list[Outcome]  # in trace order
    num_blocks_evicted: int
    utilization: float  # of the prefill workers: busy time over theirs from 0 to the last end

    @property
    def hit_rate(self) -> float:
        """Cached prompt tokens over all prompt tokens."""
        total = sum(o.num_prompt_tokens for o in self.outcomes)
        return sum(o.num_cached_tokens for o in self.outcomes) / total

    def ttft_s(self, quantile: float) -> float:
        ordered = sorted(o.ttft_s for o in self.outcomes)
        return ordered[min(len(ordered) - 1, int(quantile * len(ordered)))]


class Replay:
    """One replay of `requests` under one policy and config; `run` once."""

    def __init__(
        self,
        requests: Sequence[TraceRequest],
        prompts: PromptHashes,
        config: ReplayConfig,
        policy: str = OURS,
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
            ),
        )
        self.baseline = baseline(policy, config.seed) if policy in BASELINES else None
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
        self.caches = Caches(list(self.prefill), num_blocks, ttl_s, shared=config.shared_cache)
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
            self.policy_name, self.config, outcomes, self.caches.num_blocks_evicted, utilization
        )

    def _at(self, at_s: float, kind: int, handler: Callable[..., None], arg: object) -> None:
        heapq.heappush(self._events, (at_s, kind, next(self._order), handler, arg))

    # -- routing -------------------------------------------------------------------------
    def _facts(self, request: TraceRequest, blocks: RequestBlocks, num_hit: int) -> RequestFacts:
        num_blocks = blocks.num_reusable_blocks(num_hit)
        return RequestFacts(
            request_id=str(request.index),
            num_prompt_tokens=request.input_length,
            num_cached_blocks=num_blocks,
            max_tokens=self._num_output(request),
            block_size_tokens=blocks.block_size,
            boundary_block_hash=blocks.boundary_hash(num_blocks),
            model=self.model,
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
        if self.policy_name == OURS:
            best = self.caches.best_hit_blocks(blocks.hashes, now_s)
            facts = self._facts(request, blocks, best)
            decision = self._choose(facts)
            worker_id = decision.prefill_worker_id
        elif self.policy_name == OURS_PER_WORKER:
            worker_id = self._least_ttft_by_own_hit(request, blocks)
        else:
            worker_id = self.baseline.pick(self.table.workers(PREFILL, now_s, self.model))
        num_hit = self.caches.of(worker_id).num_hit_blocks(blocks.hashes, now_s, refresh=True)
        own = self._facts(request, blocks, num_hit)
        prefill = self.prefill[worker_id]
        has_window = own.num_cached_tokens > 0 and prefill.node_id in self.windows.holders(
            own.boundary_block_hash, now_s
        )
        if self.policy_name != OURS:  # the router's decode choice, the placement's prefill
            facts = own
            decision = msgspec.structs.replace(
                self._choose(own), prefill_worker_id=worker_id, has_swa_snapshot=has_window
            )
        for delta in self.policy.inflight_deltas(ROUTER_ID, decision, facts):
            self.table.record_sent(delta, now_s)
        self._start(
            request, blocks, prefill, self.decode[decision.decode_worker_id], own, has_window
        )

    def _least_ttft_by_own_hit(self, request: TraceRequest, blocks: RequestBlocks) -> str:
        """RoutePolicy's estimate for each worker with that worker's own hit (its
        `prefill_options` for one worker at a time), the least estimated TTFT first."""
        options = []
        for worker_id in self.prefill:
            cache = self.caches.of(worker_id)
            hit = cache.num_hit_blocks(blocks.hashes, self.now_s, refresh=False)
            facts = self._facts(request, blocks, hit)
            holders = self.windows.holders(facts.boundary_block_hash, self.now_s)
            others = [w for w in self.prefill if w != worker_id]
            options += self.policy.prefill_options(facts, self.table, holders, self.now_s, others)
        return min(options, key=lambda o: o.key()).worker.instance_id

    # -- workers -------------------------------------------------------------------------
    def _start(
        self,
        request: TraceRequest,
        blocks: RequestBlocks,
        prefill: SimPrefill,
        decode: SimDecode,
        facts: RequestFacts,
        has_window: bool,
    ) -> None:
        cost, cached = self.config.cost, facts.num_cached_tokens
        replayed = cost.num_replay_tokens(cached, has_window)
        duration_s = cost.prefill_s(request.input_length - cached, cached, replayed)
        num_tokens = cost.queue_tokens_of(request.input_length, cached, has_window)
        end_s = prefill.enqueue(self.now_s, duration_s, num_tokens)
        num_pages = self.policy.pages_needed(facts)
        decode.num_pages_used += num_pages
        job = Job(
            request, blocks, self.now_s, prefill, decode, cached // blocks.block_size, num_pages
        )
        self._at(end_s, _DONE, self._prefill_done, job)

    def _prefill_done(self, job: Job) -> None:
        prefill, decode, blocks = job.prefill, job.decode, job.blocks
        prefill.finish()
        end = blocks.num_prefill_blocks
        new = blocks.hashes[job.num_cached_blocks : end]
        self.caches.of(prefill.worker_id).store(prefill.worker_id, new, self.now_s)
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
        )
        end_s = self.now_s + self._num_output(request) * step_s
        self._at(end_s, _DONE, self._decode_done, job)

    def _decode_done(self, job: Job) -> None:
        blocks, decode = job.blocks, job.decode
        last = blocks.hashes[blocks.num_prefill_blocks :]
        self.caches.of(job.prefill.worker_id).store(decode.worker_id, last, self.now_s)
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
    policy: str = OURS,
) -> ReplayResult:
    return Replay(requests, prompts, config, policy).run()
