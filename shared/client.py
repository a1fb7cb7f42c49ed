"""The caller's side of one generation (docs/request-flow.md): what ingress and
`kvfabric generate` do between a tokenized prompt and its text.

The caller opens an inbox, sends the `GenerateRequest` to the router with `stream_inbox` set
to it, and reads the `TokenChunk`s the chosen decode worker streams there. The router's
`RouteDecision` and the chunks come from different senders in no fixed order (the router may
answer after the first chunks), so both are awaited at once.

The stream belongs to the decode worker; if that worker dies, nobody will end the stream, so
the caller watches its heartbeats (`LoadReport`, ~1 s): silence for `liveness_timeout_s`
means the worker is gone. The caller then bills what it received (a FAILED `UsageRecord`,
through its durable outbox, under a message id of its own: if the worker did publish its
record as well, billing's ledger keeps the worker's count) and raises `Unavailable`, well
before the idle timeout.

The router is watched the same way until it has answered, when the caller names the router
instance it sends to (`router_id`: ingress picks one of those it hears beating): a router
killed while routing is known within `liveness_timeout_s`, not at the route timeout. A
router named but gone already (no responders) passes the request to any router.

Whenever the caller stops waiting before the stream ended (cancelled, deadline, stall, lost
worker) it broadcasts `CancelRequest`, so every hop stops work it no longer owes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import msgspec

from shared import telemetry
from shared.blocks import RequestBlocks
from shared.bus import Bus, now_ms
from shared.logging import get_logger
from shared.schema import (
    CacheProbe,
    CancelRequest,
    DeadlineExceeded,
    DecodeStats,
    GenerateRequest,
    InstanceState,
    LoadReport,
    NoResponders,
    Overloaded,
    Resume,
    RouteDecision,
    SamplingParams,
    ServiceError,
    StreamGap,
    TokenChunk,
    TokenUsage,
    Unavailable,
    UsageStatus,
    num_packed_tokens,
    pack_token_ids,
    unpack_token_ids,
)
from shared.streams import STREAM_ENDED, ChunkReader
from shared.subjects import DECODE, INGRESS, ROUTER, VLLM_WORKER
from shared.telemetry import REQUEST_ID
from shared.usage import usage_publisher, usage_record
from shared.usage_outbox import UsageOutbox

log = get_logger(__name__)
PROBE_MIN_S = 0.02  # a stall shorter than this is never probed


@dataclass
class GenerateResult:
    request_id: str
    decision: RouteDecision
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    usage: TokenUsage | None = None
    stats: DecodeStats | None = None
    stop_sequence: str | None = None  # the stop string that ended the output
    ttft_s: float | None = None  # request sent -> first chunk with tokens (None: no tokens)
    total_s: float = 0.0
    num_failovers: int = 0  # continuations after a decode worker died mid-stream


def build_request(
    token_ids: Sequence[int],
    *,
    model: str,
    block_size_tokens: int = 64,
    max_tokens: int = 64,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int | None = None,
    seed: int | None = None,
    stop: Sequence[str] = (),
    cache_salt: str = "",
    request_id: str | None = None,
    deadline_s: float | None = None,
    api_key_id: str = "",
    account: str = "",
    cache_probe: CacheProbe | None = None,
    session: str = "",
) -> GenerateRequest:
    """A `GenerateRequest` for a tokenized prompt: packed ids, the chained block hashes the
    router matches against the KV cache (the one place on the request path that hashes the
    prompt), arrival and (relative `deadline_s`) deadline. `session`: the caller's agent
    session id, sent only as `session_digest(account, session)`."""
    packed = pack_token_ids(token_ids)
    blocks = RequestBlocks.hash_prompt(
        packed, model=model, block_size_tokens=block_size_tokens, cache_salt=cache_salt
    )
    arrival_ms = now_ms()
    return GenerateRequest(
        request_id=request_id or uuid.uuid4().hex,
        model=model,
        prompt_token_ids=packed,
        block_hashes=blocks.packed(),
        block_size_tokens=block_size_tokens,
        sampling=SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            stop=tuple(stop),
        ),
        api_key_id=api_key_id,
        account=account,
        cache_salt=cache_salt,
        arrival_ms=arrival_ms,
        deadline_ms=None if deadline_s is None else arrival_ms + round(deadline_s * 1000),
        cache_probe=cache_probe,
        session=session_digest(account, session),
    )


def session_digest(account: str, session: str) -> str:
    """What a request carries of its session: 16 hex digits of SHA-256 over the account and
    the session id, so the raw id (a client's, maybe a user's) never leaves the caller and two
    accounts' equal ids stay apart; "" without a session."""
    if not session:
        return ""
    return hashlib.sha256(f"{account}\0{session}".encode()).hexdigest()[:16]


