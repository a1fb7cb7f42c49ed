"""`Bus`: a service's one NATS connection and everything it does over it.

- `Bus.connect` (connection.py): retries the first connect too, so a service may start
  before its server; reconnects forever once connected.
- `serve(Endpoint)` / `stop_serving` (endpoints.py): request/reply endpoints in the service's
  queue group and on the instance's own subject, typed errors in headers, deadlines enforced.
- `request`: the caller's side, raising the typed `ServiceError` the server sent, or
  `NoResponders` / `DeadlineExceeded`.
- `publish` / `subscribe`: events (fan-out, decoded into structs).
- `open_inbox` / `publish_raw` / `subscribe_raw` / `scatter`: the primitives of
  `shared.streams` and `shared.discovery`.
- `js` (jetstream.py): streams, acknowledged publishes, ordered consumers, object store.
- `close`: drain the connection. Safe to repeat, as is `stop_serving`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import msgspec
import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from shared import telemetry
from shared.bus.connection import abandon_pings, connect_nats
from shared.bus.endpoints import Endpoint, EndpointServer, EndpointStats
from shared.bus.jetstream import JetStream
from shared.bus.wire import (
    ERROR_CODE_HEADER,
    HEADER_DEADLINE_MS,
    HEADER_REQUEST_ID,
    HEADER_SCHEMA,
    NO_RESPONDERS_STATUS,
    STATUS_HEADER,
    RawMessage,
    effective_timeout_s,
    raise_if_error,
    raw_message,
)
from shared.logging import get_logger
from shared.schema import (
    DeadlineExceeded,
    InternalError,
    NoResponders,
    Unavailable,
    decode,
    encode,
    schema_header,
)
from shared.subjects import DEFAULT_ROOT, Subjects

log = get_logger(__name__)

T = TypeVar("T")
CLOSE_TIMEOUT_S = 2.0  # a drain takes milliseconds while the server is there


# While the connection is down a caller learns it within this (UNAVAILABLE), not at its
# timeout: what was sent before is lost with the server, and a reply may never come.
OUTAGE_CHECK_S = 0.25
# A call made while the connection is down waits this long for it first: moving to another
# server of a NATS cluster takes milliseconds, and a call then need not fail; a whole
# outage is still answered well within a second.
RECONNECT_WAIT_S = 0.5


def unavailable() -> Unavailable:
    return Unavailable("lost the connection to NATS (reconnecting)", retry_after_s=1.0)


def num_reconnects(nc: Client) -> int:
    """How often the connection came back: a change means it was lost in between, however
    briefly (a reconnect to another server of a cluster takes milliseconds)."""
    return nc.stats["reconnects"]


class Inbox:
    """A fresh subscription whose messages are read one at a time (stream consumers)."""

    def __init__(self, subject: str, subscription: Subscription, nc: Client) -> None:
        self.subject = subject
        self._subscription = subscription
        self._nc = nc
        self._reconnects = num_reconnects(nc)

    async def next(self, timeout_s: float) -> RawMessage | None:
        """The next message, or None when `timeout_s` passes first; `Unavailable` once the
        connection has been lost since the inbox opened, even if it is back (messages
        published meanwhile never arrive), and nothing received is left to read."""
        deadline = time.monotonic() + timeout_s
        while True:
            lost = not self._nc.is_connected or num_reconnects(self._nc) != self._reconnects
            if lost and self._subscription.pending_msgs == 0:
                raise unavailable()
            wait_s = min(deadline - time.monotonic(), OUTAGE_CHECK_S)
            try:
                msg = await self._subscription.next_msg(timeout=max(wait_s, 0.001))
            except nats.errors.TimeoutError:
                if time.monotonic() >= deadline:
                    return None
                continue
            return raw_message(msg)

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
        self._endpoints = EndpointServer(nc, subjects, service, instance_id)
        self._event_subscriptions: list[Subscription] = []
        self.js = JetStream(nc, self._event_subscriptions)
        # The streams this process is writing, by request id (shared.streams.StreamWriter
        # keeps it): what a caller's probe of a stalled stream asks about.
        self.open_streams: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()

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
        creds: str | os.PathLike[str] | None = None,
        tls_ca: str | os.PathLike[str] | None = None,
    ) -> Bus:
        """Connect, retrying until `connect_timeout_s`; once connected, reconnect forever.
        `creds`: an nkey seed file (default `$KVF_NATS_CREDS`); `tls_ca`: the CA of a
        `tls://` server (default `$KVF_NATS_TLS_CA`)."""
        instance_id = instance_id or f"{service}-{uuid.uuid4().hex[:8]}"
        nc = await connect_nats(
            url,
            name=f"{service}/{instance_id}",
            connect_timeout_s=connect_timeout_s,
            reconnect_wait_s=reconnect_wait_s,
            creds=creds,
            tls_ca=tls_ca,
        )
        return cls(nc, subjects=Subjects(root), service=service, instance_id=instance_id)

    @property
    def is_connected(self) -> bool:
        return self._nc.is_connected

    async def until_connected(self, timeout_s: float = RECONNECT_WAIT_S) -> bool:
        """Whether the connection is up, waiting up to `timeout_s` while it reconnects."""
        deadline = time.monotonic() + timeout_s
        while not self._nc.is_connected and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return self._nc.is_connected

    @property
    def max_payload_bytes(self) -> int:
        return self._nc.max_payload

    @property
    def num_inflight(self) -> int:
        return self._endpoints.num_inflight

    def endpoint_stats(self) -> list[EndpointStats]:
        return self._endpoints.stats()

    # -- serving -------------------------------------------------------------------------
    async def serve(self, endpoint: Endpoint) -> None:
        """Serve `endpoint` on its pooled subject (queue group = service) and on its
        instance subject (`<subject>.<instance_id>`, no queue group)."""
        await self._endpoints.serve(endpoint)

    async def stop_serving(self, grace_s: float) -> bool:
        """Stop taking work, finish in-flight requests within `grace_s`, cancel the rest;
        True when nothing was cancelled or left undrained."""
        return await self._endpoints.stop(grace_s)

    async def close(self) -> None:
        """Drain the connection (flush what we published, unsubscribe) and close it; with
        the server gone, within CLOSE_TIMEOUT_S all the same."""
        if self._nc.is_closed or self._nc.is_draining:
            return
        # Closing for good: a client whose server is gone keeps reconnecting, and nats-py can
        # swallow the cancel that should stop that loop, so the process never exits (seen: a
        # router outliving a killed `kvfabric up`). With attempts bounded the loop ends itself.
        self._nc.options["max_reconnect_attempts"] = 1
        drain = asyncio.create_task(self._nc.drain())
        await asyncio.wait({drain}, timeout=CLOSE_TIMEOUT_S)
        if drain.done() and drain.exception() is None:
            return
        # Failed (not connected) or stuck (the server died mid-drain: its flushes would wait
        # out their 10 s timeouts): end the flushes and close.
        error = drain.exception() if drain.done() else None
        log.warning("connection drain failed", error=str(error or "timed out"))
        abandon_pings(self._nc)
        try:
            await self._nc.close()
        except (nats.errors.Error, OSError) as exc:
            log.warning("connection close failed", error=str(exc))
        if not drain.done():
            await asyncio.wait({drain}, timeout=CLOSE_TIMEOUT_S)

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
        `NoResponders`, or `DeadlineExceeded` when neither reply nor deadline comes in time,
        or `Unavailable` while the connection to NATS is down (within OUTAGE_CHECK_S)."""
        timeout_s = effective_timeout_s(timeout_s, deadline_ms, subject)
        headers = self.headers_for(message, request_id=request_id, deadline_ms=deadline_ms)
        data = message if isinstance(message, bytes | bytearray) else encode(message)
        if not await self.until_connected():
            raise unavailable()
        try:
            msg = await self._request_watching_connection(subject, data, timeout_s, headers)
        except nats.errors.NoRespondersError as exc:
            raise NoResponders(f"no instance serves {subject}") from exc
        except nats.errors.TimeoutError as exc:
            raise DeadlineExceeded(f"no reply on {subject} within {timeout_s:.3f}s") from exc
        if msg.headers and ERROR_CODE_HEADER in msg.headers:
            raise_if_error(raw_message(msg))
        if reply_type is bytes:
            return msg.data  # type: ignore[return-value]
        try:
            return decode(msg.data, reply_type)
        except msgspec.DecodeError as exc:
            raise InternalError(
                f"malformed {reply_type.__name__} reply on {subject}: {exc}"
            ) from exc

    async def _request_watching_connection(
        self, subject: str, data: bytes, timeout_s: float, headers: dict[str, str]
    ) -> Msg:
        """nats-py's request, given up with `Unavailable` once the connection drops (or has
        dropped and come back): the reply would be lost with it and the caller would wait
        out its whole timeout."""
        reconnects = num_reconnects(self._nc)
        call = asyncio.ensure_future(
            self._nc.request(subject, data, timeout=timeout_s, headers=headers)
        )
        try:
            while True:
                done, _ = await asyncio.wait({call}, timeout=OUTAGE_CHECK_S)
                if done:
                    return call.result()
                if not self._nc.is_connected or num_reconnects(self._nc) != reconnects:
                    raise unavailable()
        finally:
            if not call.done():
                call.cancel()
                with contextlib.suppress(asyncio.CancelledError, nats.errors.Error):
                    await call

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
        skipped: an event has nobody to reply to (events that must not be lost go through
        `js`, where the consumer hears of every message it could not take)."""

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
                await handler(raw_message(msg))
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
        return Inbox(subject, await self._nc.subscribe(subject), self._nc)

    async def scatter(
        self, subject: str, data: bytes, *, timeout_s: float, stall_s: float | None = None
    ) -> AsyncIterator[RawMessage]:
        """Publish once, yield every reply that arrives within `timeout_s` (discovery). With
        `stall_s`, also stop once that long passes without a reply after the first (NATS's
        "request many" stall timer): replies to one request come in a burst, so a caller in
        a hurry need not wait out the whole window, at the price of a reply that lags."""
        inbox = await self.open_inbox()
        try:
            await self.publish_raw(subject, data, reply=inbox.subject)
            deadline = time.monotonic() + timeout_s
            stall_at = deadline
            while (left := min(deadline, stall_at) - time.monotonic()) > 0:
                msg = await inbox.next(left)
                if msg is None:
                    break
                if msg.headers.get(STATUS_HEADER) == NO_RESPONDERS_STATUS:
                    break
                if stall_s is not None:
                    stall_at = time.monotonic() + stall_s
                yield msg
        finally:
            await inbox.close()
