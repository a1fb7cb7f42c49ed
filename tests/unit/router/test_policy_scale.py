"""The policy at scale: over a table of hundreds of workers, driven through every kind of
change a table sees, `RoutePolicy.choose` and `retry_target` answer exactly what the plain
algorithm answers: every serving worker listed, kv's candidates estimated one by one, sorted,
admitted, the decode worker the minimum over all. The policy keeps orderings in the table
and estimates one candidate per kind instead (services/router/policy.py, `_kv_options`);
the plain algorithm is kept here, as it was, to check it against.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import msgspec
import pytest

from services.router.policy import (
    KV,
    PolicyConfig,
    Rejection,
    RequestFacts,
    RoutePolicy,
    queued_tokens_ahead,
)
from shared.load_table import InflightDelta, LoadTable, WorkerView
from shared.schema.control import InstanceState, LoadReport
from shared.schema.errors import ErrorCode
from shared.schema.inference import RouteDecision
from shared.subjects import DECODE, PREFILL, VLLM_WORKER
from worker.cost_model import CostModel, PrefillEstimate

BLOCK = 64
# m0 and m1: prefill + decode; m2: aggregated workers only; m3: nobody at first.
MODELS = ("m0", "m1")
REQUEST_MODELS = ("m0", "m0", "m1", "m2", "m3", None)
ROUTER = "r1"


# -- the plain algorithm ------------------------------------------------------------------------
@dataclass(frozen=True)
class Option:
    worker: WorkerView
    estimate: PrefillEstimate
    has_swa: bool
    job_tokens: int
    num_local: int

    def key(self) -> tuple[float, int, str]:
        return (
            round(self.estimate.ttft_s, 9),
            self.worker.num_inflight_requests,
            self.worker.instance_id,
        )


def serving(
    table: LoadTable, ids: Collection[str], service: str, now_s: float, model: str | None
) -> list[WorkerView]:
    """What `LoadTable.workers` lists, from each instance's own view."""
    views = [table.view(i, now_s) for i in sorted(ids)]
    return [
        v
        for v in views
        if v is not None
        and v.service == service
        and (model is None or v.model == model)
        and v.state == InstanceState.SERVING
    ]


def estimates(
    policy: RoutePolicy,
    workers: Sequence[WorkerView],
    facts: RequestFacts,
    swa: Collection[str],
    now_s: float,
) -> list[Option]:
    cost, options = policy.cost, []
    cached = facts.num_cached_tokens
    for worker in workers:
        num_local = min(facts.local_hit_blocks.get(worker.instance_id, 0), facts.num_cached_blocks)
        local = num_local * facts.block_size_tokens
        has_swa = cached > 0 and worker.node_id in swa
        estimate = cost.prefill(
            num_queued_tokens=queued_tokens_ahead(worker, facts.queue_level),
            num_prompt_tokens=facts.num_prompt_tokens,
            num_cached_tokens=cached,
            has_swa_snapshot=has_swa,
            num_local_tokens=local,
            store_load_s=policy.store.read_s(
                cost.kv_bytes(cached - local), cost.store_load_s(cached - local), now_s
            ),
        )
        job_tokens = cost.queue_tokens_of(
            facts.num_prompt_tokens,
            cached,
            has_swa,
            load_s=estimate.load_s + estimate.local_load_s,
        )
        options.append(Option(worker, estimate, has_swa, job_tokens, num_local))
    return sorted(options, key=Option.key)


def kv_candidates(
    workers: Sequence[WorkerView], facts: RequestFacts, swa: Collection[str]
) -> list[WorkerView]:
    """Every worker holding blocks or on a node with the window, and the first of the rest."""
    special = [w for w in workers if w.instance_id in facts.local_hit_blocks or w.node_id in swa]
    special_ids = {w.instance_id for w in special}
    rest = [w for w in workers if w.instance_id not in special_ids]
    if not rest:
        return special
    level = facts.queue_level
    return [
        *special,
        min(
            rest,
            key=lambda w: (queued_tokens_ahead(w, level), w.num_inflight_requests, w.instance_id),
        ),
    ]