async def generate(
    bus: Bus,
    request: GenerateRequest,
    *,
    on_chunk: Callable[[TokenChunk], object] | None = None,
    on_decision: Callable[[RouteDecision], object] | None = None,
    liveness_timeout_s: float = 3.0,
    first_chunk_timeout_s: float = 600.0,
    idle_timeout_s: float = 60.0,
    # The router answers within its kv-index match (0.5 s) and two decode accepts (5 s
    # each); past this its reply was lost (a NATS server died with it in flight).
    route_timeout_s: float = 12.0,
    overload_wait_s: float = 30.0,
    outbox: UsageOutbox | None = None,
    router_id: str | None = None,
    router_seq: int = 0,
    max_failovers: int = 2,
    failover_recompute: bool = False,
    probe_after_s: float = 0.25,
) -> GenerateResult:
    """Run one request through the cluster; `on_chunk(chunk)` sees every chunk as it comes,
    `on_decision(decision)` the router's answer once it has come (a caller that must answer
    its own client before the first token, as ingress does, waits for it: from then on a
    failure is the stream's, not the router's refusal).

    `router_id`: send to that router instance and watch its heartbeats until it answers
    (None: any router, through the queue group, unwatched); `router_seq`: the seq of its
    last heartbeat the caller saw (a report numbered lower comes from a new process).

    `outbox` keeps the usage record of a stream whose decode worker died until JetStream has
    it (ingress and `kvfabric generate` pass theirs); without one it is published once.

    When the router turns the request away as `Overloaded` (nothing started anywhere), wait
    its `retry_after_s` and send it again, for at most `overload_wait_s` in all (and never
    past the request's deadline); 0 gives up at the first refusal.

    When the decode worker dies mid-stream, the request continues (at most
    `max_failovers` times) as a new request whose prompt is the old one and the tokens
    already delivered (`GenerateRequest.resume`): its prefix is the blocks decode wrote
    through to the store, so only the last partial block is recomputed, and the chunks go
    on to `on_chunk` with nothing lost or repeated. `failover_recompute` (benchmarks' peer)
    makes the continuation miss the cache and recompute the whole context, as vLLM and
    Dynamo migrate. A stalled stream is probed after four of its usual intervals between
    chunks, at most `probe_after_s`: a worker whose process is gone is known then (no
    responders), not `liveness_timeout_s` later; one that answers twice that it has ended
    the stream (its last chunks lost in flight) raises `StreamGap`, retryable, and is not
    continued (the worker billed what it sent).

    Raises the router's typed error (`Overloaded` with `retry_after_s` once the wait is
    spent, `BadRequest`, `NoResponders` when no router runs), the stream's
    (`StreamWriter.fail` on decode, or an error the router sent through it), `Unavailable`
    when the decode worker stops heartbeating, `StreamStalled` / `DeadlineExceeded` from the
    reader.
    """
    with telemetry.span("client generate") as span:
        if span.is_recording():
            span.set_attributes(
                {
                    REQUEST_ID: request.request_id,
                    "kvfabric.model": request.model,
                    "kvfabric.num_prompt_tokens": num_packed_tokens(request.prompt_token_ids),
                }
            )
        result = await _generate(
            bus,
            request,
            on_chunk,
            on_decision,
            _Limits(
                liveness_timeout_s,
                first_chunk_timeout_s,
                idle_timeout_s,
                route_timeout_s,
                overload_wait_s,
                probe_after_s,
            ),
            outbox,
            router_id,
            router_seq,
            _Failover(max_failovers, failover_recompute),
        )
        if span.is_recording():
            decision = result.decision
            span.set_attributes(
                {
                    "kvfabric.hit_tokens": decision.num_cached_tokens,
                    "kvfabric.prefill_worker_id": decision.prefill_worker_id,
                    "kvfabric.decode_worker_id": decision.decode_worker_id,
                    "kvfabric.num_output_tokens": len(result.token_ids),
                    "kvfabric.finish_reason": result.finish_reason or "",
                    "kvfabric.num_failovers": result.num_failovers,
                }
            )
            if result.ttft_s is not None:
                span.set_attribute("kvfabric.ttft_ms", round(result.ttft_s * 1000, 3))
        return result


