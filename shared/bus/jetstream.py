"""JetStream, only where loss is unacceptable (docs/design.md, 'Two planes'): the usage log,
the KV index's event log and its snapshots (an object store bucket).

`bus.js` is this module's `JetStream` on the bus's connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import io
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any, Concatenate, ParamSpec, TypeVar

import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    KeyValueConfig,
    ObjectMeta,
    ObjectStoreConfig,
    StreamConfig,
)

from shared.bus.connection import num_refusals
from shared.bus.wire import RawMessage, raw_message
from shared.logging import get_logger
from shared.schema import Unavailable, decode, encode
from shared.subjects import js_pull_next

log = get_logger(__name__)

T = TypeVar("T")
P = ParamSpec("P")


STATUS_HEADER = "Status"  # nats-py puts a status line's code under this header
HEARTBEAT_STATUS = "100"


class NoStream(Unavailable):
    """No JetStream stream stores the subject published to."""


class StreamRefused(Unavailable):
    """The server would not create (or update) a stream: its message says why."""


# How long a stream or consumer set up at start-up waits for JetStream to answer: a server
# restarting, or busy recovering its streams, answers late or not at all for a while, and a
# service that died on the first timeout (a billing replica started beside a NATS restart
# did) would serve nothing.
SETUP_RETRY_S = 60.0
_NOT_ANSWERED = (
    nats.errors.TimeoutError,
    nats.errors.NoRespondersError,
    nats.errors.ConnectionReconnectingError,
    nats.js.errors.ServiceUnavailableError,
)
# How long an acknowledged publish or a key-value operation tries again while its stream
# has no leader: an election after a server of a three-server cluster was SIGKILLed took
# 2-8 s here (tests/service/test_nats_cluster.py).
LEADER_RETRY_S = 15.0
CONSUMER_HEARTBEAT_S = 1.0


async def until_answered(
    what: str, call: Callable[[], Awaitable[T]], *, retry_s: float = SETUP_RETRY_S
) -> T:
    """`call()`, again while JetStream does not answer, for `retry_s` at most; not when the
    server refused what it sent (outside this process's permissions: a request refused gets
    no answer, only a timeout, and waiting changes nothing)."""
    deadline = time.monotonic() + retry_s
    delay_s = 0.25
    refused_before = num_refusals()
    while True:
        try:
            return await call()
        except _NOT_ANSWERED as exc:
            if time.monotonic() + delay_s > deadline or num_refusals() != refused_before:
                raise
            log.warning("JetStream did not answer: trying again", what=what, error=repr(exc))
            await asyncio.sleep(delay_s)
            delay_s = min(delay_s * 2, 4.0)


def _through_elections(
    method: Callable[Concatenate[JetStream, str, P], Awaitable[T]],
) -> Callable[Concatenate[JetStream, str, P], Awaitable[T]]:
    """A key-value operation (idempotent), again while its bucket has no leader."""

    @functools.wraps(method)
    async def retrying(self: JetStream, bucket: str, *args: P.args, **kwargs: P.kwargs) -> T:
        call = functools.partial(method, self, bucket, *args, **kwargs)
        return await until_answered(f"bucket {bucket}", call, retry_s=LEADER_RETRY_S)

    return retrying


# (the message as it came, its stream sequence, what went wrong decoding or handling it)
OnStreamError = Callable[[RawMessage, int, Exception], Awaitable[None]]


class JetStream:
    def __init__(self, nc: Client, subscriptions: list[Subscription]) -> None:
        self._nc = nc
        self._subscriptions = subscriptions  # the bus's: drained with the connection
        # Copies of each stream, bucket and object store this client creates (ServiceConfig's
        # js_replicas): 3 on a three-server cluster, 1 on a single server (more is refused).
        self.replicas = 1
        self._checked_buckets: set[str] = set()

    async def ensure_stream(
        self,
        name: str,
        subjects: list[str],
        *,
        max_age_s: float | None = None,
        max_bytes: int | None = None,
        duplicate_window_s: float = 120.0,
        deny_delete: bool = False,
        deny_purge: bool = False,
    ) -> None:
        """Create the stream, or bring an existing one to this config (idempotent).
        `deny_delete` / `deny_purge`: its messages cannot be deleted or purged through the
        API (an append-only log; the stream itself still can be)."""
        config = StreamConfig(
            name=name,
            subjects=subjects,
            max_age=max_age_s,
            max_bytes=max_bytes,
            duplicate_window=duplicate_window_s,
            num_replicas=self.replicas,
            deny_delete=deny_delete,
            deny_purge=deny_purge,
        )
        js = self._nc.jetstream()

        async def create_or_update() -> None:
            try:
                await js.add_stream(config)
            except nats.js.errors.BadRequestError as refused:
                try:
                    current = (await js.stream_info(name)).config.num_replicas or 1
                except nats.js.errors.NotFoundError:
                    raise refused from None  # not a config change: e.g. R3 on one server
                if current > self.replicas:
                    # Never fewer copies: a process started without js_replicas (1) must not
                    # take a cluster's R3 streams down to one server's.
                    log.info("stream keeps its replicas", stream=name, replicas=current)
                await js.update_stream(config.evolve(num_replicas=max(current, self.replicas)))

        try:
            await until_answered(f"stream {name}", create_or_update)
        except nats.js.errors.APIError as exc:
            # e.g. 10047 "insufficient storage resources available": a stream's max_bytes is
            # reserved from the server's max_file_store when it is created.
            reserve = f" (max_bytes {max_bytes} is reserved from the server's max_file_store)"
            raise StreamRefused(
                f"JetStream refused stream {name}: {exc.description or exc!r}"
                f"{reserve if max_bytes else ''}"
            ) from None

    async def delete_stream(self, name: str) -> bool:
        """Remove a stream and what it holds; False if there was none."""
        try:
            return await self._nc.jetstream().delete_stream(name)
        except nats.js.errors.NotFoundError:
            return False

    async def stream_bounds(self, name: str) -> tuple[int, int]:
        """(first, last) sequence numbers held by a stream; `NoStream` when there is none."""
        try:
            info = await self._nc.jetstream().stream_info(name)
        except nats.js.errors.NotFoundError as exc:
            raise NoStream(f"no JetStream stream {name}") from exc
        return info.state.first_seq, info.state.last_seq

    async def get_message(self, stream: str, seq: int) -> bytes | None:
        """The data of message `seq` of `stream`; None when it is not there (expired)."""
        try:
            return (await self._nc.jetstream().get_msg(stream, seq)).data or b""
        except nats.js.errors.NotFoundError:
            return None

    async def stream_bytes(self, name: str) -> int:
        """What the stream holds now, in bytes."""
        return (await self._nc.jetstream().stream_info(name)).state.bytes

    async def stream_peers(self, name: str) -> dict[str, bool]:
        """Each server holding a copy of the stream -> whether it is current, the leader
        first (its name in a cluster; a single server's id)."""
        cluster = (await self._nc.jetstream().stream_info(name)).cluster
        if cluster is None or cluster.leader is None:
            return {}
        followers = {peer.name: bool(peer.current) for peer in cluster.replicas or []}
        return {cluster.leader: True} | followers

    async def consumer_backlog(self, stream: str, durable: str) -> int:
        """Messages a durable consumer has not had acknowledged yet: those not delivered
        and those delivered but not acknowledged (0 once it has worked through its stream)."""
        info = await self._nc.jetstream().consumer_info(stream, durable)
        return info.num_pending + info.num_ack_pending

    async def publish(
        self,
        subject: str,
        message: Any,
        *,
        msg_id: str | None = None,
        timeout_s: float = 5.0,
        headers: dict[str, str] | None = None,
    ) -> int:
        """Publish a struct (or raw bytes) with a storage acknowledgement; `msg_id`
        deduplicates (Nats-Msg-Id); `headers` travel with the message (a request's trace
        context). `NoStream` when no stream stores the subject, `Unavailable` when no
        acknowledgement comes.

        While the stream has no leader (a NATS server of the cluster lost) it tries again,
        for `LEADER_RETRY_S` at most; after a missing acknowledgement only with a `msg_id`,
        since the message may have been stored."""
        if msg_id:
            headers = {**(headers or {}), "Nats-Msg-Id": msg_id}
        data = message if isinstance(message, bytes) else encode(message)
        js = self._nc.jetstream()
        deadline = time.monotonic() + LEADER_RETRY_S
        delay_s = 0.1
        while True:
            try:
                ack = await js.publish(subject, data, timeout=timeout_s, headers=headers)
                return ack.seq
            except nats.js.errors.NoStreamResponseError as exc:
                # No responder: no stream stores the subject, or its stream has no leader.
                if not await self._stream_stores(subject):
                    raise NoStream(f"no JetStream stream stores {subject}") from exc
                if time.monotonic() > deadline:
                    raise Unavailable(f"the stream storing {subject} has no leader") from exc
                error = "stream has no leader"
            except (
                nats.errors.TimeoutError,
                nats.errors.ConnectionReconnectingError,
                nats.js.errors.ServiceUnavailableError,
            ) as exc:
                stored_maybe = isinstance(exc, nats.errors.TimeoutError)
                if (stored_maybe and not msg_id) or time.monotonic() > deadline:
                    raise Unavailable(
                        f"JetStream did not acknowledge {subject} in {timeout_s}s"
                    ) from exc
                error = str(exc) or type(exc).__name__
            except nats.errors.ConnectionClosedError as exc:
                raise Unavailable(f"connection closed before {subject} was stored") from exc
            log.warning("JetStream publish not acknowledged: trying again", error=error)
            await asyncio.sleep(delay_s)
            delay_s = min(delay_s * 2, 1.0)

    async def _stream_stores(self, subject: str) -> bool:
        """Whether some stream stores `subject` (True when JetStream cannot say now)."""
        try:
            await self._nc.jetstream().find_stream_name_by_subject(subject)
        except nats.js.errors.NotFoundError:
            return False
        except (*_NOT_ANSWERED, nats.errors.ConnectionClosedError):
            return True
        return True

    async def consume(
        self,
        stream: str,
        subject: str,
        message_type: type[T],
        handler: Callable[[T, int], Awaitable[None]],
        *,
        start_seq: int | None = None,
        on_error: OnStreamError | None = None,
    ) -> Subscription:
        """Deliver a stream's messages in order (`handler(message, stream_seq)`), from
        `start_seq` (or the start), then live: an ordered, ephemeral consumer.

        A message that does not decode, or whose handler raises, goes to `on_error` (the
        consumer decides what losing it means: kv-index resyncs the writer); without one it
        is logged as an error and skipped."""
        # An ordered consumer lives on one server; nats-py recreates it after two missed
        # heartbeats (its default 5 s: a consumer on a lost server came back after ~20 s).
        heartbeat_s = CONSUMER_HEARTBEAT_S
        if start_seq is None:
            config = ConsumerConfig(deliver_policy=DeliverPolicy.ALL, idle_heartbeat=heartbeat_s)
        else:
            config = ConsumerConfig(
                deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
                opt_start_seq=start_seq,
                idle_heartbeat=heartbeat_s,
            )

        async def on_message(msg: Msg) -> None:
            stream_seq = msg.metadata.sequence.stream
            try:
                await handler(decode(msg.data, message_type), stream_seq)
            except Exception as exc:
                if on_error is None:
                    log.exception(
                        "stream message skipped", subject=msg.subject, stream_seq=stream_seq
                    )
                    return
                try:
                    await on_error(raw_message(msg), stream_seq, exc)
                except Exception:
                    log.exception("stream error handler crashed", subject=msg.subject)

        def subscribe() -> Awaitable[Subscription]:
            # A fresh config (and so a fresh delivery inbox) for each try: nats-py fills it
            # in, and a consumer created by a try that timed out must not deliver here too.
            return self._nc.jetstream().subscribe(
                subject, stream=stream, cb=on_message, ordered_consumer=True, config=config.evolve()
            )

        # Creating the consumer needs the meta leader: elected anew when a server is lost.
        subscription = await until_answered(f"consumer of {stream}", subscribe)
        self._subscriptions.append(subscription)
        return subscription

    async def pull(
        self,
        stream: str,
        subject: str,
        durable: str,
        *,
        ack_wait_s: float = 30.0,
        max_ack_pending: int = 50_000,
    ) -> PullConsumer:
        """A durable pull consumer (created if missing): every process pulling under the same
        `durable` name shares its messages, each delivered to one of them until acknowledged;
        one not acknowledged within `ack_wait_s` is delivered again."""
        config = ConsumerConfig(
            durable_name=durable,
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=ack_wait_s,
            max_ack_pending=max_ack_pending,
            deliver_policy=DeliverPolicy.ALL,
        )
        js = self._nc.jetstream()
        subscription = await until_answered(
            f"consumer {durable}",
            lambda: js.pull_subscribe(subject, durable=durable, stream=stream, config=config),
        )  # creates (or checks) the durable consumer; batches come through PullConsumer
        await subscription.unsubscribe()
        return await PullConsumer.open(self._nc, js_pull_next(stream, durable))

    async def put_object(
        self, bucket: str, name: str, data: bytes, description: str | None = None
    ) -> None:
        js = self._nc.jetstream()
        try:
            store = await js.object_store(bucket)
        except nats.js.errors.BucketNotFoundError:
            config = ObjectStoreConfig(bucket=bucket, replicas=self.replicas)
            store = await js.create_object_store(bucket, config)
        else:
            await self._raise_replicas(f"OBJ_{bucket}")
        meta = ObjectMeta(name=name, description=description) if description else None
        await store.put(name, data, meta=meta)

    async def object_description(self, bucket: str, name: str) -> str | None:
        """The description an object was put with (its metadata only, not its data)."""
        try:
            store = await self._nc.jetstream().object_store(bucket)
            return (await store.get_info(name)).description
        except (nats.js.errors.BucketNotFoundError, nats.js.errors.ObjectNotFoundError):
            return None
        except nats.js.errors.NotFoundError:
            return None

    async def get_object(self, bucket: str, name: str) -> bytes | None:
        js = self._nc.jetstream()
        try:
            store = await js.object_store(bucket)
            # Into a buffer: nats-py's own result appends each chunk to a bytes object,
            # quadratic in the size (an 83 MB kv-index snapshot took 16.4 s; 128 KB chunks).
            buffer = io.BytesIO()
            await store.get(name, writeinto=buffer)
            return buffer.getvalue()
        except (nats.js.errors.BucketNotFoundError, nats.js.errors.ObjectNotFoundError):
            return None
        except nats.js.errors.NotFoundError:
            return None

    async def delete_object(self, bucket: str, name: str) -> bool:
        """Remove one object; False when it (or its bucket) was not there."""
        js = self._nc.jetstream()
        try:
            store = await js.object_store(bucket)
            await store.delete(name)
        except (nats.js.errors.BucketNotFoundError, nats.js.errors.ObjectNotFoundError):
            return False
        except nats.js.errors.NotFoundError:
            return False
        return True

    # -- key-value buckets (stored responses, API keys): shared by every replica ----------
    async def ensure_kv(self, bucket: str, *, ttl_s: float | None = None) -> None:
        """Create the bucket if it is missing (idempotent); `ttl_s`: entries expire. Waits
        for JetStream as `ensure_stream` does (an ingress started while the cluster was busy
        electing leaders died on its first timeout)."""
        js = self._nc.jetstream()

        async def ensure() -> None:
            try:
                await js.key_value(bucket)
            except nats.js.errors.BucketNotFoundError:
                config = KeyValueConfig(bucket=bucket, ttl=ttl_s, history=1, replicas=self.replicas)
                await js.create_key_value(config)
            else:
                await self._raise_replicas(f"KV_{bucket}")

        try:
            await until_answered(f"bucket {bucket}", ensure)
        except nats.js.errors.APIError as exc:  # e.g. R3 on a single server
            raise StreamRefused(
                f"JetStream refused bucket {bucket}: {exc.description or exc!r}"
            ) from None

    async def _raise_replicas(self, stream: str) -> None:
        """Bring an existing bucket's stream up to `replicas` copies (JetStream scales a
        stream in place), once per process; never down, as `ensure_stream`."""
        if self.replicas == 1 or stream in self._checked_buckets:
            return
        js = self._nc.jetstream()
        info = await js.stream_info(stream)
        if (info.config.num_replicas or 1) < self.replicas:
            log.info("bucket scaled up", stream=stream, replicas=self.replicas)
            await js.update_stream(info.config.evolve(num_replicas=self.replicas))
        self._checked_buckets.add(stream)

    @_through_elections
    async def kv_put(self, bucket: str, key: str, value: bytes) -> None:
        kv = await self._nc.jetstream().key_value(bucket)
        await kv.put(key, value)

    @_through_elections
    async def kv_get(self, bucket: str, key: str) -> bytes | None:
        """The value, or None when the key (or the bucket) is absent, deleted or expired."""
        js = self._nc.jetstream()
        try:
            kv = await js.key_value(bucket)
            entry = await kv.get(key)
        except (
            nats.js.errors.BucketNotFoundError,
            nats.js.errors.KeyNotFoundError,
            nats.js.errors.KeyDeletedError,
        ):
            return None
        return entry.value

    async def kv_add(self, bucket: str, key: str, amount: int, *, tries: int = 20) -> int:
        """Add `amount` to the integer stored at `key` (0 when absent) by compare-and-set, so
        concurrent adders from any replica lose nothing; the new total. (A try whose answer
        was lost and is made again may add twice: counters, not ledgers.)"""
        js = self._nc.jetstream()
        for _ in range(tries):
            kv = await js.key_value(bucket)
            try:
                entry = await kv.get(key)
            except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
                entry = None
            total = (int(entry.value or b"0") if entry is not None else 0) + amount
            try:
                if entry is None:
                    await kv.create(key, str(total).encode())
                else:
                    await kv.update(key, str(total).encode(), last=entry.revision)
                return total
            except nats.js.errors.KeyWrongLastSequenceError:
                continue  # another replica added first: read again
        raise Unavailable(f"{bucket}/{key}: {tries} concurrent updates in a row, none landed")

    @_through_elections
    async def kv_delete(self, bucket: str, key: str) -> None:
        js = self._nc.jetstream()
        try:
            kv = await js.key_value(bucket)
        except nats.js.errors.BucketNotFoundError:
            return
        await kv.delete(key)

    @_through_elections
    async def kv_keys(self, bucket: str) -> list[str]:
        js = self._nc.jetstream()
        try:
            kv = await js.key_value(bucket)
            return sorted(await kv.keys())
        except (nats.js.errors.BucketNotFoundError, nats.js.errors.NoKeysError):
            return []


class PulledMessage:
    """One message of a pull consumer; acknowledge it once its effect is durable. Its stream
    sequence and delivery count are read from the reply subject only when asked (~10 us a
    message in nats-py, for what only a dead letter needs)."""

    __slots__ = ("_msg", "data", "subject")

    def __init__(self, msg: Msg) -> None:
        self._msg = msg
        self.subject: str = msg.subject
        self.data: bytes = msg.data

    @property
    def headers(self) -> dict[str, str]:
        """The message's headers (the producer's trace context among them); {} without any."""
        return self._msg.headers or {}

    @property
    def stream_seq(self) -> int:
        return self._msg.metadata.sequence.stream

    @property
    def num_delivered(self) -> int:
        """1 on first delivery."""
        return self._msg.metadata.num_delivered

    async def ack(self) -> None:
        await self._msg.ack()

    async def nak(self, delay_s: float | None = None) -> None:
        """Deliver again (after `delay_s`): the effect could not be made durable now."""
        await self._msg.nak(delay=delay_s)

    async def term(self) -> None:
        """Never deliver again (it was dead-lettered)."""
        await self._msg.term()


class PullConsumer:
    """Fetches a batch with one pull request on an inbox of its own, the messages collected
    by the subscription's callback. (nats-py's `fetch` waits for each message of a batch
    separately, ~100 us a message: a fetch-and-ack loop topped out near 10K messages/s
    here, the billing service's whole budget.)"""

    def __init__(
        self, nc: Client, subscription: Subscription, api_subject: str, inbox: str
    ) -> None:
        self._nc = nc
        self._subscription = subscription  # the inbox's
        self._api_subject = api_subject
        self._inbox = inbox
        self._batch: list[Msg] = []
        self._wanted = 0
        self._done = asyncio.Event()

    @classmethod
    async def open(cls, nc: Client, api_subject: str) -> PullConsumer:
        inbox = nc.new_inbox()
        consumer: PullConsumer

        async def on_message(msg: Msg) -> None:
            consumer._take(msg)

        subscription = await nc.subscribe(
            inbox, cb=on_message, pending_msgs_limit=-1, pending_bytes_limit=-1
        )
        consumer = cls(nc, subscription, api_subject, inbox)
        return consumer

    def _take(self, msg: Msg) -> None:
        status = msg.headers.get(STATUS_HEADER) if msg.headers else None
        if status is None:
            self._batch.append(msg)
            if len(self._batch) >= self._wanted:
                self._done.set()
        elif status != HEARTBEAT_STATUS:  # 404 no messages, 408 expired, 409 ...: batch over
            self._done.set()

    async def fetch(self, batch: int, timeout_s: float) -> list[PulledMessage]:
        """Up to `batch` messages, waiting at most `timeout_s` for them; [] if none. (Asking
        for the next batch before returning this one, to overlap the round trip, was
        measured and gained nothing here: the ledger's commit is the longer wait.)"""
        if not self._batch:
            self._done.clear()
            self._wanted = batch
            request = json.dumps({"batch": batch, "expires": int(timeout_s * 1e9)}).encode()
            await self._nc.publish(self._api_subject, request, reply=self._inbox)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._done.wait(), timeout_s + 1.0)
        msgs, self._batch = self._batch, []
        return [PulledMessage(m) for m in msgs]

    async def close(self) -> None:
        """Stop pulling; the durable consumer (and what it has not acked) stays."""
        await self._subscription.unsubscribe()