def admit(policy: RoutePolicy, options: list[Option], check_slo: bool) -> Option | Rejection:
    limit = policy.config.max_queued_tokens
    room = [
        o
        for o in options
        if o.worker.num_queued_tokens == 0 or o.worker.num_queued_tokens + o.job_tokens <= limit
    ]
    if not room:
        over = min(o.worker.num_queued_tokens + o.job_tokens - limit for o in options)
        return Rejection(
            ErrorCode.OVERLOADED,
            f"every prefill queue is full ({len(options)} workers, limit {limit} tokens)",
            retry_after_s=policy.cost.queue_wait_s(over),
        )
    objective = policy.config.ttft_objective_s
    if check_slo and objective is not None:
        wait_s = min(min(o.estimate.ttft_s - objective, o.estimate.queue_wait_s) for o in room)
        if wait_s > 0:
            return Rejection(
                ErrorCode.OVERLOADED,
                f"estimated time to first token {room[0].estimate.ttft_s:.3f} s exceeds "
                f"the objective {objective} s",
                retry_after_s=wait_s,
            )
    return room[0]


def decision(
    policy: RoutePolicy,
    facts: RequestFacts,
    option: Option,
    decode_id: str,
    now_s: float,
    aggregated: bool = False,
) -> RouteDecision:
    store_blocks = facts.num_cached_blocks - option.num_local
    policy.store.add(policy.cost.kv_bytes(store_blocks * facts.block_size_tokens), now_s)
    return RouteDecision(
        request_id=facts.request_id,
        prefill_worker_id=option.worker.instance_id,
        decode_worker_id=decode_id,
        num_prompt_tokens=facts.num_prompt_tokens,
        num_cached_blocks=facts.num_cached_blocks,
        block_size_tokens=facts.block_size_tokens,
        has_swa_snapshot=option.has_swa,
        estimated_ttft_ms=option.estimate.ttft_s * 1000.0,
        aggregated=aggregated,
    )


def choose_prefill(
    policy: RoutePolicy,
    facts: RequestFacts,
    workers: list[WorkerView],
    swa: Collection[str],
    now_s: float,
    exclude: Collection[str],
    check_slo: bool,
) -> Option | Rejection:
    workers = [w for w in workers if w.instance_id not in exclude]
    if not workers:
        model = f" model {facts.model!r}" if facts.model is not None else ""
        return Rejection(ErrorCode.UNAVAILABLE, f"no prefill worker is serving{model}")
    candidates = kv_candidates(workers, facts, swa)
    return admit(policy, estimates(policy, candidates, facts, swa, now_s), check_slo)


def choose_decode(
    policy: RoutePolicy, facts: RequestFacts, decoders: list[WorkerView]
) -> WorkerView | Rejection:
    if not decoders:
        model = f" model {facts.model!r}" if facts.model is not None else ""
        return Rejection(ErrorCode.UNAVAILABLE, f"no decode worker is serving{model}")
    needed = policy.pages_needed(facts)
    if needed > max(w.num_kv_pages_total for w in decoders):
        return Rejection(
            ErrorCode.BAD_REQUEST,
            f"prompt + max_tokens needs {needed} KV pages, more than any decode worker has",
        )
    fits = [w for w in decoders if w.num_kv_pages_free >= needed]
    if not fits:
        return Rejection(
            ErrorCode.OVERLOADED,
            f"no decode worker has {needed} free KV pages",
            retry_after_s=policy.config.decode_retry_after_s,
        )
    return min(fits, key=lambda w: (w.num_batch_seqs, -w.num_kv_pages_free, w.instance_id))


def plain_choose(
    policy: RoutePolicy,
    facts: RequestFacts,
    table: LoadTable,
    ids: Collection[str],
    swa: Collection[str],
    now_s: float,
) -> RouteDecision | Rejection:
    prefill = serving(table, ids, PREFILL, now_s, facts.model)
    aggregated = serving(table, ids, VLLM_WORKER, now_s, facts.model)
    if aggregated and not prefill:
        options = estimates(policy, aggregated, facts, (), now_s)
        needed = policy.pages_needed(facts)
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
                retry_after_s=policy.config.decode_retry_after_s,
            )
        chosen = admit(policy, fits, check_slo=True)
        if isinstance(chosen, Rejection):
            return chosen
        worker_id = chosen.worker.instance_id
        return decision(policy, facts, chosen, worker_id, now_s, aggregated=True)
    option = choose_prefill(policy, facts, prefill, swa, now_s, (), check_slo=True)
    if isinstance(option, Rejection):
        return option
    decode = choose_decode(policy, facts, serving(table, ids, DECODE, now_s, facts.model))
    if isinstance(decode, Rejection):
        return decode
    return decision(policy, facts, option, decode.instance_id, now_s)