async def _generate(
    bus: Bus,
    request: GenerateRequest,
    on_chunk: Callable[[TokenChunk], object] | None,
    on_decision: Callable[[RouteDecision], object] | None,
    limits: _Limits,
    outbox: UsageOutbox | None,
    router_id: str | None,
    router_seq: int,
    failover: _Failover,
) -> GenerateResult:
    """`generate`: the request, then its continuations while its decode worker dies."""
    delivered = _Delivered(request)
    while True:
        try:
            result = await _send(
                bus,
                request,
                on_chunk,
                on_decision if not delivered.attempts else None,
                limits,
                router_id if not delivered.attempts else None,
                router_seq,
            )
            return delivered.result(result)
        except _DecodeLost as lost:
            delivered.add(lost)
            continuation = failover.continuation(request, lost, delivered)
            if continuation is None:
                await _bill_delivered(bus, outbox, delivered, lost.decision)
                raise Unavailable(f"{lost.reason} after {delivered.num_tokens} tokens") from None
            log.warning(
                "decode worker lost: continuing the request",
                request_id=request.request_id,
                decode_worker_id=lost.decision.decode_worker_id,
                num_delivered_tokens=delivered.num_tokens,
                attempt=delivered.attempts,
            )
            telemetry.current_span().add_event(
                "failover", {"kvfabric.num_delivered_tokens": delivered.num_tokens}
            )
            request = continuation
        except _NotRouted as failed:  # a continuation nobody took: bill what was delivered
            await _bill_delivered(bus, outbox, delivered, None)
            raise failed.error from None


async def _send(
    bus: Bus,
    request: GenerateRequest,
    on_chunk: Callable[[TokenChunk], object] | None,
    on_decision: Callable[[RouteDecision], object] | None,
    limits: _Limits,
    router_id: str | None,
    router_seq: int,
) -> GenerateResult:
    """One request (or continuation): sends until the router takes it or the overload wait
    is spent."""
    waited_s = 0.0
    while True:
        call: _Generation | None = None
        inbox = await bus.open_inbox()
        try:
            attempt = msgspec.structs.replace(request, stream_inbox=inbox.subject)
            reader = ChunkReader(
                inbox,
                TokenChunk,
                f"the stream of {request.request_id}",
                first_chunk_timeout_s=limits.first_chunk_timeout_s,
                idle_timeout_s=limits.idle_timeout_s,
                deadline_ms=request.deadline_ms,
            )
            call = _Generation(
                bus,
                attempt,
                reader,
                on_chunk,
                on_decision,
                limits,
                router_id,
                router_seq,
            )
            return await call.run()
        except Overloaded as exc:
            wait_s = _overload_wait_s(exc, request.deadline_ms, limits.overload_wait_s - waited_s)
            if call is None or not call.refused_by_router or wait_s is None:
                if not_routed := _not_routed(exc, request, call):
                    raise not_routed from None
                raise
            log.info(
                "router overloaded: sending again",
                request_id=request.request_id,
                wait_s=round(wait_s, 3),
                reason=exc.message,
            )
            telemetry.current_span().add_event("overloaded", {"kvfabric.wait_s": round(wait_s, 3)})
        except _RouterStopped as stopped:
            log.info(
                "router stopped before the request reached it: sending again",
                request_id=request.request_id,
                router_id=str(stopped),
            )
            router_id, wait_s = None, 0.0
        except (_DecodeLost, asyncio.CancelledError):
            raise
        except Exception as exc:
            if not_routed := _not_routed(exc, request, call):
                raise not_routed from None
            raise
        finally:
            await inbox.close()
        await asyncio.sleep(wait_s)
        waited_s += wait_s


