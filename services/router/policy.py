"""The router's decision for one request: which prefill worker, which decode worker, or no.

Pure and synchronous. The handler gathers the facts (kv-index match -> hit length; the
memcaches' events -> the nodes holding the boundary block's sliding-window snapshot), calls
`RoutePolicy.choose`, records the in-flight deltas, forwards.

- prefill (placement `kv`, the default): the least estimated time to first token
  (`CostModel.prefill`): the worker's queue + the compute of what it must recompute + the
  load of what its own memory holds (`RequestFacts.local_hit_blocks`) + the read of the rest
  from the shared store at the bandwidth the store has left (`StoreReads`: the reads this
  router sent) + the window's replay unless its node holds the boundary's SWA snapshot. A
  holder whose queue costs more than its hit saves loses to a free worker: that is the
  spill-over that keeps an agent's sessions from piling onto the workers holding them.
  `least-loaded` (fewest queued tokens, ties in turn) and `round-robin` ignore the cache;
  they exist to be measured against (`kvfabric bench trace`), with the same admission.
  A prefill worker with `--queue-policy fair` serves lower queue levels first (the
  request's, `RequestFacts.queue_level`, from its session's work: sessions.py), so a
  request's queue there is the work at or below its level (`queued_tokens_ahead`).
- decode: the least loaded batch among workers with free KV pages for prompt + max_tokens.
- aggregated (vLLM workers, prefill and decode in one): for a model no prefill/decode pair
  serves, the least estimated time to first token among those with free KV pages, under the
  same objective and queue bound as prefill.
- no: OVERLOADED with a retry-after when the best TTFT exceeds the objective (the time until
  the best queue has drained enough) or every prefill queue is full; UNAVAILABLE when no
  worker of a service is serving. Outcomes are values (`Rejection`), never raised.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

from services.router.store_reads import StoreReads
from shared.blocks import RequestBlocks
from shared.load_table import InflightDelta, LoadTable, OrderKey, WorkerView
from shared.schema.errors import (
    BadRequest,
    ErrorCode,
    NotFound,
    Overloaded,
    ServiceError,
    Unavailable,
)
from shared.schema.inference import GenerateRequest, RouteDecision
from shared.subjects import DECODE, PREFILL, VLLM_WORKER
from worker.cost_model import CostModel, PrefillEstimate
from worker.serving.fair_queue import OLDEST_EVERY_PASSES

KV, LEAST_LOADED, ROUND_ROBIN = "kv", "least-loaded", "round-robin"
PLACEMENTS = (KV, LEAST_LOADED, ROUND_ROBIN)


@dataclass(frozen=True)
class RequestFacts:
    request_id: str
    num_prompt_tokens: int
    num_cached_blocks: int  # never the block holding the prompt's last token
    max_tokens: int
    block_size_tokens: int = 64
    boundary_block_hash: int | None = None  # whose SWA snapshot restores the cached prefix
    model: str | None = None  # None: any worker (tests of the policy alone)
    # Per worker, the prefix its own memory holds (blocks, capped as num_cached_blocks is);
    # num_cached_blocks is the shared store's. A worker absent holds none of it. Every block
    # a worker computes is written to the store too, so a local hit is within the store's
    # (the window boundary is the store's).
    local_hit_blocks: Mapping[str, int] = field(default_factory=dict)
    # Its priority class on a fair prefill worker, 0 first (sessions.py): a job waits only
    # for the work queued at or below its level there.
    queue_level: int = 0

    @property
    def num_cached_tokens(self) -> int:
        """The cached prefix in tokens, as the cost model counts work."""
        return self.num_cached_blocks * self.block_size_tokens

    def num_local_blocks(self, worker_id: str) -> int:
        """Of the cached blocks, those in `worker_id`'s own memory."""
        return min(self.local_hit_blocks.get(worker_id, 0), self.num_cached_blocks)

    @classmethod
    def of(
        cls,
        request: GenerateRequest,
        blocks: RequestBlocks,
        num_hit_blocks: int,
        local_hit_blocks: Mapping[str, int] | None = None,
    ) -> RequestFacts:
        """Facts of `request` given kv-index's longest hit (in blocks, over all tiers) and
        each worker's own (in its memory)."""
        num_blocks = blocks.num_reusable_blocks(num_hit_blocks)
        held = local_hit_blocks or {}
        # Once per distinct run, not per worker: a node's workers share theirs (hundreds of
        # workers a request at the reference shape).
        reusable = {n: blocks.num_reusable_blocks(n) for n in set(held.values())}
        local = {w: reusable[n] for w, n in held.items()}
        return cls(
            request_id=request.request_id,
            num_prompt_tokens=blocks.num_prompt_tokens,
            num_cached_blocks=num_blocks,
            max_tokens=request.sampling.max_tokens,
            block_size_tokens=blocks.block_size,
            boundary_block_hash=blocks.boundary_hash(num_blocks),
            model=request.model,
            local_hit_blocks=local,
        )


