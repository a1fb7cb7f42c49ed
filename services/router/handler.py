"""The router over NATS: `GenerateRequest` in, a chosen prefill and decode worker, the jobs
sent to them, `RouteDecision` back (docs/request-flow.md).

One request: check the prompt's block hashes (cheaply, `RequestBlocks.check`) -> kv-index
match (the hit length and where its blocks lie; no answer = routed cold) -> which nodes'
swa-memcache hold the hit's boundary snapshot (a lookup in `SwaMap`, kept from the memcaches'
`SwaHeld` events: no question to any memcache) -> `RoutePolicy.choose` -> count the work in
flight (and tell the other replicas) -> `DecodeJob` to the decode worker, awaiting
`JobAccepted` -> reply; the `PrefillJob` is seen through in the background (`PrefillJobs`).

The map: at start the router subscribes to every memcache's events and then broadcasts a
`SwaResync` (each memcache answers with its full state); a sequence gap, or a batch from a
memcache it does not know, gets a `SwaResync` naming that instance; a memcache whose
heartbeats stop is forgotten with the other pruned instances.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Sequence

import msgspec
import numpy as np

from services.router.config import RouterConfig
from services.router.metrics import RouterMetrics
from services.router.policy import Rejection, RequestFacts, RoutePolicy
from services.router.prefill_jobs import PrefillJobs
from services.router.sessions import SessionLedger
from services.router.swa_map import SwaMap
from shared import kv_index_client as index_client
from shared import telemetry
from shared.blocks import BlockLayoutError, RequestBlocks
from shared.bus import Bus, Context, Endpoint
from shared.kv_index_client import MemoryHit, PrefixMatch
from shared.load_table import InflightDelta, LoadTable
from shared.logging import get_logger
from shared.metrics import Metrics, tier_label
from shared.schema import (
    BadRequest,
    BlockLocations,
    CancelRequest,
    DecodeJob,
    Eviction,
    GenerateRequest,
    InflightNotice,
    JobAccepted,
    LoadReport,
    NoResponders,
    PrefillJob,
    RouteDecision,
    ServiceError,
    SwaHeld,
    SwaResync,
    num_packed_tokens,
)
from shared.subjects import (
    DECODE,
    INBOX_PREFIX,
    PREFILL,
    ROUTER,
    SWA_MEMCACHE,
    VLLM_WORKER,
    is_inbox,
)
from shared.telemetry import REQUEST_ID
from worker.cost_model import CostModel

log = get_logger(__name__)
ACCEPT_PROBE_S = 0.5  # how often a decode worker slow to accept a job is asked if it is there

# The services whose heartbeats the router keeps: the workers it routes to, and the memcaches
# whose snapshots it maps (a memcache pruned for silence is forgotten by the map too).
WATCHED_SERVICES = frozenset({PREFILL, DECODE, SWA_MEMCACHE, VLLM_WORKER})


def checked_request(request: GenerateRequest) -> RequestBlocks:
    """The request's block layout, checked against its tokens; BadRequest when the prompt
    is empty or malformed, or its block hashes are missing or do not match its tokens."""
    if len(request.prompt_token_ids) % 4:
        raise BadRequest("prompt_token_ids must be packed u32 (a multiple of 4 bytes)")
    if num_packed_tokens(request.prompt_token_ids) == 0:
        raise BadRequest("the prompt is empty")
    if not request.stream_inbox:
        raise BadRequest("stream_inbox is required: the decode worker streams to it")
    if not is_inbox(request.stream_inbox):
        # Workers may publish usage and KV events: a stream aimed there would write into
        # them with the workers' permissions.
        raise BadRequest(f"stream_inbox must be a reply inbox ({INBOX_PREFIX}.*)")
    if request.block_size_tokens <= 0:
        raise BadRequest(f"block_size_tokens must be > 0, got {request.block_size_tokens}")
    try:
        blocks = RequestBlocks.of_request(request)
        blocks.check(request.prompt_token_ids)
    except BlockLayoutError as exc:
        raise BadRequest(f"block_hashes: {exc} (the caller hashes the prompt)") from exc
    return blocks


def cached_prefix(match: PrefixMatch | None, num_blocks: int) -> BlockLocations:
    """The locations of the first `num_blocks` blocks of `match` (the ones the job reuses)."""
    if match is None or num_blocks <= 0:
        return BlockLocations()
    locations = match.locations
    if num_blocks >= len(locations):
        return locations
    columns = {name: column[:num_blocks] for name, column in locations.columns().items()}
    used, columns["writer"] = np.unique(columns["writer"], return_inverse=True)
    writer_ids = tuple(locations.writer_ids[w] for w in used.tolist())
    return BlockLocations.from_columns(match.tier, writer_ids, columns)


class Router:
    def __init__(
        self,
        bus: Bus,
        config: RouterConfig,
        *,
        cost: CostModel | None = None,
        metrics: Metrics | None = None,  # the process's (a test's own when None)
    ) -> None:
        self.bus = bus
        self.config = config
        self.table = LoadTable(bus.instance_id, heartbeat_timeout_s=config.heartbeat_timeout_s)
        cost = cost or CostModel().sped_up(config.cost_speedup)
        self.policy = RoutePolicy(cost, config.policy_config())
        self.sessions = SessionLedger(config.max_sessions)
        self.metrics = metrics or Metrics(ROUTER, bus.instance_id)
        self.counts = RouterMetrics(self.metrics)
        self.swa_map = SwaMap()
        self.counts.observe(self.swa_map, lambda: len(self.prefill_jobs))
        self.prefill_jobs = PrefillJobs(
            bus,
            self.table,
            self.policy,
            self.counts,
            self.record_sent,
            prefill_timeout_s=config.prefill_timeout_s,
        )

    @property
    def router_id(self) -> str:
        return self.bus.instance_id

    # -- lifecycle -----------------------------------------------------------------------
    async def start(self, *, warmup_s: float = 0.0) -> None:
        """Listen to heartbeats, peers and cancellations; after `warmup_s` (time for every
        worker's heartbeat to arrive, so a restarted router does not turn work away while its
        table fills) serve `router.generate`."""
        subjects = self.bus.subjects
        await self.bus.subscribe(subjects.load_all, LoadReport, self.on_load_report)
        await self.bus.subscribe(subjects.router_inflight, InflightNotice, self.on_inflight)
        await self.bus.subscribe(subjects.cancel, CancelRequest, self.on_cancel)
        await self.bus.subscribe(subjects.swa_events_all, SwaHeld, self.on_swa_held)
        await self.bus.flush()  # subscribed before asking, or the first answers are missed
        await self.bus.publish(subjects.swa_resync, SwaResync(reason="router started"))
        if warmup_s > 0:
            await asyncio.sleep(warmup_s)
        await self.bus.serve(
            Endpoint("generate", subjects.router_generate, GenerateRequest, self.generate)
        )
        await self.bus.flush()

    async def stop(self) -> None:
        """Give up the prefill jobs still awaited; safe to repeat."""
        await self.prefill_jobs.stop()

    async def prune(self) -> None:
        """Forget instances whose heartbeats stopped."""
        for instance_id in self.table.prune(time.monotonic()):
            log.warning("instance dropped: its heartbeats stopped", instance_id=instance_id)
            self.swa_map.forget(instance_id)

    def load_fields(self) -> dict[str, int]:
        return {"num_running": len(self.prefill_jobs)}

    # -- events --------------------------------------------------------------------------
    async def on_load_report(self, report: LoadReport) -> None:
        if report.service in WATCHED_SERVICES:
            self.table.observe(report, time.monotonic())

    async def on_inflight(self, notice: InflightNotice) -> None:
        if notice.router_id == self.router_id:
            return  # counted when we sent it
        delta = InflightDelta(
            notice.router_id,
            notice.instance_id,
            notice.num_tokens,
            notice.num_kv_pages,
            notice.num_requests,
            notice.queue_level,
        )
        self.table.apply_peer(delta, time.monotonic())

    async def on_swa_held(self, batch: SwaHeld) -> None:
        """A memcache's change of what it holds; a resync asked when the map missed some."""
        try:
            should_resync = self.swa_map.apply(batch, time.monotonic())
        except ValueError as exc:  # not packed u64: the next batch shows the gap
            log.warning(
                "malformed swa-memcache batch dropped",
                instance_id=batch.instance_id,
                seq=batch.seq,
                error=str(exc),
            )
            return
        if should_resync:
            log.info(
                "asking swa-memcache for its full state",
                instance_id=batch.instance_id,
                seq=batch.seq,
            )
            resync = SwaResync(
                instance_id=batch.instance_id,
                reason=f"router {self.router_id}: missed batches before seq {batch.seq}",
            )
            await self.bus.publish(self.bus.subjects.swa_resync, resync)

    async def on_cancel(self, notice: CancelRequest) -> None:
        if self.prefill_jobs.cancel(notice.request_id):
            log.info("prefill job no longer awaited: cancelled", request_id=notice.request_id)

    async def record_sent(self, deltas: Sequence[InflightDelta]) -> None:
        """Count work just sent to workers and announce it to the other replicas."""
        now_s = time.monotonic()
        for delta in deltas:
            self.table.record_sent(delta, now_s)
            notice = InflightNotice(
                router_id=delta.router_id,
                instance_id=delta.instance_id,
                num_tokens=delta.num_tokens,
                num_kv_pages=delta.num_kv_pages,
                num_requests=delta.num_requests,
                queue_level=delta.queue_level,
            )
            await self.bus.publish(self.bus.subjects.router_inflight, notice)

    async def withdraw(self, deltas: Sequence[InflightDelta]) -> None:
        """Take back work counted by `record_sent` that was never sent after all; peers get
        the same notice negated."""
        for delta in deltas:
            if not self.table.withdraw(delta):
                continue  # already settled by a heartbeat, or the instance is gone
            notice = InflightNotice(
                router_id=delta.router_id,
                instance_id=delta.instance_id,
                num_tokens=-delta.num_tokens,
                num_kv_pages=-delta.num_kv_pages,
                num_requests=-delta.num_requests,
                queue_level=delta.queue_level,
            )
            await self.bus.publish(self.bus.subjects.router_inflight, notice)

    # -- router.generate -----------------------------------------------------------------
    async def generate(self, request: GenerateRequest, ctx: Context) -> RouteDecision:
        with telemetry.span("router route") as span:
            if span.is_recording():
                span.set_attributes(
                    {REQUEST_ID: request.request_id, "kvfabric.model": request.model}
                )
            try:
                return await self._route(request)
            except ServiceError as exc:
                self.counts.rejected.inc()
                self.counts.rejections.labels(exc.code).inc()
                if span.is_recording():
                    span.set_attribute("kvfabric.rejected", f"{exc.code.value}: {exc.message}")
                raise

    async def _route(self, request: GenerateRequest) -> RouteDecision:
        # An unknown model first: the most useful answer to a request nothing here can serve.
        unserved = self.policy.unserved_model(request.model, self.table, time.monotonic())
        if unserved is not None:
            raise unserved.to_error()
        blocks = checked_request(request)
        match, own, eviction = await self._match(request.request_id, request.block_hashes)
        local = {worker: hit.num_blocks for worker, hit in own.items()}
        facts = RequestFacts.of(request, blocks, match.num_blocks if match else 0, local)
        # The session's work so far and this request's decide its queue level (sessions.py).
        num_work = self.policy.work_tokens(facts)
        level = self.sessions.level(request.session, num_work)
        facts = dataclasses.replace(facts, queue_level=level)
        if match is None or facts.num_cached_blocks < match.num_blocks:
            eviction = None  # the prompt's reusable blocks all hit: nothing of it was missed
        if eviction is not None and request.cache_probe is not None:
            # For the usage record the worker writes: the diagnosis's cause is `evicted`.
            probe = msgspec.structs.replace(request.cache_probe, eviction=eviction)
            request = msgspec.structs.replace(request, cache_probe=probe)
        swa_node_ids = self._swa_holders(facts.boundary_block_hash)
        cached = cached_prefix(match, facts.num_cached_blocks)
        decision = await self._place(request, facts, swa_node_ids, cached)
        self.sessions.charge(request.session, num_work)  # admitted: a refusal costs nothing
        if eviction is not None:
            decision = msgspec.structs.replace(decision, eviction=eviction)
        if not decision.aggregated:  # an aggregated worker prefills the job it was sent
            self.prefill_jobs.start(
                PrefillJob(
                    request=request,
                    decision=decision,
                    cached_blocks=cached,
                    queue_level=facts.queue_level,
                ),
                facts,
                swa_node_ids,
            )
        self.counts.routed.inc()
        self.counts.prompt_tokens.inc(facts.num_prompt_tokens)
        if facts.num_cached_tokens:
            self.counts.hit_tokens.labels(tier_label(cached.tier)).inc(facts.num_cached_tokens)
        span = telemetry.current_span()
        if span.is_recording():
            span.set_attributes(
                {
                    "kvfabric.num_prompt_tokens": facts.num_prompt_tokens,
                    "kvfabric.hit_tokens": facts.num_cached_tokens,
                    "kvfabric.prefill_worker_id": decision.prefill_worker_id,
                    "kvfabric.decode_worker_id": decision.decode_worker_id,
                    "kvfabric.has_swa_snapshot": decision.has_swa_snapshot,
                }
            )
        log.info(
            "routed",
            request_id=request.request_id,
            prefill_worker_id=decision.prefill_worker_id,
            decode_worker_id=decision.decode_worker_id,
            num_cached_tokens=facts.num_cached_tokens,
            has_swa_snapshot=decision.has_swa_snapshot,
        )
        return decision

    async def _match(
        self, request_id: str, hashes: bytes
    ) -> tuple[PrefixMatch | None, dict[str, MemoryHit], Eviction | None]:
        """kv-index's longest hit, each worker's own in its memory, and the tombstone of the
        block the hit ends at if it was evicted. Whatever goes wrong there, the request is
        routed cold: computing the whole prompt is always correct, only slower."""
        if not hashes:
            return None, {}, None
        with telemetry.span("router match") as span:
            try:
                matches, own = await index_client.match_with_holders(
                    self.bus,
                    hashes,
                    num_shards=self.config.kv_index_shards,
                    timeout_s=self.config.match_timeout_s,
                )
            except ServiceError as exc:
                self.counts.cold_index.inc()
                log.warning(
                    "kv-index did not answer: routed cold",
                    request_id=request_id,
                    code=exc.code.value,
                    error=exc.message,
                )
                if span.is_recording():
                    span.set_attribute("kvfabric.routed_cold", f"{exc.code.value}: {exc.message}")
                return None, {}, None
            if span.is_recording():
                span.set_attribute("kvfabric.num_blocks", len(hashes) // 8)
                for tier, match in matches.items():
                    span.set_attribute(f"kvfabric.hit_blocks.{tier}", match.num_blocks)
                span.set_attribute("kvfabric.num_holders", len(own))
        if not matches:
            return None, own, None
        best = max(matches.values(), key=lambda m: (m.num_blocks, m.tier == "ssd"))
        return best, own, index_client.first_miss_eviction(matches)

    def _swa_holders(self, boundary_block_hash: int | None) -> frozenset[str]:
        """Nodes whose swa-memcache holds the boundary's snapshot, as far as the map knows."""
        if boundary_block_hash is None:
            return frozenset()
        return self.swa_map.holders(boundary_block_hash)

    async def _place(
        self,
        request: GenerateRequest,
        facts: RequestFacts,
        swa_node_ids: frozenset[str],
        cached: BlockLocations,
    ) -> RouteDecision:
        """Choose and hand the request to its decode worker; once more if that one is gone.

        Work counted in flight for a choice that did not stick (decode refused it: a bad
        request, no pages, gone) is withdrawn, or it would steer the next requests away from
        those workers until their next heartbeats."""
        decision, deltas = await self._choose(facts, swa_node_ids)
        try:
            try:
                await self._send_decode(request, decision, cached)
            except NoResponders as exc:
                log.warning(
                    "decode worker gone: choosing again",
                    request_id=request.request_id,
                    decode_worker_id=decision.decode_worker_id,
                    error=exc.message,
                )
                self.table.remove(decision.decode_worker_id)
                await self.withdraw(deltas)
                decision, deltas = await self._choose(facts, swa_node_ids)
                await self._send_decode(request, decision, cached)
        except BaseException:
            await self.withdraw(deltas)
            raise
        return decision

    async def _choose(
        self, facts: RequestFacts, swa_node_ids: frozenset[str]
    ) -> tuple[RouteDecision, Sequence[InflightDelta]]:
        decision = self.policy.choose(facts, self.table, swa_node_ids, time.monotonic())
        if isinstance(decision, Rejection):
            raise decision.to_error()
        # Counted before the job is sent: a burst within one heartbeat must see it.
        deltas = self.policy.inflight_deltas(self.router_id, decision, facts)
        await self.record_sent(deltas)
        return decision, deltas

    async def _send_decode(
        self, request: GenerateRequest, decision: RouteDecision, cached: BlockLocations
    ) -> None:
        """Hand the job over. A worker that dies with the job in hand never answers: while
        waiting, it is pinged every `ACCEPT_PROBE_S`, and once NATS says nobody is there the
        wait ends with NoResponders (chosen again) instead of the accept timeout."""
        subjects = self.bus.subjects
        run = subjects.vllm_run if decision.aggregated else subjects.decode_run
        accept = asyncio.ensure_future(
            self.bus.request(
                subjects.instance(run, decision.decode_worker_id),
                DecodeJob(request=request, decision=decision, cached_blocks=cached),
                JobAccepted,
                timeout_s=self.config.accept_timeout_s,
                request_id=request.request_id,
                deadline_ms=request.deadline_ms,
            )
        )
        try:
            while not (await asyncio.wait({accept}, timeout=ACCEPT_PROBE_S))[0]:
                try:
                    await self.bus.request(
                        subjects.ping(decision.decode_worker_id), b"", bytes, timeout_s=1.0
                    )
                except NoResponders:
                    if accept.done():
                        break
                    raise NoResponders(
                        f"{decision.decode_worker_id} went away with the job in hand"
                    ) from None
                except ServiceError:  # slow to answer a ping too: keep waiting on the accept
                    pass
            accept.result()
        finally:
            if not accept.done():
                accept.cancel()
                await asyncio.gather(accept, return_exceptions=True)
