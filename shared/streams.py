"""The stream pattern: the caller subscribes to a fresh inbox and sends its request with that
inbox as reply subject; the worker (or whichever worker the request is handed on to) publishes
seq-numbered chunks to the inbox, the last one marked final.

Every chunk carries `Kvf-Seq` (0, 1, 2, ...); the last carries `Kvf-Final: 1` (an empty final
message when the producer learns only after its last chunk that it is done). An error ends the
stream as a final message with the error headers. The reader raises `StreamGap` when a
sequence number is skipped, `StreamStalled` when nothing arrives within the idle timeout,
`DeadlineExceeded` past the absolute deadline and `NoResponders` when nobody took the request.
"""

from __future__ import annotations

import time
from typing import Any, Generic, TypeVar

import msgspec

from shared.bus import (
    HEADER_FINAL,
    HEADER_REQUEST_ID,
    HEADER_SEQ,
    NO_RESPONDERS_STATUS,
    STATUS_HEADER,
    Bus,
    Inbox,
    error_headers,
    now_ms,
    raise_if_error,
)
from shared.schema import (
    DeadlineExceeded,
    InternalError,
    NoResponders,
    ServiceError,
    StreamGap,
    StreamStalled,
    decode,
    encode,
)

T = TypeVar("T")


class StreamWriter:
    """Publishes one stream's chunks to its inbox. Not safe for concurrent `send`s."""

    def __init__(self, bus: Bus, inbox: str, *, request_id: str = "") -> None:
        self._bus = bus
        self.inbox = inbox
        self.request_id = request_id
        self.num_sent = 0
        self.is_finished = False

    def _headers(self, *, final: bool) -> dict[str, str]:
        headers = {HEADER_SEQ: str(self.num_sent)}
        if self.request_id:
            headers[HEADER_REQUEST_ID] = self.request_id
        if final:
            headers[HEADER_FINAL] = "1"
        return headers

    async def send(self, chunk: Any, *, final: bool = False) -> None:
        if self.is_finished:
            raise RuntimeError("stream already finished")
        await self._bus.publish_raw(self.inbox, encode(chunk), self._headers(final=final))
        self.num_sent += 1
        self.is_finished = final

    async def finish(self) -> None:
        """End the stream (idempotent)."""
        if not self.is_finished:
            await self._bus.publish_raw(self.inbox, b"", self._headers(final=True))
            self.num_sent += 1
            self.is_finished = True

    async def fail(self, error: ServiceError) -> None:
        """End the stream with a typed error (idempotent; ignored after a normal finish)."""
        if self.is_finished:
            return
        headers = self._headers(final=True) | error_headers(error)
        await self._bus.publish_raw(self.inbox, encode(error.to_reply(self.request_id)), headers)
        self.num_sent += 1
        self.is_finished = True


class Stream(Generic[T]):
    """`async with Stream(bus, subject, request, ChunkType) as chunks: async for c in chunks`."""

    def __init__(
        self,
        bus: Bus,
        subject: str,
        request: Any,
        chunk_type: type[T],
        *,
        request_id: str | None = None,
        deadline_ms: int | None = None,
        first_chunk_timeout_s: float = 30.0,
        idle_timeout_s: float = 30.0,
    ) -> None:
        self._bus = bus
        self._subject = subject
        self._request = request
        self._chunk_type = chunk_type
        self._request_id = request_id
        self._deadline_ms = deadline_ms
        self._first_chunk_timeout_s = first_chunk_timeout_s
        self._idle_timeout_s = idle_timeout_s
        self._inbox: Inbox | None = None
        self._expected_seq = 0
        self._is_done = False

    @property
    def inbox(self) -> str:
        if self._inbox is None:
            raise RuntimeError("stream not opened")
        return self._inbox.subject

    async def __aenter__(self) -> Stream[T]:
        self._inbox = await self._bus.open_inbox()
        data = self._request if isinstance(self._request, bytes) else encode(self._request)
        headers = self._bus.headers_for(
            self._request, request_id=self._request_id, deadline_ms=self._deadline_ms
        )
        await self._bus.publish_raw(self._subject, data, headers, reply=self._inbox.subject)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self._inbox is not None:
            await self._inbox.close()

    def __aiter__(self) -> Stream[T]:
        return self

    async def __anext__(self) -> T:
        if self._is_done or self._inbox is None:
            raise StopAsyncIteration
        timeout_s = self._first_chunk_timeout_s if self._expected_seq == 0 else self._idle_timeout_s
        is_deadline_bound = False
        if self._deadline_ms is not None:
            remaining_s = (self._deadline_ms - now_ms()) / 1000
            if remaining_s <= timeout_s:
                timeout_s, is_deadline_bound = max(remaining_s, 0.0), True
        started = time.monotonic()
        msg = await self._inbox.next(timeout_s)
        if msg is None:
            self._is_done = True
            if is_deadline_bound:
                raise DeadlineExceeded(f"stream from {self._subject} passed its deadline")
            raise StreamStalled(
                f"no chunk {self._expected_seq} from {self._subject} "
                f"within {time.monotonic() - started:.1f}s"
            )
        if msg.headers.get(STATUS_HEADER) == NO_RESPONDERS_STATUS:
            self._is_done = True
            raise NoResponders(f"no instance serves {self._subject}")
        seq_header = msg.headers.get(HEADER_SEQ, "")
        if not seq_header:  # an error from a hop that never streamed (router: OVERLOADED)
            self._is_done = True
            raise_if_error(msg)
        if not seq_header.isdigit():
            self._is_done = True
            raise InternalError(f"stream message without a valid {HEADER_SEQ} header")
        if int(seq_header) != self._expected_seq:
            self._is_done = True
            raise StreamGap(f"expected chunk {self._expected_seq}, got {seq_header}")
        self._expected_seq += 1
        is_final = msg.headers.get(HEADER_FINAL) == "1"
        if is_final:
            self._is_done = True
        raise_if_error(msg)
        if is_final and not msg.data:
            raise StopAsyncIteration
        try:
            return decode(msg.data, self._chunk_type)
        except msgspec.DecodeError as exc:
            self._is_done = True
            raise InternalError(f"malformed {self._chunk_type.__name__} chunk: {exc}") from exc