def _not_routed(
    exc: Exception, request: GenerateRequest, call: _Generation | None
) -> _NotRouted | None:
    """`exc` as `_NotRouted` when it means no worker took a continuation (the caller then
    bills what was delivered); None when it is the request's own error to raise."""
    if request.resume is not None and (call is None or call.decision is None):
        return _NotRouted(exc)
    return None


def _overload_wait_s(exc: Overloaded, deadline_ms: int | None, budget_s: float) -> float | None:
    """How long to wait before sending a refused request again; None: give up."""
    wait_s = exc.retry_after_s if exc.retry_after_s is not None else 1.0
    if deadline_ms is not None:
        budget_s = min(budget_s, (deadline_ms - now_ms()) / 1000)
    return wait_s if wait_s <= budget_s else None


class _Generation:
    """The state of one `generate` call: what arrived so far and the tasks awaiting more."""

    def __init__(
        self,
        bus: Bus,
        request: GenerateRequest,
        reader: ChunkReader[TokenChunk],
        on_chunk: Callable[[TokenChunk], object] | None,
        on_decision: Callable[[RouteDecision], object] | None,
        limits: _Limits,
        router_id: str | None = None,
        router_seq: int = 0,
    ) -> None:
        self.bus = bus
        self.router_id = router_id
        self.router_seq = router_seq  # its last heartbeat's seq as the caller knew it
        self.limits = limits
        self.decision: RouteDecision | None = None
        self.last_chunk_at = time.monotonic()
        self.chunk_interval_s: float | None = None  # between chunks, smoothed
        self.request = request
        self.reader = reader
        self.on_chunk = on_chunk
        self.token_ids: list[int] = []
        self.texts: list[str] = []
        self.last_chunk: TokenChunk | None = None
        self.started_at = time.monotonic()  # made just before `run` sends the request
        self.started_ms = now_ms()
        self.first_token_at: float | None = None
        self.refused_by_router = False  # the router answered an error: nothing was started
        self.on_decision = on_decision

    async def _route(self) -> RouteDecision:
        bus, request = self.bus, self.request
        pooled = bus.subjects.router_generate

        async def send(subject: str) -> RouteDecision:
            return await bus.request(
                subject,
                request,
                RouteDecision,
                timeout_s=self.limits.route_timeout_s,
                request_id=request.request_id,
                deadline_ms=request.deadline_ms,
            )

        if self.router_id is None:
            return await send(pooled)
        try:
            return await send(bus.subjects.instance(pooled, self.router_id))
        except NoResponders:  # it went away since its last heartbeat: nothing reached it
            self.router_id = None
            return await send(pooled)

    async def _watch_router(self, route: asyncio.Task[RouteDecision]) -> bool:
        """Returns once the router we sent to has been silent for `liveness_timeout_s`
        before answering (killed while routing), or beats again as a new process (its seq
        starts over: restarted within the timeout, it never saw our request), or says it
        stopped having answered all it received (True: the request never reached it, as
        when a router left while our request was on the way to it through another NATS
        server); runs for as long as `route` does."""
        liveness = _Liveness(self.limits.liveness_timeout_s, self.router_seq)
        subscription = await self.bus.subscribe(
            self.bus.subjects.load(ROUTER, self.router_id or ""), LoadReport, liveness.on_beat
        )
        try:
            while not route.done() and self.router_id is not None:
                if (wait_s := liveness.wait_s()) <= 0:
                    return liveness.stopped
                await asyncio.sleep(min(wait_s, 0.25))
            await asyncio.Event().wait()  # answered (or sent on to any router): never fires
        finally:
            await self.bus.unsubscribe(subscription)

    async def run(self) -> GenerateResult:
        bus, request = self.bus, self.request
        route = asyncio.create_task(self._route())
        read = asyncio.create_task(self._read())
        router_watch = (
            asyncio.create_task(self._watch_router(route)) if self.router_id is not None else None
        )
        watch: asyncio.Task[None] | None = None
        heartbeats = None
        try:
            waits = {route, read} | ({router_watch} if router_watch else set())
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            if router_watch is not None and router_watch.done() and not route.done():
                if router_watch.result():
                    raise _RouterStopped(self.router_id or "")
                raise Unavailable(
                    f"router {self.router_id} stopped responding (no heartbeat for "
                    f"{self.limits.liveness_timeout_s:.1f}s, or restarted) before it routed the "
                    "request",
                    retry_after_s=1.0,
                )
            if not route.done():  # the stream ended first: an error, or a very short answer
                read.result()
            decision = self.decision = await route
            if self.on_decision is not None:
                self.on_decision(decision)
            if not read.done():
                liveness = _Liveness(self.limits.liveness_timeout_s)
                streamer = VLLM_WORKER if decision.aggregated else DECODE
                heartbeats = await bus.subscribe(
                    bus.subjects.load(streamer, decision.decode_worker_id),
                    LoadReport,
                    liveness.on_beat,
                )
                watch = asyncio.create_task(self._watch_heartbeats(liveness, streamer, decision))
                await asyncio.wait({read, watch}, return_when=asyncio.FIRST_COMPLETED)
                if not read.done():
                    raise _DecodeLost(
                        f"decode worker {decision.decode_worker_id} stopped responding "
                        f"({watch.result()})",
                        decision,
                        self.token_ids,
                        "".join(self.texts),
                    )
            read.result()
            return self._result(decision)
        except asyncio.CancelledError:
            await self._cancel(CancelRequest(request_id=request.request_id))
            raise
        except Exception as exc:
            self.refused_by_router = _router_refused(route)
            # A router that stopped never had it: nothing to cancel, and a cancel could
            # reach the attempt sent next under the same request id.
            nothing_sent = self.refused_by_router or isinstance(exc, _RouterStopped)
            if not self.reader.has_final and not nothing_sent:
                typed = isinstance(exc, ServiceError)
                await self._cancel(
                    CancelRequest(
                        request_id=request.request_id,
                        reason="caller stopped waiting",
                        error_code=str(exc.code if typed else "INTERNAL"),
                        error_message=exc.message if typed else "the caller failed",
                    )
                )
            raise
        finally:
            tasks = [t for t in (route, read, watch, router_watch) if t is not None]
            for task in tasks:
                if not task.done():
                    task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if heartbeats is not None:
                await self.bus.unsubscribe(heartbeats)

    async def _read(self) -> None:
        while (chunk := await self.reader.next()) is not None:
            now = time.monotonic()
            if self.first_token_at is not None:
                interval_s = now - self.last_chunk_at
                smoothed = self.chunk_interval_s
                self.chunk_interval_s = (
                    interval_s if smoothed is None else 0.8 * smoothed + 0.2 * interval_s
                )
            self.last_chunk_at = now
            ids = unpack_token_ids(chunk.token_ids).tolist()
            if ids and self.first_token_at is None:
                self.first_token_at = time.monotonic()
            self.token_ids.extend(ids)
            self.texts.append(chunk.text)
            self.last_chunk = chunk
            if self.on_chunk is not None:
                self.on_chunk(chunk)

    async def _watch_heartbeats(
        self, liveness: _Liveness, streamer: str, decision: RouteDecision
    ) -> str:
        """Returns (why) once the decode worker is gone: silent for `liveness_timeout_s`,
        beating as a new process (restarted: the stream died with the old one), or, probed
        once the stream has stalled (`_probe_after_s`; then twice as long after each answer),
        answered for by NATS with no responders (its process died, and its subscriptions
        with its connection). Raises `StreamGap` when the worker answers two probes in a
        row that it has ended the stream the caller still waits on."""
        ping = self.bus.subjects.ping(decision.decode_worker_id)
        backoff = 1.0  # doubles with each answered probe until the stream moves again
        num_ended = 0  # answers in a row that the worker's stream has ended
        last_chunk_at = self.last_chunk_at
        while (wait_s := liveness.wait_s()) > 0:
            if self.last_chunk_at != last_chunk_at:
                backoff, num_ended, last_chunk_at = 1.0, 0, self.last_chunk_at
            stalled_s = time.monotonic() - self.last_chunk_at
            probe_s = backoff * self._probe_after_s()
            if stalled_s < probe_s:
                await asyncio.sleep(min(wait_s, probe_s - stalled_s))
                continue
            try:
                answer = await self.bus.request(
                    ping, self.request.request_id.encode(), bytes, timeout_s=min(wait_s, 1.0)
                )
            except NoResponders:
                return f"{streamer} process gone: no responders"
            except ServiceError:  # no answer in time, or our own connection is down
                pass
            else:
                backoff *= 2
                num_ended = num_ended + 1 if answer == STREAM_ENDED else 0
                # Twice, a probe apart: the first answer can overtake the reader's last
                # chunks, already received but not yet read.
                if num_ended == 2:
                    raise StreamGap(
                        f"the end of the stream from {decision.decode_worker_id} was lost "
                        f"(it ended the stream; chunk {self.reader.num_received} never came)"
                    )
        if liveness.restarted:
            return "restarted"
        return f"no heartbeat for {self.limits.liveness_timeout_s:.1f}s"

    def _probe_after_s(self) -> float:
        """How long a stall is before the worker is probed: four of its usual intervals
        between chunks (a stream of 20 ms steps is probed after 80 ms), at most
        `probe_after_s`; `probe_after_s` until two chunks have come."""
        if self.chunk_interval_s is None:
            return self.limits.probe_after_s
        return min(self.limits.probe_after_s, max(PROBE_MIN_S, 4 * self.chunk_interval_s))

    async def _cancel(self, cancel: CancelRequest) -> None:
        try:
            await self.bus.publish(self.bus.subjects.cancel, cancel)
        except Exception as exc:  # a closed connection must not hide the original error
            log.warning("cancel not sent", request_id=cancel.request_id, error=str(exc))

    def _result(self, decision: RouteDecision) -> GenerateResult:
        final = self.last_chunk
        return GenerateResult(
            request_id=self.request.request_id,
            decision=decision,
            token_ids=self.token_ids,
            text="".join(self.texts),
            finish_reason=final.finish_reason if final else None,
            usage=final.usage if final else None,
            stats=final.stats if final else None,
            stop_sequence=final.stop_sequence if final else None,
            ttft_s=None if self.first_token_at is None else self.first_token_at - self.started_at,
            total_s=time.monotonic() - self.started_at,
        )


