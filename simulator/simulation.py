"""The discrete-event loop: sessions' requests routed by the production router policy over
the production load table, hits answered by the production kv-index, served by simulated
GPUs (cluster.py), measured per window (report.py). A heap of events on a simulated clock;
no asyncio, no NATS, no processes.

Per request, as services/router/handler.py does it: kv-index's longest hit (`Store`), each
worker's own (`HostTiers`), `RequestFacts.of`, the nodes holding the boundary's window,
`RoutePolicy.choose` over the `LoadTable`, then `inflight_deltas` recorded in the table. A
refusal with a retry-after is waited out as `shared.client` does (`client_wait_s` in all).
Workers report `LoadReport`s every `heartbeat_s`, and a decode GPU once more when a finished
sequence frees its pages; the prefill writer logs the blocks it computed, the decode writer
those of the answer, as `KvEventBatch`es.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from loadtest.trace.caches import WindowMap
from services.router.policy import PolicyConfig, Rejection, RequestFacts, RoutePolicy
from shared.blocks import RequestBlocks, num_blocks_before_last
from shared.load_table import LoadTable
from shared.schema import GenerateRequest, RouteDecision
from shared.schema.inference import SamplingParams
from simulator.cluster import DecodeGpu, HostTiers, PrefillGpu, Store, load_report
from simulator.config import SimConfig
from simulator.report import Ledger, Window, Windows
from simulator.workload import Session, Workload
from worker.cost_model import CostModel

ROUTER_ID = "router-sim"
HISTORY_WRITER = "history"  # the writer of what sessions in progress at the start stored
REFERENCE_INPUT_TOKENS = 77_000  # the reference's average prompt: `load` is relative to it
# Event order at one instant: work ends, heartbeats report it, then requests see it.
_PREFILL_DONE, _DECODE_CHECK, _HEARTBEAT, _EVICT, _WINDOW, _SESSION, _STEP, _RETRY = range(8)


@dataclass(eq=False)
class Request:
    request_id: str
    session: Session
    first_arrival_s: float
    blocks: RequestBlocks
    num_output_tokens: int
    facts: RequestFacts | None = None
    decision: RouteDecision | None = None
    prefill: PrefillGpu | None = None
    decode: DecodeGpu | None = None
    num_job_tokens: int = 0
    num_pages: int = 0


class Simulation:
    def __init__(
        self, config: SimConfig, *, progress: Callable[[Window, float], None] | None = None
    ) -> None:
        self.config = config
        self.progress = progress
        self.cost = CostModel(
            prefill_tokens_per_s=config.prefill_tokens_per_s,
            load_tokens_per_s=config.load_tokens_per_s,
            replay_tokens=config.replay_tokens,
            replay_tokens_per_s=config.prefill_tokens_per_s,
            kv_bytes_per_token=config.kv_bytes_per_token,
            host_load_bytes_per_s=config.host_load_bytes_per_s,
        )
        self.policy = RoutePolicy(
            self.cost,
            PolicyConfig(
                ttft_objective_s=config.ttft_objective_s,
                max_queued_tokens=config.max_queued_tokens,
                decode_page_size_tokens=config.block_size_tokens,
                store_read_bytes_per_s=config.store_read_bytes_per_s,
                placement=config.placement,
            ),
        )
        self.table = LoadTable(ROUTER_ID, heartbeat_timeout_s=3 * config.heartbeat_s)
        self.store = Store(config.store_bytes, config.store_read_bytes_per_s, config.block_bytes)
        self.prefill = [
            PrefillGpu(f"prefill-{s}-{g}", f"pnode-{s}")
            for s in range(config.num_prefill_servers)
            for g in range(config.gpus_per_prefill_server)
        ]
        self.decode = [
            DecodeGpu(
                f"decode-{n}-{g}",
                f"dnode-{n}",
                config.decode_pages_per_gpu,
                config.decode_tokens_per_s,
                config.user_tokens_per_s,
            )
            for n in range(config.num_decode_nodes)
            for g in range(config.gpus_per_decode_node)
        ]
        self._prefill_by_id = {gpu.worker_id: gpu for gpu in self.prefill}
        self._decode_by_id = {gpu.worker_id: gpu for gpu in self.decode}
        nodes = sorted({p.node_id for p in self.prefill})
        self.workers_of_node = {
            n: [p.worker_id for p in self.prefill if p.node_id == n] for n in nodes
        }
        self.host = HostTiers(nodes, config.host_tier_bytes_per_node // config.block_bytes)
        self.windows_held = WindowMap(config.swa_ttl_s)
        self.workload = Workload(config, config.seed)
        self.windows = Windows(config.window_s)
        self.ledger = Ledger()
        self.rng = np.random.default_rng((config.seed, 0))
        self.rate_per_s = config.load * config.reference_rate_per_s(REFERENCE_INPUT_TOKENS)
        self.session_rate_per_s = self.rate_per_s / config.workload.steps_mean
        # Per session step (0: a session's first request; sessions in progress at the start
        # count from their first request here): [hit tokens, prompt tokens] routed.
        self.hits_by_step: dict[int, list[int]] = {}
        self.num_decisions = 0
        self.decision_cpu_s = 0.0  # CPU time in kv-index's match and the policy's choice
        self._events: list[tuple[float, int, int, object]] = []
        self._count = itertools.count()
        self._requests = itertools.count()
        self._num_open = 0  # requests issued and not yet finished or refused
        self.now_s = 0.0

    # -- the loop ----------------------------------------------------------------------------
    def _at(self, t_s: float, kind: int, payload: object = None) -> None:
        heapq.heappush(self._events, (t_s, kind, next(self._count), payload))

    def run(self) -> Simulation:
        config = self.config
        self._heartbeat()
        if config.start_in_progress:
            self._start_population()
        self._at(0.0, _SESSION)
        self._at(config.evict_interval_s, _EVICT)
        self._at(config.window_s, _WINDOW)
        self._at(config.heartbeat_s, _HEARTBEAT)
        while self._events:
            t_s, kind, _, payload = heapq.heappop(self._events)
            self.now_s = t_s
            if kind == _STEP:
                self._issue(payload)  # type: ignore[arg-type]
            elif kind == _RETRY:
                self._route(payload)  # type: ignore[arg-type]
            elif kind == _PREFILL_DONE:
                self._prefill_done(payload)  # type: ignore[arg-type]
            elif kind == _DECODE_CHECK:
                self._decode_check(*payload)  # type: ignore[misc]
            elif kind == _SESSION:
                self._start_session()
            elif self._idle():
                continue  # periodic events stop once nothing is left to happen
            elif kind == _HEARTBEAT:
                self._heartbeat()
                self._at(t_s + config.heartbeat_s, _HEARTBEAT)
            elif kind == _EVICT:
                self.store.evict(t_s)
                self._at(t_s + config.evict_interval_s, _EVICT)
            elif kind == _WINDOW:
                if self.progress is not None:
                    self.progress(self.windows.at(t_s - config.window_s), self.decision_cpu_s)
                self._at(t_s + config.window_s, _WINDOW)
        return self

    def steady(self) -> Window | None:
        """The windows after the warm-up and before arrivals stopped, as one."""
        config = self.config
        windows = [
            w
            for w in self.windows.ordered()
            if w.start_s >= config.warmup_s and w.end_s <= config.duration_s + 1e-9
        ]
        return Window.merged(windows) if windows else None

    @property
    def decisions_per_cpu_s(self) -> float:
        """Requests the production index match + policy decide per CPU-second here."""
        return self.num_decisions / self.decision_cpu_s if self.decision_cpu_s else 0.0

    def summarize(self, window: Window) -> dict:
        config = self.config
        return window.summary(
            config.num_prefill_gpus, config.num_decode_gpus, config.decode_tokens_per_s
        )

    def _idle(self) -> bool:
        return self.now_s >= self.config.duration_s and self._num_open == 0

    # -- sessions and requests ---------------------------------------------------------------
    def _start_population(self) -> None:
        """The sessions live at the start of a steady flow (as many as the session rate x
        their mean life), each in progress, its next step within one step's period, and
        the store holding what their earlier steps wrote (the node tiers start empty)."""
        period_s = self.workload.step_period_s(self.config.user_tokens_per_s)
        life_s = self.config.workload.steps_mean * period_s
        block_size = self.config.block_size_tokens
        for _ in range(round(self.session_rate_per_s * life_s)):
            session = self.workload.session(self.ledger.num_sessions, in_progress=True)
            self.ledger.num_sessions += 1
            # What its earlier steps' writers left: the store starts as a running one's.
            served = num_blocks_before_last(session.num_served_tokens, block_size)
            self.store.write(HISTORY_WRITER, session.hashes[:served], 0.0)
            first_s = float(self.rng.uniform(0.0, period_s))
            if first_s < self.config.duration_s:
                self._at(first_s, _STEP, session)

    def _start_session(self) -> None:
        session = self.workload.session(self.ledger.num_sessions)
        self.ledger.num_sessions += 1
        self._issue(session)
        gap_s = float(self.rng.exponential(1.0 / self.session_rate_per_s))
        if self.now_s + gap_s < self.config.duration_s:
            self._at(self.now_s + gap_s, _SESSION)

    def _issue(self, session: Session) -> None:
        request = Request(
            f"r{next(self._requests)}",
            session,
            self.now_s,
            session.blocks(),
            self.workload.output_tokens(session),
        )
        self.ledger.num_issued += 1
        self.ledger.num_issued_prompt_tokens += request.blocks.num_prompt_tokens
        self.windows.at(self.now_s).num_arrived += 1
        self._num_open += 1
        self._route(request)

    def _route(self, request: Request) -> None:
        now_s = self.now_s
        hashes = request.blocks.hashes
        started = time.process_time()
        num_hit = self.store.num_hit_blocks(hashes, now_s)
        local = {
            worker_id: num_blocks
            for node_id, num_blocks in self.host.leading_runs(hashes).items()
            for worker_id in self.workers_of_node[node_id]
        }
        generate = GenerateRequest(
            request_id=request.request_id,
            model=self.config.model,
            prompt_token_ids=b"",  # RequestFacts reads the layout, never the tokens
            block_size_tokens=self.config.block_size_tokens,
            sampling=SamplingParams(max_tokens=self.config.workload.max_output_tokens),
        )
        facts = RequestFacts.of(generate, request.blocks, num_hit, local)
        swa_node_ids = self.windows_held.holders(facts.boundary_block_hash, now_s)
        decision = self.policy.choose(facts, self.table, swa_node_ids, now_s)
        self.decision_cpu_s += time.process_time() - started
        self.num_decisions += 1
        if isinstance(decision, Rejection):
            self._refused(request, decision)
            return
        prefill_delta, decode_delta = self.policy.inflight_deltas(ROUTER_ID, decision, facts)
        self.table.record_sent(prefill_delta, now_s)
        self.table.record_sent(decode_delta, now_s)
        request.facts, request.decision = facts, decision
        request.num_job_tokens = prefill_delta.num_tokens
        request.num_pages = decode_delta.num_kv_pages
        by_step = self.hits_by_step.setdefault(request.session.step, [0, 0])
        by_step[0] += facts.num_cached_tokens
        by_step[1] += facts.num_prompt_tokens
        window = self.windows.at(now_s)
        window.num_routed += 1
        window.num_prompt_tokens += facts.num_prompt_tokens
        window.num_hit_tokens += facts.num_cached_tokens
        self._start_prefill(request, window)

    def _refused(self, request: Request, rejection: Rejection) -> None:
        window = self.windows.at(self.now_s)
        retry_after_s = rejection.retry_after_s
        if retry_after_s is not None:
            retry_after_s = max(retry_after_s, self.config.client_min_retry_s)
            window.num_rejections += 1
            waited_s = self.now_s - request.first_arrival_s
            if waited_s + retry_after_s <= self.config.client_wait_s:
                self._at(self.now_s + retry_after_s, _RETRY, request)
                return
        window.num_refused += 1
        self.ledger.num_refused += 1
        self.ledger.num_refused_prompt_tokens += request.blocks.num_prompt_tokens
        self._num_open -= 1  # the agent gives up: its session ends here

    # -- prefill -----------------------------------------------------------------------------
    def _start_prefill(self, request: Request, window: Window) -> None:
        facts, decision = request.facts, request.decision
        assert facts is not None and decision is not None  # set by _route
        gpu = self._prefill_by_id[decision.prefill_worker_id]
        decode = self._decode_by_id[decision.decode_worker_id]
        cost, block = self.cost, facts.block_size_tokens
        cached = facts.num_cached_tokens
        local = facts.num_local_blocks(gpu.worker_id) * block
        store_tokens = cached - local
        window.num_local_hit_tokens += local

        def load(start_s: float) -> float:
            host_done_s = start_s + cost.local_load_s(local)
            store_bytes = cost.kv_bytes(store_tokens)
            self.windows.at(start_s).store_read_bytes += store_bytes
            return self.store.read(host_done_s, store_bytes, cost.store_load_s(store_tokens))

        replayed = cost.num_replay_tokens(cached, decision.has_swa_snapshot)
        window.num_replayed_tokens += replayed
        compute_s = cost.prefill_s(facts.num_prompt_tokens - cached, 0, replayed)
        start_s = gpu.schedule(self.now_s, load, compute_s)
        self.windows.spread(start_s, start_s + compute_s, 1.0, "prefill_busy_s")
        gpu.num_queued_tokens += request.num_job_tokens
        gpu.num_jobs += 1
        decode.num_pages_used += request.num_pages
        request.prefill, request.decode = gpu, decode
        self._at(start_s + compute_s, _PREFILL_DONE, request)

    def _prefill_done(self, request: Request) -> None:
        facts, gpu = request.facts, request.prefill
        assert facts is not None and gpu is not None  # set when it was routed
        now_s, blocks = self.now_s, request.blocks
        gpu.num_queued_tokens -= request.num_job_tokens
        gpu.num_jobs -= 1
        num_prefill = blocks.num_prefill_blocks
        self.store.write(gpu.worker_id, blocks.hashes[facts.num_cached_blocks : num_prefill], now_s)
        self.host.hold(gpu.node_id, blocks.hashes[:num_prefill])
        boundary = blocks.boundary_hash(num_prefill)
        if boundary is not None:
            self.windows_held.put(boundary, gpu.node_id, now_s)
        self.windows.at(request.first_arrival_s).ttft_s.append(now_s - request.first_arrival_s)
        self.ledger.num_hit_tokens += facts.num_cached_tokens
        self.ledger.num_computed_tokens += facts.num_prompt_tokens - facts.num_cached_tokens
        decode = request.decode
        assert decode is not None
        decode.advance(now_s, self._produced)
        decode.start(request, request.num_output_tokens)
        self._check_decode_at(decode)

    # -- decode ------------------------------------------------------------------------------
    def _produced(self, start_s: float, end_s: float, tokens_per_s: float) -> None:
        self.windows.spread(start_s, end_s, tokens_per_s, "num_output_tokens")
        self.ledger.num_decoded_tokens += tokens_per_s * (end_s - start_s)

    def _check_decode_at(self, decode: DecodeGpu) -> None:
        finish_s = decode.next_finish_s()
        if finish_s is not None:
            self._at(finish_s, _DECODE_CHECK, (decode, decode.version))

    def _decode_check(self, decode: DecodeGpu, version: int) -> None:
        if version != decode.version:
            return  # the batch changed since: a newer check is scheduled
        decode.advance(self.now_s, self._produced)
        for request in decode.take_finished():
            self._finished(request)  # type: ignore[arg-type]
        self._report(decode)  # pages freed: reported at once, as the decode worker does
        self._check_decode_at(decode)

    def _finished(self, request: Request) -> None:
        now_s, session, decode = self.now_s, request.session, request.decode
        assert decode is not None
        decode.num_pages_used -= request.num_pages
        num_prompt = request.blocks.num_prompt_tokens
        think_s = self.workload.next_step(session, request.num_output_tokens)
        # The decode writer stores the blocks from the prompt's last one through the answer.
        end = num_blocks_before_last(
            num_prompt + request.num_output_tokens, session.hasher.block_size_tokens
        )
        self.store.write(
            decode.worker_id, session.hashes[request.blocks.num_prefill_blocks : end], now_s
        )
        ledger = self.ledger
        ledger.num_finished += 1
        ledger.num_finished_prompt_tokens += num_prompt
        ledger.num_requested_output_tokens += request.num_output_tokens
        self._num_open -= 1
        if think_s is None:
            return
        if now_s + think_s >= self.config.duration_s:
            ledger.num_steps_cut += 1
            return
        self._at(now_s + think_s, _STEP, session)

    # -- heartbeats --------------------------------------------------------------------------
    def _heartbeat(self) -> None:
        for gpu in self.prefill:
            self._report(gpu)
        for decode in self.decode:
            self._report(decode)

    def _report(self, gpu: PrefillGpu | DecodeGpu) -> None:
        self.table.observe(load_report(gpu, self.now_s, self.config.model), self.now_s)