@dataclass(frozen=True)
class Rejection:
    code: ErrorCode  # OVERLOADED (retry later), UNAVAILABLE (no worker), BAD_REQUEST
    reason: str
    retry_after_s: float | None = None

    def to_error(self) -> ServiceError:
        """The typed exception a handler raises (its code becomes the error headers)."""
        return _ERRORS[self.code](self.reason, retry_after_s=self.retry_after_s)


_ERRORS: dict[ErrorCode, type[ServiceError]] = {
    ErrorCode.OVERLOADED: Overloaded,
    ErrorCode.UNAVAILABLE: Unavailable,
    ErrorCode.BAD_REQUEST: BadRequest,
    ErrorCode.NOT_FOUND: NotFound,
}


@dataclass(frozen=True)
class PolicyConfig:
    # None: never reject on the estimate (queues still bound by max_queued_tokens).
    ttft_objective_s: float | None = 2.0
    # Hard bound per prefill worker: 4 s of compute at the reference 60K tokens/s, twice the
    # default objective, so it bites only when the objective is off or set much higher.
    max_queued_tokens: int = 240_000
    decode_page_size_tokens: int = 64
    # No estimate of when decode pages free up (that depends on output lengths), so a fixed
    # retry-after: about a 256-token answer at ~18 ms a step.
    decode_retry_after_s: float = 5.0
    max_attempts: int = 2  # the first try and one retry on another prefill worker
    prefill_service: str = PREFILL
    decode_service: str = DECODE
    aggregated_service: str = VLLM_WORKER
    placement: str = KV  # kv | least-loaded | round-robin (the module docstring)
    # The shared store's aggregate read bandwidth (None: it never saturates).
    store_read_bytes_per_s: float | None = None

    def __post_init__(self) -> None:
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {', '.join(PLACEMENTS)}")


@dataclass(frozen=True)
class PrefillOption:
    worker: WorkerView
    estimate: PrefillEstimate
    has_swa_snapshot: bool
    num_job_tokens: int
    num_local_blocks: int = 0  # of the cached blocks, those in the worker's own memory

    def key(self) -> tuple[float, int, str]:
        # Rounded to the nanosecond so float noise never decides between equal estimates.
        ttft_s = round(self.estimate.ttft_s, 9)
        return (ttft_s, self.worker.num_inflight_requests, self.worker.instance_id)


@dataclass
class _Turn:
    """Where round-robin and least-loaded's ties go next."""

    next: int = 0

    def take(self) -> int:
        self.next += 1
        return self.next - 1