class _DecodeLost(Exception):
    """The decode worker died mid-stream: what it delivered before."""

    def __init__(
        self, reason: str, decision: RouteDecision, token_ids: list[int], text: str
    ) -> None:
        super().__init__(reason)
        self.reason = reason
        self.decision = decision
        self.token_ids = token_ids
        self.text = text


class _RouterStopped(Exception):
    """The router we sent to stopped without having received the request: send it again."""


class _NotRouted(Exception):
    """A continuation no worker took (the router refused it, or none answered)."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


class _Delivered:
    """What a request's client has received over its attempts (the original request's and
    its continuations'), and what it is billed for when no worker can go on."""

    def __init__(self, request: GenerateRequest) -> None:
        self.original = request
        self.attempts = 0  # failovers so far
        self.token_ids: list[int] = []
        self.texts: list[str] = []
        self.first: GenerateResult | None = None
        self.decision: RouteDecision | None = None  # the original's

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def add(self, lost: _DecodeLost) -> None:
        self.attempts += 1
        self.decision = self.decision or lost.decision
        self.token_ids += lost.token_ids
        self.texts.append(lost.text)

    def result(self, last: GenerateResult) -> GenerateResult:
        if not self.attempts:
            return last
        return dataclasses.replace(
            last,
            request_id=self.original.request_id,
            token_ids=self.token_ids + last.token_ids,
            text="".join(self.texts) + last.text,
            num_failovers=self.attempts,
        )