def plain_retry(
    policy: RoutePolicy,
    previous: RouteDecision,
    facts: RequestFacts,
    table: LoadTable,
    ids: Collection[str],
    swa: Collection[str],
    now_s: float,
    restarted: bool,
) -> RouteDecision | Rejection:
    """`retry_target` of a first attempt (attempt 0, two allowed)."""
    exclude = () if restarted else (previous.prefill_worker_id,)
    prefill = serving(table, ids, PREFILL, now_s, facts.model)
    option = choose_prefill(policy, facts, prefill, swa, now_s, exclude, check_slo=False)
    if isinstance(option, Rejection):
        return option
    decoders = serving(table, ids, DECODE, now_s, facts.model)
    decode_id = previous.decode_worker_id
    if not any(w.instance_id == decode_id for w in decoders):
        decode = choose_decode(policy, facts, decoders)
        if isinstance(decode, Rejection):
            return decode
        decode_id = decode.instance_id
    return decision(policy, facts, option, decode_id, now_s)


# -- a random cluster ---------------------------------------------------------------------------
@dataclass
class Instance:
    instance_id: str
    service: str
    node_id: str
    model: str
    fair: bool = False
    seq: int = 0
    ts_ms: int = 0
    silent: bool = False  # stopped heartbeating (it goes stale, then may come back)