@dataclass(frozen=True)
class RoutePolicy:
    """Pure but for what a decision changes: the store reads it sends (`store`) and the
    baselines' turn."""

    cost: CostModel = CostModel()
    config: PolicyConfig = PolicyConfig()
    store: StoreReads = field(init=False)
    _turn: _Turn = field(default_factory=_Turn, init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "store", StoreReads(self.config.store_read_bytes_per_s))

    def prefill_options(
        self,
        facts: RequestFacts,
        table: LoadTable,
        swa_node_ids: Collection[str],
        now_s: float,
        exclude: Collection[str] = (),
    ) -> list[PrefillOption]:
        """Every serving prefill worker with its estimate, best first."""
        return self._options(
            self.config.prefill_service, facts, table, swa_node_ids, now_s, exclude
        )

    def _options(
        self,
        service: str,
        facts: RequestFacts,
        table: LoadTable,
        swa_node_ids: Collection[str],
        now_s: float,
        exclude: Collection[str] = (),
    ) -> list[PrefillOption]:
        workers = [
            w for w in table.workers(service, now_s, facts.model) if w.instance_id not in exclude
        ]
        return self._estimates(workers, facts, swa_node_ids, now_s)

    def _estimates(
        self,
        workers: Sequence[WorkerView],
        facts: RequestFacts,
        swa_node_ids: Collection[str],
        now_s: float,
    ) -> list[PrefillOption]:
        """Each worker's option, best first."""
        options = []
        block, cached = facts.block_size_tokens, facts.num_cached_tokens
        for worker in workers:
            num_local = facts.num_local_blocks(worker.instance_id)
            local = num_local * block
            has_swa = cached > 0 and worker.node_id in swa_node_ids
            store_bytes = self.cost.kv_bytes(cached - local)
            floor_s = self.cost.store_load_s(cached - local)
            estimate = self.cost.prefill(
                num_queued_tokens=queued_tokens_ahead(worker, facts.queue_level),
                num_prompt_tokens=facts.num_prompt_tokens,
                num_cached_tokens=cached,
                has_swa_snapshot=has_swa,
                num_local_tokens=local,
                store_load_s=self.store.read_s(store_bytes, floor_s, now_s),
            )
            job_tokens = self.job_tokens(facts, cached, has_swa, estimate)
            options.append(PrefillOption(worker, estimate, has_swa, job_tokens, num_local))
        return sorted(options, key=PrefillOption.key)

    def job_tokens(
        self, facts: RequestFacts, num_cached_tokens: int, has_swa: bool, estimate: PrefillEstimate
    ) -> int:
        """What a job adds to its worker's queue: compute, replay and its loads, in
        compute-token equivalents (a worker loads a job's prefix before computing it)."""
        load_s = estimate.load_s + estimate.local_load_s
        return self.cost.queue_tokens_of(
            facts.num_prompt_tokens, num_cached_tokens, has_swa, load_s=load_s
        )

    def work_tokens(self, facts: RequestFacts) -> int:
        """A request's prefill work before a worker is chosen, what its session is charged
        (sessions.py): `job_tokens` with the whole hit read from the store."""
        cached = facts.num_cached_tokens
        load_s = self.cost.store_load_s(cached)
        return self.cost.queue_tokens_of(facts.num_prompt_tokens, cached, False, load_s=load_s)

    def unserved_model(self, model: str, table: LoadTable, now_s: float) -> Rejection | None:
        """NOT_FOUND naming the served models when no worker serves `model` but some serve
        others (a caller's mistake); None when it is served, or when nothing is (that is
        UNAVAILABLE, for `choose` to say)."""
        served = sorted(
            set(table.models(self.config.prefill_service, now_s))
            & set(table.models(self.config.decode_service, now_s))
            | set(table.models(self.config.aggregated_service, now_s))
        )
        if not served or model in served:
            return None
        return Rejection(
            ErrorCode.NOT_FOUND, f"model {model!r} is not served here; served: {', '.join(served)}"
        )

    def choose(
        self, facts: RequestFacts, table: LoadTable, swa_node_ids: Collection[str], now_s: float
    ) -> RouteDecision | Rejection:
        if self._is_aggregated(facts, table, now_s):
            return self._choose_aggregated(facts, table, now_s)
        prefill = self._choose_prefill(facts, table, swa_node_ids, now_s, (), check_slo=True)
        if isinstance(prefill, Rejection):
            return prefill
        decode = self._choose_decode(facts, table, now_s)
        if isinstance(decode, Rejection):
            return decode
        return self._decision(facts, prefill, decode.instance_id, now_s)

    def retry_target(
        self,
        previous: RouteDecision,
        facts: RequestFacts,
        table: LoadTable,
        swa_node_ids: Collection[str],
        now_s: float,
        attempt: int,
        *,
        restarted: bool = False,
    ) -> RouteDecision | Rejection:
        """Another prefill worker for a job whose worker died before streaming a token.

        `attempt` is the failed job's (0 for the first). The request was already admitted, so
        the TTFT objective is not applied again; full queues still are. `restarted`: a new
        process heartbeats under the failed worker's id, and may take it.
        """
        if attempt + 1 >= self.config.max_attempts:
            return Rejection(
                ErrorCode.UNAVAILABLE,
                f"prefill worker {previous.prefill_worker_id} failed on attempt {attempt + 1} "
                f"of {self.config.max_attempts}",
            )
        exclude = () if restarted else (previous.prefill_worker_id,)
        prefill = self._choose_prefill(facts, table, swa_node_ids, now_s, exclude, check_slo=False)
        if isinstance(prefill, Rejection):
            return prefill
        decode_id = previous.decode_worker_id
        if table.serving_view(decode_id, self.config.decode_service, now_s, facts.model) is None:
            decode = self._choose_decode(facts, table, now_s)
            if isinstance(decode, Rejection):
                return decode
            decode_id = decode.instance_id
        return self._decision(facts, prefill, decode_id, now_s)

    def inflight_deltas(
        self, router_id: str, decision: RouteDecision, facts: RequestFacts
    ) -> tuple[InflightDelta, InflightDelta]:
        """What to `record_sent` (and announce to peers) once `decision` is taken: its
        compute, replay and loads (the store's at its idle rate) on the prefill worker."""
        cached = facts.num_cached_tokens
        local = facts.num_local_blocks(decision.prefill_worker_id) * facts.block_size_tokens
        load_s = self.cost.local_load_s(local) + self.cost.store_load_s(cached - local)
        job_tokens = self.cost.queue_tokens_of(
            facts.num_prompt_tokens, cached, decision.has_swa_snapshot, load_s=load_s
        )
        return (
            InflightDelta(
                router_id,
                decision.prefill_worker_id,
                num_tokens=job_tokens,
                queue_level=facts.queue_level,
            ),
            InflightDelta(
                router_id, decision.decode_worker_id, num_kv_pages=self.pages_needed(facts)
            ),
        )

    def pages_needed(self, facts: RequestFacts) -> int:
        num_tokens = facts.num_prompt_tokens + facts.max_tokens
        return math.ceil(num_tokens / self.config.decode_page_size_tokens)

    def _is_aggregated(self, facts: RequestFacts, table: LoadTable, now_s: float) -> bool:
        """The model is served by aggregated workers and by no prefill worker."""
        config = self.config
        return table.has_workers(config.aggregated_service, now_s, facts.model) and not (
            table.has_workers(config.prefill_service, now_s, facts.model)
        )

    def _choose_aggregated(
        self, facts: RequestFacts, table: LoadTable, now_s: float
    ) -> RouteDecision | Rejection:
        """One worker for both: free pages as for decode, then the best TTFT as for prefill
        (no sliding-window snapshots: vLLM keeps a request's whole KV itself)."""
        options = self._options(self.config.aggregated_service, facts, table, (), now_s)
        needed = self.pages_needed(facts)
        if needed > max(o.worker.num_kv_pages_total for o in options):
            return Rejection(
                ErrorCode.BAD_REQUEST,
                f"prompt + max_tokens needs {needed} KV pages, more than any worker has",
            )
        fits = [o for o in options if o.worker.num_kv_pages_free >= needed]
        if not fits:
            return Rejection(
                ErrorCode.OVERLOADED,
                f"no worker has {needed} free KV pages",
                retry_after_s=self.config.decode_retry_after_s,
            )
        chosen = self._admit(fits, check_slo=True)
        if isinstance(chosen, Rejection):
            return chosen
        return self._decision(facts, chosen, chosen.worker.instance_id, now_s, aggregated=True)

    def _choose_prefill(
        self,
        facts: RequestFacts,
        table: LoadTable,
        swa_node_ids: Collection[str],
        now_s: float,
        exclude: Sequence[str],
        *,
        check_slo: bool,
    ) -> PrefillOption | Rejection:
        if self.config.placement == KV:
            options, count = self._kv_options(facts, table, swa_node_ids, now_s, exclude)
        else:
            workers = [
                w
                for w in table.workers(self.config.prefill_service, now_s, facts.model)
                if w.instance_id not in exclude
            ]
            options = self._estimates(workers, facts, swa_node_ids, now_s)
            count = None
        if not options:
            return Rejection(ErrorCode.UNAVAILABLE, f"no prefill worker is serving{_of(facts)}")
        return self._admit(options, check_slo=check_slo, count=count)

    def _kv_options(
        self,
        facts: RequestFacts,
        table: LoadTable,
        swa_node_ids: Collection[str],
        now_s: float,
        exclude: Collection[str],
    ) -> tuple[list[PrefillOption], Callable[[], int]]:
        """The options kv's pick is among, best first, and a count of the candidates they
        stand for (for a refusal's message).

        The candidates: every worker holding some of the prefix in its own memory or on a
        node with the window, and of the rest -- whose estimates, job tokens and room differ
        by their queues alone -- the first by (the tokens a job of the request's level waits
        for there, requests in flight, id), the order `PrefillOption.key` breaks their ties
        in. Holders with a first-come-first-served queue, the same blocks in memory and the
        same window differ by their queues alone too, so of each such kind only the first in
        that order is estimated: it has the best estimate of its kind, room if any has (room
        only shrinks as the queue grows) and the least wait. The pick, the room check and the
        objective's come out as over every candidate, and a decision costs O(holders) dict
        lookups, not O(workers) views and estimates (hundreds of holders and 1,200 workers
        at the reference shape). Fair workers (rare) are each estimated, as their queue
        depends on the request's level."""
        service, model = self.config.prefill_service, facts.model
        local_hits, level = facts.local_hit_blocks, facts.queue_level
        cached_blocks, has_hit = facts.num_cached_blocks, facts.num_cached_tokens > 0
        window = [
            worker
            for worker in table.serving_on_nodes(swa_node_ids, service, now_s, model)
            if worker.instance_id not in exclude
        ]
        # Distinct queues must give distinct rounded estimates (`PrefillOption.key`) for a
        # kind's first to be its best: a queued token is ~17 us at the reference rate.
        by_kind = self.cost.queue_wait_s(1) > 1e-8
        workers: list[WorkerView] = []  # estimated
        firsts: dict[tuple[int, bool], WorkerView] = {}  # of each kind, the first so far
        for worker in window:
            if worker.reported_tokens_by_level or not by_kind:
                workers.append(worker)
            else:
                num_local = min(local_hits.get(worker.instance_id, 0), cached_blocks)
                _keep_first(firsts, (num_local, has_hit), worker)
        # The other holders with a first-come-first-served queue: the first of each run
        # they hold (a node's workers share one), found by the table.
        skip = {*exclude, *(worker.instance_id for worker in window)}
        if by_kind:
            firsts_by_run = table.firsts(service, now_s, model, _fcfs_order, local_hits, skip)
            for num_local, worker in firsts_by_run.items():
                _keep_first(firsts, (min(num_local, cached_blocks), False), worker)
        else:
            others = table.serving_among(local_hits, service, now_s, model)
            workers += [w for w in others if w.instance_id not in skip and _fcfs_order(w)]
        workers += firsts.values()
        # The rest's best: the first non-holder of both orders; every fair holder.
        plain: WorkerView | None = None
        plain_key: tuple[int, int, str] | None = None
        for order in (_fcfs_order, _fair_order(level)):
            fair = order is not _fcfs_order
            for worker in table.ordered(service, now_s, model, order):
                instance_id = worker.instance_id
                if instance_id in skip or worker.node_id in swa_node_ids:
                    continue
                if instance_id in local_hits:
                    if fair:
                        workers.append(worker)
                    continue
                key = (
                    queued_tokens_ahead(worker, level),
                    worker.num_inflight_requests,
                    instance_id,
                )
                if plain_key is None or key < plain_key:
                    plain, plain_key = worker, key
                if not fair:
                    break  # the fair ones' holders are all wanted: that walk goes on
        if plain is not None:
            workers.append(plain)

        def count() -> int:
            holders = {w.instance_id for w in window}
            holders.update(
                worker.instance_id
                for worker in table.serving_among(local_hits, service, now_s, model)
                if worker.instance_id not in exclude
            )
            return len(holders) + (plain is not None)

        return self._estimates(workers, facts, swa_node_ids, now_s), count

    def _admit(
        self,
        options: list[PrefillOption],
        *,
        check_slo: bool,
        count: Callable[[], int] | None = None,
    ) -> PrefillOption | Rejection:
        """The best option with room in its queue, within the objective when checked.
        `count`: of the workers the options stand for (None: the options)."""
        limit = self.config.max_queued_tokens
        # A worker with an empty queue always has room, or a prompt over the limit never runs.
        room = [
            o
            for o in options
            if o.worker.num_queued_tokens == 0
            or o.worker.num_queued_tokens + o.num_job_tokens <= limit
        ]
        if not room:
            over = min(o.worker.num_queued_tokens + o.num_job_tokens - limit for o in options)
            return Rejection(
                ErrorCode.OVERLOADED,
                f"every prefill queue is full ({len(options) if count is None else count()} "
                f"workers, limit {limit} tokens)",
                retry_after_s=self.cost.queue_wait_s(over),
            )
        objective = self.config.ttft_objective_s
        if check_slo and objective is not None:
            # Waiting helps only by draining a queue: a request whose own prefill exceeds the
            # objective is admitted once some worker's queue is empty.
            wait_s = min(min(o.estimate.ttft_s - objective, o.estimate.queue_wait_s) for o in room)
            if wait_s > 0:
                return Rejection(
                    ErrorCode.OVERLOADED,
                    f"estimated time to first token {room[0].estimate.ttft_s:.3f} s exceeds "
                    f"the objective {objective} s",
                    retry_after_s=wait_s,
                )
        return self._place(room)

    def _place(self, room: list[PrefillOption]) -> PrefillOption:
        """Among the options with room (best estimate first), the placement's pick."""
        placement = self.config.placement
        if placement == KV:
            return room[0]
        by_id = sorted(room, key=lambda o: o.worker.instance_id)
        start = self._turn.take() % len(by_id)
        turn = by_id[start:] + by_id[:start]
        if placement == ROUND_ROBIN:
            return turn[0]
        return min(turn, key=lambda o: o.worker.num_queued_tokens)  # first in turn on ties

    def _choose_decode(
        self, facts: RequestFacts, table: LoadTable, now_s: float
    ) -> WorkerView | Rejection:
        service, model = self.config.decode_service, facts.model
        largest = next(table.ordered(service, now_s, model, _most_pages), None)
        if largest is None:
            return Rejection(ErrorCode.UNAVAILABLE, f"no decode worker is serving{_of(facts)}")
        needed = self.pages_needed(facts)
        if needed > largest.num_kv_pages_total:
            return Rejection(
                ErrorCode.BAD_REQUEST,
                f"prompt + max_tokens needs {needed} KV pages, more than any decode worker has",
            )
        # The first with the pages in `_decode_order`: the smallest batch (its step is the
        # shortest, `CostModel.decode_step_s`), then the most free pages (room for the output
        # to grow), then the id.
        for worker in table.ordered(service, now_s, model, _decode_order):
            if worker.num_kv_pages_free >= needed:
                return worker
        return Rejection(
            ErrorCode.OVERLOADED,
            f"no decode worker has {needed} free KV pages",
            retry_after_s=self.config.decode_retry_after_s,
        )

    def _decision(
        self,
        facts: RequestFacts,
        prefill: PrefillOption,
        decode_id: str,
        now_s: float,
        *,
        aggregated: bool = False,
    ) -> RouteDecision:
        """The decision, its store read counted against the store's bandwidth."""
        num_store_blocks = facts.num_cached_blocks - prefill.num_local_blocks
        self.store.add(self.cost.kv_bytes(num_store_blocks * facts.block_size_tokens), now_s)
        return RouteDecision(
            request_id=facts.request_id,
            prefill_worker_id=prefill.worker.instance_id,
            decode_worker_id=decode_id,
            num_prompt_tokens=facts.num_prompt_tokens,
            num_cached_blocks=facts.num_cached_blocks,
            block_size_tokens=facts.block_size_tokens,
            has_swa_snapshot=prefill.has_swa_snapshot,
            estimated_ttft_ms=prefill.estimate.ttft_s * 1000.0,
            aggregated=aggregated,
        )