@dataclass(frozen=True)
class _Limits:
    """How long a `generate` call waits for each thing (see `generate`'s arguments)."""

    liveness_timeout_s: float
    first_chunk_timeout_s: float
    idle_timeout_s: float
    route_timeout_s: float
    overload_wait_s: float
    probe_after_s: float


@dataclass(frozen=True)
class _Failover:
    max_failovers: int
    recompute: bool  # the continuation misses the cache (the peers' migration)

    def continuation(
        self, request: GenerateRequest, lost: _DecodeLost, delivered: _Delivered
    ) -> GenerateRequest | None:
        """The request that goes on from what was delivered; None when none can."""
        num_left = request.sampling.max_tokens - len(lost.token_ids)
        if delivered.attempts > self.max_failovers or num_left <= 0:
            return None
        token_ids = unpack_token_ids(request.prompt_token_ids).tolist() + lost.token_ids
        original = delivered.decision or lost.decision
        resume = request.resume or Resume(
            num_prompt_tokens=original.num_prompt_tokens,
            num_cached_tokens=original.num_cached_tokens,
            num_output_tokens=0,
            attempt=0,
        )
        cache_salt = request.cache_salt
        if self.recompute:
            cache_salt = f"{request.cache_salt}/failover-{uuid.uuid4().hex}"
        packed = pack_token_ids(token_ids)
        blocks = RequestBlocks.hash_prompt(
            packed,
            model=request.model,
            block_size_tokens=request.block_size_tokens,
            cache_salt=cache_salt,
        )
        return msgspec.structs.replace(
            request,
            prompt_token_ids=packed,
            block_hashes=blocks.packed(),
            cache_salt=cache_salt,
            sampling=msgspec.structs.replace(request.sampling, max_tokens=num_left),
            resume=Resume(
                num_prompt_tokens=resume.num_prompt_tokens,
                num_cached_tokens=resume.num_cached_tokens,
                num_output_tokens=resume.num_output_tokens + len(lost.token_ids),
                num_output_chars=resume.num_output_chars + len(lost.text),
                attempt=resume.attempt + 1,
            ),
        )


