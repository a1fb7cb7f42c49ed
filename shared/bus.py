"""The bus: the only module that imports `nats`.

What it gives a service:
- `Bus.connect`: one NATS connection with a reconnect policy (retries the first connect too,
  so a service may start before its server).
- `serve(Endpoint)`: a request/reply endpoint served in the service's queue group AND on the
  instance's own subject; one task per request; typed errors become `Nats-Service-Error(-Code)`
  headers; a malformed payload gets BAD_REQUEST and the endpoint keeps serving; the absolute
  deadline header is enforced; the W3C trace context continues in a server span.
- `request`: the caller's side, raising the typed `ServiceError` the server sent, or
  `NoResponders` / `DeadlineExceeded`.
- `publish` / `subscribe`: events (fan-out, decoded into structs).
- `open_inbox` / `publish_raw` / `scatter`: the primitives of `shared.streams` and
  `shared.discovery`.
- `stop_serving` then `close`: stop taking work, finish in-flight work within a grace
  period, drain the connection. Both safe to repeat.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec
import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.api import ConsumerConfig, DeliverPolicy, StreamConfig

from shared import telemetry
from shared.logging import bind_request, get_logger
from shared.schema import (
    BadRequest,
    DeadlineExceeded,
    ErrorReply,
    InternalError,
    NoResponders,
    ServiceError,
    Unavailable,
    decode,
    encode,
    error_from_wire,
    schema_header,
)
from shared.subjects import DEFAULT_ROOT, Subjects, queue_group

if TYPE_CHECKING:
    from shared.streams import StreamWriter

log = get_logger(__name__)

HEADER_REQUEST_ID = "Kvf-Request-Id"
HEADER_DEADLINE_MS = "Kvf-Deadline-Ms"  # absolute, epoch milliseconds
HEADER_SCHEMA = "Kvf-Schema"
HEADER_SEQ = "Kvf-Seq"
HEADER_FINAL = "Kvf-Final"
ERROR_HEADER = "Nats-Service-Error"
ERROR_CODE_HEADER = "Nats-Service-Error-Code"
STATUS_HEADER = "Status"  # set by nats-py from the server's inline status line
NO_RESPONDERS_STATUS = "503"

T = TypeVar("T")
Handler = Callable[[Any, "Context"], Awaitable[Any]]


def now_ms() -> int:
    return int(time.time() * 1000)


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


class ReplyMode(StrEnum):
    UNARY = "unary"  # the handler returns the reply struct (None: an empty reply)
    STREAM = "stream"  # the handler is an async generator; its chunks go to the caller's inbox
    HANDOFF = "handoff"  # the handler passes the caller's inbox on; another service replies


@dataclass(frozen=True)
class Endpoint:
    """A request endpoint: `handler(request, ctx)` answers as `mode` says. Whatever the mode,
    a failure reaches the caller as a typed error (a final stream message for STREAM)."""

    name: str
    subject: str
    request_type: type
    handler: Handler
    mode: ReplyMode = ReplyMode.UNARY


@dataclass
class EndpointStats:
    name: str
    subject: str
    queue_group: str
    num_requests: int = 0
    num_errors: int = 0
    processing_time_ns: int = 0
    last_error: str = ""


@dataclass(frozen=True)
class RawMessage:
    subject: str
    data: bytes
    reply: str | None
    headers: dict[str, str] = field(default_factory=dict)


class Inbox:
    """A fresh subscription whose messages are read one at a time (stream consumers)."""

    def __init__(self, subject: str, subscription: Subscription) -> None:
        self.subject = subject
        self._subscription = subscription

    async def next(self, timeout_s: float) -> RawMessage | None:
        """The next message, or None when `timeout_s` passes first."""
        try:
            msg = await self._subscription.next_msg(timeout=timeout_s)
        except nats.errors.TimeoutError:
            return None
        return _raw(msg)

    async def close(self) -> None:
        # Already gone is fine: closing twice is allowed.
        with contextlib.suppress(nats.errors.BadSubscriptionError):
            await self._subscription.unsubscribe()


class Bus:
    def __init__(self, nc: Client, *, subjects: Subjects, service: str, instance_id: str) -> None:
        self._nc = nc
        self.subjects = subjects
        self.service = service
        self.instance_id = instance_id
        self._endpoint_subscriptions: list[Subscription] = []
        self._event_subscriptions: list[Subscription] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._stats: dict[str, EndpointStats] = {}
        self._is_serving = True

    # -- connection ----------------------------------------------------------------------
    @classmethod
    async def connect(
        cls,
        url: str,
        *,
        service: str,
        instance_id: str | None = None,
        root: str = DEFAULT_ROOT,
        connect_timeout_s: float = 10.0,
        reconnect_wait_s: float = 0.5,
    ) -> Bus:
        """Connect, retrying until `connect_timeout_s`; once connected, reconnect forever."""
        instance_id = instance_id or f"{service}-{uuid.uuid4().hex[:8]}"
        deadline = time.monotonic() + connect_timeout_s
        connected: list[Client] = []
        while True:
            try:
                # nats-py retries a first connection forever when reconnects are unlimited:
                # bound it ourselves, or a wrong URL hangs the caller.
                remaining_s = max(deadline - time.monotonic(), 0.1)
                nc = await asyncio.wait_for(
                    nats.connect(
                        servers=[url],
                        name=f"{service}/{instance_id}",
                        allow_reconnect=True,
                        max_reconnect_attempts=-1,
                        reconnect_time_wait=reconnect_wait_s,
                        connect_timeout=min(2.0, connect_timeout_s),
                        error_cb=_log_error,
                        disconnected_cb=_log_disconnected(connected),
                        reconnected_cb=_log_reconnected,
                    ),
                    remaining_s,
                )
                connected.append(nc)
                break
            except (TimeoutError, OSError, nats.errors.NoServersError) as exc:
                if time.monotonic() >= deadline:
                    raise Unavailable(f"cannot connect to NATS at {url}: {exc}") from exc
                await asyncio.sleep(reconnect_wait_s)
        return cls(nc, subjects=Subjects(root), service=service, instance_id=instance_id)

    @property
    def is_connected(self) -> bool:
        return self._nc.is_connected

    @property
    def max_payload_bytes(self) -> int:
        return self._nc.max_payload

    @property
    def num_inflight(self) -> int:
        return len(self._tasks)

    def endpoint_stats(self) -> list[EndpointStats]:
        return list(self._stats.values())

    # -- serving -------------------------------------------------------------------------
    async def serve(self, endpoint: Endpoint) -> None:
        """Serve `endpoint` on its pooled subject (queue group = service) and on its
        instance subject (`<subject>.<instance_id>`, no queue group)."""
        group = queue_group(self.service)
        self._stats[endpoint.name] = EndpointStats(endpoint.name, endpoint.subject, group)

        async def on_message(msg: Msg) -> None:
            # nats-py runs one subscription's callbacks one after another: hand each request
            # to its own task so a slow request does not hold up the next.
            task = asyncio.create_task(self._handle(endpoint, msg))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

        self._endpoint_subscriptions.append(
            await self._nc.subscribe(endpoint.subject, queue=group, cb=on_message)
        )
        self._endpoint_subscriptions.append(
            await self._nc.subscribe(
                self.subjects.instance(endpoint.subject, self.instance_id), cb=on_message
            )
        )

    async def _handle(self, endpoint: Endpoint, msg: Msg) -> None:
        # Imported here: shared.streams builds on this module.
        from shared.streams import StreamWriter

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
        writer = None
        if endpoint.mode is ReplyMode.STREAM and ctx.reply:
            writer = StreamWriter(self, ctx.reply, request_id=ctx.request_id)
        try:
            with telemetry.server_span(endpoint.name, endpoint.subject, headers):
                bind_request(ctx.request_id, telemetry.current_trace_id())
                if raw_deadline is not None and deadline_ms is None:
                    raise BadRequest(
                        f"{HEADER_DEADLINE_MS} {raw_deadline!r} is not epoch milliseconds"
                    )
                await self._run(endpoint, msg, ctx, writer)
        except ServiceError as exc:
            stats.num_errors += 1
            stats.last_error = f"{exc.code}: {exc.message}"
            log.warning(
                "request failed", endpoint=endpoint.name, code=str(exc.code), error=exc.message
            )
            await self._reply_error(ctx, exc, writer)
        except Exception:
            stats.num_errors += 1
            stats.last_error = "INTERNAL: internal error"
            log.exception("request crashed", endpoint=endpoint.name)
            await self._reply_error(ctx, InternalError("internal error"), writer)
        finally:
            stats.processing_time_ns += time.perf_counter_ns() - started_ns

    async def _run(
        self, endpoint: Endpoint, msg: Msg, ctx: Context, writer: StreamWriter | None
    ) -> None:
        remaining_s = ctx.remaining_s()
        if remaining_s is not None and remaining_s <= 0:
            raise DeadlineExceeded(
                f"deadline passed {-remaining_s:.3f}s before {endpoint.name} started"
            )
        try:
            request = decode(msg.data, endpoint.request_type)
        except msgspec.DecodeError as exc:
            raise BadRequest(f"malformed {endpoint.request_type.__name__}: {exc}") from exc
        if endpoint.mode is not ReplyMode.UNARY and ctx.reply is None:
            raise BadRequest(f"{endpoint.name} replies on a stream: a reply inbox is required")
        try:
            async with asyncio.timeout(remaining_s):
                if writer is not None:
                    async for chunk in endpoint.handler(request, ctx):
                        await writer.send(chunk)
                    await writer.finish()
                    return
                reply = await endpoint.handler(request, ctx)
        except TimeoutError as exc:
            raise DeadlineExceeded(f"{endpoint.name} ran past its deadline") from exc
        if ctx.reply and endpoint.mode is ReplyMode.UNARY:
            await self._nc.publish(ctx.reply, b"" if reply is None else encode(reply))

    async def _reply_error(
        self, ctx: Context, exc: ServiceError, writer: StreamWriter | None
    ) -> None:
        if not ctx.reply or self._nc.is_closed:
            return
        if writer is not None:
            await writer.fail(exc)
        else:
            await self.publish_raw(
                ctx.reply, encode(exc.to_reply(ctx.request_id)), error_headers(exc)
            )

    async def stop_serving(self, grace_s: float) -> None:
        """Stop taking work (leave the queue groups, let already queued messages start), then
        wait up to `grace_s` for in-flight requests; cancel what is still running."""
        self._is_serving = False
        subscriptions, self._endpoint_subscriptions = self._endpoint_subscriptions, []
        for subscription in subscriptions:
            try:
                await subscription.drain()
            except nats.errors.Error as exc:
                log.warning("endpoint drain failed", subject=subscription.subject, error=str(exc))
        if self._tasks:
            _, pending = await asyncio.wait(set(self._tasks), timeout=grace_s)
            for task in pending:
                task.cancel()
            if pending:
                log.warning(
                    "cancelled requests still running after grace", num_cancelled=len(pending)
                )
                await asyncio.gather(*pending, return_exceptions=True)

    async def close(self) -> None:
        """Drain the connection (flush what we published, unsubscribe) and close it."""
        if self._nc.is_closed or self._nc.is_draining:
            return
        try:
            await self._nc.drain()
        except nats.errors.Error as exc:
            log.warning("connection drain failed", error=str(exc))
            await self._nc.close()

    # -- calling -------------------------------------------------------------------------
    def headers_for(
        self, message: Any, *, request_id: str | None = None, deadline_ms: int | None = None
    ) -> dict[str, str]:
        headers: dict[str, str] = {}
        if request_id:
            headers[HEADER_REQUEST_ID] = request_id
        if deadline_ms is not None:
            headers[HEADER_DEADLINE_MS] = str(deadline_ms)
        if not isinstance(message, bytes | bytearray):
            headers[HEADER_SCHEMA] = schema_header(type(message))
        telemetry.inject(headers)
        return headers

    async def request(
        self,
        subject: str,
        message: Any,
        reply_type: type[T],
        *,
        timeout_s: float = 5.0,
        request_id: str | None = None,
        deadline_ms: int | None = None,
    ) -> T:
        """Send one request and decode its reply; raise the server's typed error, or
        `NoResponders`, or `DeadlineExceeded` when neither reply nor deadline comes in time."""
        timeout_s = effective_timeout_s(timeout_s, deadline_ms, subject)
        headers = self.headers_for(message, request_id=request_id, deadline_ms=deadline_ms)
        data = message if isinstance(message, bytes | bytearray) else encode(message)
        try:
            msg = await self._nc.request(subject, data, timeout=timeout_s, headers=headers)
        except nats.errors.NoRespondersError as exc:
            raise NoResponders(f"no instance serves {subject}") from exc
        except nats.errors.TimeoutError as exc:
            raise DeadlineExceeded(f"no reply on {subject} within {timeout_s:.3f}s") from exc
        if msg.headers and ERROR_CODE_HEADER in msg.headers:
            raise_if_error(_raw(msg))
        if reply_type is bytes:
            return msg.data  # type: ignore[return-value]
        try:
            return decode(msg.data, reply_type)
        except msgspec.DecodeError as exc:
            raise InternalError(
                f"malformed {reply_type.__name__} reply on {subject}: {exc}"
            ) from exc

    async def publish(
        self, subject: str, message: Any, *, headers: dict[str, str] | None = None
    ) -> None:
        await self._nc.publish(subject, encode(message), headers=headers)

    async def publish_raw(
        self, subject: str, data: bytes, headers: dict[str, str] | None = None, reply: str = ""
    ) -> None:
        await self._nc.publish(subject, data, reply=reply, headers=headers)

    async def flush(self, timeout_s: float = 5.0) -> None:
        """Return once the server has processed everything sent so far (subscriptions
        included), so another connection's publish is sure to find them."""
        # nats-py 2.16 writes the PING straight to the socket while SUB commands still wait in
        # its pending buffer for the flusher task: one PING/PONG can overtake a SUB (seen here:
        # 38 of 300 cross-connection messages lost). The first round trip lets the flusher
        # write the buffer; the second PING is then behind everything.
        await self._nc.flush(timeout=timeout_s)
        await self._nc.flush(timeout=timeout_s)

    # -- events and raw subscriptions ----------------------------------------------------
    async def subscribe(
        self,
        subject: str,
        message_type: type[T],
        handler: Callable[[T], Awaitable[None]],
        *,
        queue: str = "",
    ) -> Subscription:
        """Deliver decoded events to `handler`, in order. A malformed event is logged and
        skipped: an event has nobody to reply to."""

        async def on_message(msg: Msg) -> None:
            try:
                event = decode(msg.data, message_type)
            except msgspec.DecodeError as exc:
                log.warning("malformed event dropped", subject=msg.subject, error=str(exc))
                return
            try:
                await handler(event)
            except Exception:
                log.exception("event handler crashed", subject=msg.subject)

        subscription = await self._nc.subscribe(subject, queue=queue, cb=on_message)
        self._event_subscriptions.append(subscription)
        return subscription

    async def subscribe_raw(
        self, subject: str, handler: Callable[[RawMessage], Awaitable[None]]
    ) -> Subscription:
        async def on_message(msg: Msg) -> None:
            try:
                await handler(_raw(msg))
            except Exception:
                log.exception("raw handler crashed", subject=msg.subject)

        subscription = await self._nc.subscribe(subject, cb=on_message)
        self._event_subscriptions.append(subscription)
        return subscription

    async def unsubscribe(self, subscription: Subscription) -> None:
        """End a subscription made with `subscribe`/`subscribe_raw` (per-request ones)."""
        if subscription in self._event_subscriptions:
            self._event_subscriptions.remove(subscription)
        await subscription.unsubscribe()

    async def open_inbox(self) -> Inbox:
        subject = self._nc.new_inbox()
        return Inbox(subject, await self._nc.subscribe(subject))

    async def scatter(
        self, subject: str, data: bytes, *, timeout_s: float
    ) -> AsyncIterator[RawMessage]:
        """Publish once, yield every reply that arrives within `timeout_s` (discovery)."""
        inbox = await self.open_inbox()
        try:
            await self.publish_raw(subject, data, reply=inbox.subject)
            deadline = time.monotonic() + timeout_s
            while (left := deadline - time.monotonic()) > 0:
                msg = await inbox.next(left)
                if msg is None:
                    break
                if msg.headers.get(STATUS_HEADER) == NO_RESPONDERS_STATUS:
                    break
                yield msg
        finally:
            await inbox.close()

    # -- JetStream: only where loss is unacceptable (usage, the KV event log) ---------------
    async def ensure_stream(
        self,
        name: str,
        subjects: list[str],
        *,
        max_age_s: float | None = None,
        max_bytes: int | None = None,
        duplicate_window_s: float = 120.0,
    ) -> None:
        """Create the stream, or bring an existing one to this config (idempotent)."""
        config = StreamConfig(
            name=name,
            subjects=subjects,
            max_age=max_age_s,
            max_bytes=max_bytes,
            duplicate_window=duplicate_window_s,
        )
        js = self._nc.jetstream()
        try:
            await js.add_stream(config)
        except nats.js.errors.BadRequestError:
            await js.update_stream(config)

    async def stream_bounds(self, name: str) -> tuple[int, int]:
        """(first, last) sequence numbers held by a stream."""
        info = await self._nc.jetstream().stream_info(name)
        return info.state.first_seq, info.state.last_seq

    async def js_publish(
        self, subject: str, message: Any, *, msg_id: str | None = None, timeout_s: float = 5.0
    ) -> int:
        """Publish with a storage acknowledgement; `msg_id` deduplicates (Nats-Msg-Id)."""
        headers = {"Nats-Msg-Id": msg_id} if msg_id else None
        try:
            ack = await self._nc.jetstream().publish(
                subject, encode(message), timeout=timeout_s, headers=headers
            )
        except nats.js.errors.NoStreamResponseError as exc:
            raise Unavailable(f"no JetStream stream stores {subject}") from exc
        except nats.errors.TimeoutError as exc:
            raise Unavailable(f"JetStream did not acknowledge {subject} in {timeout_s}s") from exc
        return ack.seq

    async def consume(
        self,
        stream: str,
        subject: str,
        message_type: type[T],
        handler: Callable[[T, int], Awaitable[None]],
        *,
        start_seq: int | None = None,
    ) -> Subscription:
        """Deliver a stream's messages in order (`handler(message, stream_seq)`), from
        `start_seq` (or the start), then live: an ordered, ephemeral consumer."""
        if start_seq is None:
            config = ConsumerConfig(deliver_policy=DeliverPolicy.ALL)
        else:
            config = ConsumerConfig(
                deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=start_seq
            )

        async def on_message(msg: Msg) -> None:
            try:
                event = decode(msg.data, message_type)
            except msgspec.DecodeError as exc:
                log.warning("malformed stream message skipped", subject=msg.subject, error=str(exc))
                return
            try:
                await handler(event, msg.metadata.sequence.stream)
            except Exception:
                log.exception("stream handler crashed", subject=msg.subject)

        subscription = await self._nc.jetstream().subscribe(
            subject, stream=stream, cb=on_message, ordered_consumer=True, config=config
        )
        self._event_subscriptions.append(subscription)
        return subscription

    async def put_object(self, bucket: str, name: str, data: bytes) -> None:
        js = self._nc.jetstream()
        try:
            store = await js.object_store(bucket)
        except nats.js.errors.BucketNotFoundError:
            store = await js.create_object_store(bucket)
        await store.put(name, data)

    async def get_object(self, bucket: str, name: str) -> bytes | None:
        js = self._nc.jetstream()
        try:
            store = await js.object_store(bucket)
            return (await store.get(name)).data
        except (nats.js.errors.BucketNotFoundError, nats.js.errors.ObjectNotFoundError):
            return None
        except nats.js.errors.NotFoundError:
            return None


