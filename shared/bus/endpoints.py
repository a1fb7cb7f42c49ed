"""Request/reply endpoints, the server side of the bus.

An endpoint is served in its service's queue group AND on the instance's own subject
(`<subject>.<instance_id>`); each request runs in its own task. The handler returns the reply
struct (None: an empty reply); a `ServiceError` it raises reaches the caller as the
`Nats-Service-Error(-Code)` headers, anything else as INTERNAL with a fixed message (the
trace goes to the log once, never to the caller). A malformed payload gets BAD_REQUEST and
the endpoint keeps serving; the absolute deadline header is enforced; the W3C trace context
continues in a server span.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from shared import telemetry
from shared.bus.connection import abandon_pings
from shared.bus.wire import HEADER_DEADLINE_MS, HEADER_REQUEST_ID, error_headers, now_ms
from shared.logging import bind_request, get_logger
from shared.schema import (
    BadRequest,
    DeadlineExceeded,
    InternalError,
    ServiceError,
    decode,
    encode,
)
from shared.subjects import Subjects, queue_group

log = get_logger(__name__)

Handler = Callable[[Any, "Context"], Awaitable[Any]]
DRAIN_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class Context:
    """What a handler knows about the request besides its payload."""

    subject: str
    request_id: str
    deadline_ms: int | None
    reply: str | None
    headers: dict[str, str]

    def remaining_s(self) -> float | None:
        return None if self.deadline_ms is None else (self.deadline_ms - now_ms()) / 1000


@dataclass(frozen=True)
class Endpoint:
    """`handler(request, ctx)` answers a `request_type` request on `subject`."""

    name: str
    subject: str
    request_type: type
    handler: Handler


@dataclass
class EndpointStats:
    name: str
    subject: str
    queue_group: str
    num_requests: int = 0
    num_errors: int = 0
    processing_time_ns: int = 0
    last_error: str = ""
    num_errors_by_code: dict[str, int] = field(default_factory=dict)  # ErrorCode value -> count


class EndpointServer:
    """A service's endpoints on one connection, and their in-flight requests."""

    def __init__(self, nc: Client, subjects: Subjects, service: str, instance_id: str) -> None:
        self._nc = nc
        self._subjects = subjects
        self._service = service
        self._instance_id = instance_id
        self._subscriptions: list[Subscription] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._stats: dict[str, EndpointStats] = {}

    @property
    def num_inflight(self) -> int:
        return len(self._tasks)

    def stats(self) -> list[EndpointStats]:
        return list(self._stats.values())

    async def serve(self, endpoint: Endpoint) -> None:
        group = queue_group(self._service)
        self._stats[endpoint.name] = EndpointStats(endpoint.name, endpoint.subject, group)

        async def on_message(msg: Msg) -> None:
            # nats-py runs one subscription's callbacks one after another: hand each request
            # to its own task so a slow request does not hold up the next.
            task = asyncio.create_task(self._handle(endpoint, msg))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

        instance_subject = self._subjects.instance(endpoint.subject, self._instance_id)
        self._subscriptions.append(
            await self._nc.subscribe(endpoint.subject, queue=group, cb=on_message)
        )
        self._subscriptions.append(await self._nc.subscribe(instance_subject, cb=on_message))

    async def _handle(self, endpoint: Endpoint, msg: Msg) -> None:
        headers = dict(msg.headers or {})
        stats = self._stats[endpoint.name]
        stats.num_requests += 1
        started_ns = time.perf_counter_ns()
        raw_deadline = headers.get(HEADER_DEADLINE_MS)
        deadline_ms = int(raw_deadline) if raw_deadline and raw_deadline.isdigit() else None
        ctx = Context(
            subject=msg.subject,
            request_id=headers.get(HEADER_REQUEST_ID, ""),
            deadline_ms=deadline_ms,
            reply=msg.reply or None,
            headers=headers,
        )
        try:
            with telemetry.server_span(endpoint.name, endpoint.subject, headers, ctx.request_id):
                bind_request(ctx.request_id, telemetry.current_trace_id())
                if raw_deadline is not None and deadline_ms is None:
                    raise BadRequest(
                        f"{HEADER_DEADLINE_MS} {raw_deadline!r} is not epoch milliseconds"
                    )
                await self._run(endpoint, msg, ctx)
        except ServiceError as exc:
            stats.num_errors += 1
            stats.last_error = f"{exc.code}: {exc.message}"
            code = str(exc.code)
            stats.num_errors_by_code[code] = stats.num_errors_by_code.get(code, 0) + 1
            log.warning(
                "request failed", endpoint=endpoint.name, code=str(exc.code), error=exc.message
            )
            await self._reply_error(ctx, exc)
        except Exception:
            stats.num_errors += 1
            stats.last_error = "INTERNAL: internal error"
            stats.num_errors_by_code["INTERNAL"] = stats.num_errors_by_code.get("INTERNAL", 0) + 1
            log.exception("request crashed", endpoint=endpoint.name)
            await self._reply_error(ctx, InternalError("internal error"))
        finally:
            stats.processing_time_ns += time.perf_counter_ns() - started_ns

    async def _run(self, endpoint: Endpoint, msg: Msg, ctx: Context) -> None:
        remaining_s = ctx.remaining_s()
        if remaining_s is not None and remaining_s <= 0:
            raise DeadlineExceeded(
                f"deadline passed {-remaining_s:.3f}s before {endpoint.name} started"
            )
        try:
            request = decode(msg.data, endpoint.request_type)
        except msgspec.DecodeError as exc:
            raise BadRequest(f"malformed {endpoint.request_type.__name__}: {exc}") from exc
        try:
            async with asyncio.timeout(remaining_s):
                reply = await endpoint.handler(request, ctx)
        except TimeoutError as exc:
            raise DeadlineExceeded(f"{endpoint.name} ran past its deadline") from exc
        if ctx.reply:
            await self._nc.publish(ctx.reply, b"" if reply is None else encode(reply))

    @staticmethod
    async def _drain(subscription: Subscription) -> None:
        try:
            await subscription.drain()
        except nats.errors.Error as exc:
            log.warning("endpoint drain failed", subject=subscription.subject, error=str(exc))

    async def _reply_error(self, ctx: Context, exc: ServiceError) -> None:
        if not ctx.reply or self._nc.is_closed:
            return
        await self._nc.publish(
            ctx.reply, encode(exc.to_reply(ctx.request_id)), headers=error_headers(exc)
        )

    async def stop(self, grace_s: float) -> bool:
        """Stop taking work (leave the queue groups, let already queued messages start), then
        wait up to `grace_s` for in-flight requests; cancel what is still running. True when
        every subscription drained and every request finished on its own. Bounded by
        `grace_s` even when the server is gone (a drain then waits out its flush timeout:
        10 s per subscription, seen when a killed `kvfabric up` took its server along)."""
        subscriptions, self._subscriptions = self._subscriptions, []
        started = time.monotonic()
        clean = True
        if self._nc.is_connected:
            # A drain is an UNSUB and a round trip (milliseconds); one still waiting after
            # DRAIN_TIMEOUT_S lost its server on the way (its flush is then ended).
            drains = {asyncio.create_task(self._drain(s)) for s in subscriptions}
            if drains:
                _, late = await asyncio.wait(drains, timeout=min(grace_s, DRAIN_TIMEOUT_S))
                clean = not late
                if late and not self._nc.is_connected:
                    abandon_pings(self._nc)
                    log.warning("server gone while draining endpoints", num_late=len(late))
        elif subscriptions:
            clean = False
            log.warning("not connected: endpoints stop without draining")
        grace_s = max(grace_s - (time.monotonic() - started), 0.0)
        if self._tasks:
            _, pending = await asyncio.wait(set(self._tasks), timeout=grace_s)
            for task in pending:
                task.cancel()
            if pending:
                log.warning(
                    "cancelled requests still running after grace", num_cancelled=len(pending)
                )
                await asyncio.gather(*pending, return_exceptions=True)
                clean = False
        return clean