async def _bill_delivered(
    bus: Bus,
    outbox: UsageOutbox | None,
    delivered: _Delivered,
    decision: RouteDecision | None,
) -> None:
    """Record the usage of what arrived, as the decode worker would have, when none will:
    the original prompt and hits, every token delivered over the attempts."""
    original = delivered.decision or decision
    if original is None:
        return
    last = decision or original
    record = usage_record(
        delivered.original,
        num_prompt_tokens=original.num_prompt_tokens,
        num_cached_tokens=original.num_cached_tokens,
        num_output_tokens=delivered.num_tokens,
        status=UsageStatus.FAILED,
        finish_reason="error",
        prefill_worker_id=last.prefill_worker_id,
        decode_worker_id=last.decode_worker_id,
        started_ms=delivered.original.arrival_ms or now_ms(),
    )
    telemetry.keep_context(record.request_id)  # billing's span continues this trace
    try:
        if outbox is not None:
            await outbox.add(record)  # durable now; published until JetStream has it
        else:
            await usage_publisher(bus, INGRESS)(record)
    except Exception:  # without an outbox, or with its disk failing: said loudly, in full
        log.exception("usage of a lost stream not recorded", record=str(record))


class _Liveness:
    """One instance's heartbeats as a caller waiting on it sees them: alive while it beats
    within `timeout_s`; gone once silent that long, or once a report comes numbered below
    the last (a new process under the same id: what the old one held is lost)."""

    def __init__(self, timeout_s: float, last_seq: int = 0) -> None:
        self.timeout_s = timeout_s
        self.last_seq = last_seq
        self.last_beat_at = time.monotonic()
        self.restarted = False
        self.stopped = False  # it said it answered all it received and stopped

    async def on_beat(self, report: LoadReport) -> None:
        if report.state == InstanceState.STOPPED:
            self.stopped = True
        if report.seq < self.last_seq:
            self.restarted = True
        self.last_seq = max(self.last_seq, report.seq)
        self.last_beat_at = time.monotonic()

    def wait_s(self) -> float:
        """How long it may stay silent yet; 0 once it is gone."""
        if self.restarted or self.stopped:
            return 0.0
        return max(self.timeout_s - (time.monotonic() - self.last_beat_at), 0.0)


def _router_refused(route: asyncio.Task[RouteDecision]) -> bool:
    """The router answered with an error: no worker took the job, nothing to cancel. (A
    timeout is not a refusal: the router may have forwarded the job.)"""
    if not route.done() or route.cancelled():
        return False
    error = route.exception()
    return error is not None and not isinstance(error, DeadlineExceeded)