def error_headers(exc: ServiceError) -> dict[str, str]:
    return {ERROR_HEADER: exc.message, ERROR_CODE_HEADER: str(exc.numeric_code)}


def raise_if_error(msg: RawMessage) -> None:
    """Raise the typed error a reply or stream message carries, if any."""
    if ERROR_CODE_HEADER not in msg.headers:
        return
    reply: ErrorReply | None
    try:
        reply = decode(msg.data, ErrorReply) if msg.data else None
    except msgspec.DecodeError:
        reply = None  # a non-kvfabric micro service: the headers alone carry the error
    raise error_from_wire(
        msg.headers.get(ERROR_CODE_HEADER), msg.headers.get(ERROR_HEADER, ""), reply
    )


def effective_timeout_s(timeout_s: float, deadline_ms: int | None, subject: str) -> float:
    if deadline_ms is None:
        return timeout_s
    remaining_s = (deadline_ms - now_ms()) / 1000
    if remaining_s <= 0:
        raise DeadlineExceeded(f"deadline passed before the request to {subject} was sent")
    return min(timeout_s, remaining_s)


def _raw(msg: Msg) -> RawMessage:
    return RawMessage(
        subject=msg.subject, data=msg.data, reply=msg.reply or None, headers=dict(msg.headers or {})
    )


async def _log_error(exc: Exception) -> None:
    log.warning("nats error", error=str(exc))


def _log_disconnected(connected: list[Client]) -> Callable[[], Awaitable[None]]:
    async def callback() -> None:
        # A disconnect while we drain or close is the plan, not news.
        if connected and not (connected[0].is_closed or connected[0].is_draining):
            log.warning("nats disconnected")

    return callback


async def _log_reconnected() -> None:
    log.info("nats reconnected")