# The orders the table keeps for the policy (`LoadTable.ordered`), each one function so that
# each is kept once.
def _fcfs_order(worker: WorkerView) -> tuple[int, int, str] | None:
    """First-come-first-served prefill workers by the queue a new job waits for there."""
    return None if worker.reported_tokens_by_level else _queue_key(worker)


_FAIR_ORDERS: dict[int, OrderKey] = {}


def _fair_order(level: int) -> OrderKey:
    """Fair prefill workers by the queue a new job of `level` waits for there (one order per
    level: the sessions' thresholds make a handful, worker/serving/fair_queue.py)."""
    order = _FAIR_ORDERS.get(level)
    if order is None:

        def order(worker: WorkerView) -> tuple[int, int, str] | None:
            if not worker.reported_tokens_by_level:
                return None
            queued = queued_tokens_ahead(worker, level)
            return (queued, worker.num_inflight_requests, worker.instance_id)

        _FAIR_ORDERS[level] = order
    return order


def _keep_first(
    firsts: dict[tuple[int, bool], WorkerView], kind: tuple[int, bool], worker: WorkerView
) -> None:
    """`worker` as its kind's first if it comes before the one kept (first-come-first-served
    queues: `_fcfs_order`)."""
    first = firsts.get(kind)
    if first is None or _queue_key(worker) < _queue_key(first):
        firsts[kind] = worker


def _queue_key(worker: WorkerView) -> tuple[int, int, str]:
    return (worker.num_queued_tokens, worker.num_inflight_requests, worker.instance_id)


def _most_pages(worker: WorkerView) -> tuple[int, str]:
    return (-worker.num_kv_pages_total, worker.instance_id)


def _decode_order(worker: WorkerView) -> tuple[int, int, str]:
    return (worker.num_batch_seqs, -worker.num_kv_pages_free, worker.instance_id)


def queued_tokens_ahead(worker: WorkerView, level: int) -> int:
    """The queued tokens a new job of `level` waits for on `worker`: all of them when it
    serves first come, first served; on a fair one (it reports its queue by level) those at
    or below the job's level, plus what the oldest job's share of the passes takes from them
    (worker/serving/fair_queue.py), at most the work queued above the level."""
    if not worker.reported_tokens_by_level:
        return worker.num_queued_tokens
    ahead = worker.num_queued_tokens_at_or_below(level)
    above = max(worker.num_queued_tokens - ahead, 0)
    return ahead + min(above, ahead // (OLDEST_EVERY_PASSES - 1))


def _of(facts: RequestFacts) -> str:
    return f" model {facts.model!r}" if facts.model is not None else ""