class Cluster:
    """Hundreds of instances whose heartbeats, work in flight, restarts and removals reach
    the table in random order, with loads drawn so that ties, full queues, the objective
    and full decoders all happen."""

    def __init__(self, rng: random.Random, table: LoadTable) -> None:
        self.rng, self.table = rng, table
        self.instances: dict[str, Instance] = {}
        self.ids: set[str] = set()  # every id the table was ever told of
        self.nodes = [f"pnode-{n}" for n in range(48)] + [f"dnode-{n}" for n in range(6)]
        for n in range(48):  # 8 prefill GPUs a node, a memcache beside them
            model = MODELS[n % 3 == 2]
            for g in range(8):
                fair = rng.random() < 0.15
                self._add(f"p{n}-{g}", PREFILL, f"pnode-{n}", model, fair)
            self._add(f"mc{n}", "swa-memcache", f"pnode-{n}", "")
        for n in range(6):
            for g in range(16):
                self._add(f"d{n}-{g}", DECODE, f"dnode-{n}", MODELS[n % 2])
        for g in range(12):
            self._add(f"v{g}", VLLM_WORKER, f"vnode-{g // 4}", "m2" if g < 10 else "m0")
        self.nodes += ["vnode-0", "vnode-1", "vnode-2"]

    def _add(self, instance_id: str, service: str, node: str, model: str, fair=False) -> None:
        self.instances[instance_id] = Instance(instance_id, service, node, model, fair)

    def report(self, inst: Instance, now_s: float, *, restart: bool = False) -> LoadReport:
        rng = self.rng
        inst.seq = 1 if restart else inst.seq + 1
        inst.ts_ms = max(inst.ts_ms + 1, round(now_s * 1000))
        queued = rng.choice(
            [0, 0, 0, 500, 500, rng.randrange(0, 30_000), rng.randrange(0, 300_000)]
        )
        by_level: tuple[int, ...] = ()
        if inst.fair and inst.service == PREFILL:
            levels = [
                rng.choice([0, 0, 200, rng.randrange(0, 20_000)])
                for _ in range(rng.randrange(1, 6))
            ]
            by_level, queued = tuple(levels), sum(levels)
        total = rng.choice([200, 400, 400, 1000])
        state = rng.choices(list(InstanceState), weights=[1, 20, 1, 1])[0]
        return LoadReport(
            service=inst.service,
            instance_id=inst.instance_id,
            seq=inst.seq,
            ts_ms=inst.ts_ms,
            state=state,
            node_id=inst.node_id,
            model=inst.model,
            num_queued_tokens=queued,
            num_running=rng.choice([0, 0, 1, 2, rng.randrange(0, 64)]),
            num_kv_pages_total=total,
            num_kv_pages_free=rng.choice([total, total, 0, rng.randrange(0, total + 1)]),
            num_queued_tokens_by_level=by_level,
        )

    def heartbeat(self, inst: Instance, now_s: float, *, restart: bool = False) -> None:
        self.table.observe(self.report(inst, now_s, restart=restart), now_s)
        self.ids.add(inst.instance_id)

    def change(self, now_s: float, sent: list[InflightDelta]) -> None:
        """One random thing happens to the cluster."""
        rng, table = self.rng, self.table
        inst = rng.choice(list(self.instances.values()))
        what = rng.random()
        if what < 0.55:
            if not inst.silent:
                self.heartbeat(inst, now_s)
        elif what < 0.62:
            self.heartbeat(inst, now_s, restart=True)
        elif what < 0.67:
            inst.silent = not inst.silent
        elif what < 0.70:  # it comes back serving another model, or on another node
            if inst.service in (PREFILL, DECODE):
                inst.model = rng.choice([*MODELS, "m3"])  # m3: asked for before it is served
            else:
                inst.node_id = rng.choice(self.nodes)
            self.heartbeat(inst, now_s)
        elif what < 0.72:
            table.remove(inst.instance_id)
        elif what < 0.74:
            table.prune(now_s)
        elif what < 0.86:  # another router's work, sometimes a withdrawal of it
            sign = rng.choice([1, 1, -1])
            delta = InflightDelta(
                "r2",
                inst.instance_id,
                num_tokens=sign * rng.randrange(0, 20_000),
                num_kv_pages=sign * rng.randrange(0, 100),
                queue_level=rng.randrange(0, 5),
            )
            table.apply_peer(delta, now_s)
        elif sent:
            table.withdraw(sent.pop(rng.randrange(len(sent))))

    def facts(self, request_id: str) -> tuple[RequestFacts, set[str]]:
        rng = self.rng
        prompt = rng.randrange(1, 200) * BLOCK + rng.randrange(0, BLOCK)
        most = (prompt - 1) // BLOCK
        cached = rng.choice([0, most, rng.randrange(0, most + 1), rng.randrange(0, most + 1)])
        local: dict[str, int] = {}
        for node in rng.sample(self.nodes, rng.randrange(0, 25)):
            # A node's workers hold one run (as a node's memory does), a few their own.
            run = rng.randrange(0, cached + 4)
            for inst in self.instances.values():
                if inst.node_id == node:
                    local[inst.instance_id] = (
                        run if rng.random() < 0.9 else rng.randrange(0, cached + 4)
                    )
        for _ in range(rng.randrange(0, 4)):
            local[rng.choice([*self.instances, "ghost"])] = rng.randrange(0, cached + 4)
        swa = set(rng.sample([*self.nodes, "ghost-node"], rng.choice([0, 0, 1, 2, 4])))
        facts = RequestFacts(
            request_id=request_id,
            num_prompt_tokens=prompt,
            num_cached_blocks=cached,
            max_tokens=rng.choice([16, 256, 4096, 4096, 4096, 4096, 4096, 4096, 60_000]),
            block_size_tokens=BLOCK,
            model=rng.choice(REQUEST_MODELS),
            local_hit_blocks=local,
            queue_level=rng.randrange(0, 5),
        )
        return facts, swa


def same(got: RouteDecision | Rejection, expected: RouteDecision | Rejection) -> None:
    if isinstance(expected, Rejection) and expected.retry_after_s is not None:
        # The retry-after is the same float, or the difference of the same floats.
        assert isinstance(got, Rejection)
        assert (got.code, got.reason) == (expected.code, expected.reason)
        assert got.retry_after_s == expected.retry_after_s
    else:
        assert got == expected


@pytest.mark.parametrize(
    ("cost", "config", "seed"),
    [
        (CostModel(), PolicyConfig(store_read_bytes_per_s=4e11), 1),
        (CostModel(), PolicyConfig(ttft_objective_s=None, max_queued_tokens=60_000), 2),
        # A queued token worth less than the estimates' rounding (1 ns): every holder is
        # estimated.
        (CostModel(prefill_tokens_per_s=1e11), PolicyConfig(max_queued_tokens=10**15), 3),
    ],
)
def test_choices_over_hundreds_of_workers_match_the_plain_algorithm(cost, config, seed):
    assert config.placement == KV
    rng = random.Random(seed)
    table = LoadTable(ROUTER, heartbeat_timeout_s=3.0, inflight_settle_s=0.05)
    cluster = Cluster(rng, table)
    now_s = 0.0
    for inst in cluster.instances.values():
        cluster.heartbeat(inst, now_s)
    fast, plain = RoutePolicy(cost, config), RoutePolicy(cost, config)
    outcomes: Counter[str] = Counter()
    sent: list[InflightDelta] = []
    for i in range(1500):
        for _ in range(rng.choice([0, 1, 1, 5, 40])):
            cluster.change(now_s, sent)
        now_s += rng.choice([0.0, 0.0, 0.01, 0.1, 0.5])
        facts, swa = cluster.facts(f"req-{i}")
        for service in (PREFILL, DECODE, VLLM_WORKER) if i % 10 == 0 else ():
            # The table's lists and models, and each instance's view, agree.
            for model in (*MODELS, "m2", "m3", None):
                listed = table.workers(service, now_s, model)
                assert listed == serving(table, cluster.ids, service, now_s, model)
            every = serving(table, cluster.ids, service, now_s, None)
            assert table.models(service, now_s) == sorted({w.model for w in every})
        expected = plain_choose(plain, facts, table, cluster.ids, swa, now_s)
        got = fast.choose(facts, table, swa, now_s)
        same(got, expected)
        outcomes[_outcome(expected)] += 1
        if not isinstance(got, RouteDecision):
            continue
        if not got.aggregated and rng.random() < 0.3:
            restarted = rng.random() < 0.2
            again = fast.retry_target(got, facts, table, swa, now_s, 0, restarted=restarted)
            expected = plain_retry(plain, got, facts, table, cluster.ids, swa, now_s, restarted)
            same(again, expected)
            outcomes["retry " + _outcome(expected)] += 1
        for delta in fast.inflight_deltas(ROUTER, got, facts):
            table.record_sent(delta, now_s)
            sent.append(delta)
    # The run went through every outcome, so each was compared.
    for outcome in ("prefill+decode", "aggregated", "retry prefill+decode"):
        assert outcomes[outcome] > 20, outcomes
    for code in (ErrorCode.UNAVAILABLE, ErrorCode.OVERLOADED, ErrorCode.BAD_REQUEST):
        assert outcomes[code.value] > 0, outcomes
    if config.ttft_objective_s is None:
        assert outcomes["full"] > 0, outcomes


def _outcome(outcome: RouteDecision | Rejection) -> str:
    if isinstance(outcome, RouteDecision):
        return "aggregated" if outcome.aggregated else "prefill+decode"
    if outcome.reason.startswith("every prefill queue is full"):
        return "full"
    return outcome.code.value


def test_holders_whose_queues_round_to_one_estimate_are_all_estimated():
    """At 1e11 tokens/s a queued token is 0.01 ns: b's empty queue and a's one token give
    the same estimate to the nanosecond, so the tie goes to the smaller id, a, as it does
    when every holder is estimated (a kind's first by queue, b, would not be the pick)."""
    # (The room so large: loads count in compute-token equivalents, billions at that rate.)
    config = PolicyConfig(max_queued_tokens=10**15)
    policy = RoutePolicy(CostModel(prefill_tokens_per_s=1e11), config)
    table = LoadTable(ROUTER)
    for instance_id, queued in (("b", 0), ("a", 1), ("c", 0)):
        node = "n2" if instance_id == "c" else "n1"
        report = LoadReport(PREFILL, instance_id, 1, 0, node_id=node, model="m0")
        table.observe(msgspec.structs.replace(report, num_queued_tokens=queued), 0.0)
    table.observe(
        LoadReport(DECODE, "d", 1, 0, model="m0", num_kv_pages_total=99, num_kv_pages_free=99), 0.0
    )
    facts = RequestFacts("r", 5000, 50, 10, model="m0", local_hit_blocks={"a": 50, "b": 50})
    expected = plain_choose(RoutePolicy(policy.cost, policy.config), facts, table, "abcd", (), 0.0)
    assert isinstance(expected, RouteDecision) and expected.prefill_worker_id == "a"
    assert policy.choose(facts, table, (), 0.0) == expected
