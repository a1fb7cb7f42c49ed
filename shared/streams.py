"""The stream pattern: the caller subscribes to a fresh inbox and names it in its request
(`GenerateRequest.stream_inbox`); whichever worker the request is handed on to publishes
seq-numbered chunks to the inbox, the last one marked final.

Every chunk carries `Kvf-Seq` (0, 1, 2, ...); the last carries `Kvf-Final: 1` (an empty final
message when the producer learns only after its last chunk that it is done). An error ends the
stream as a final message with the error headers. The reader raises `StreamGap` when a
sequence number is skipped, `StreamStalled` when nothing arrives within the idle timeout,
`DeadlineExceeded` past the absolute deadline and `NoResponders` when nobody took the request.
`StreamWriter` is the producer's side (the decode worker), `ChunkReader` the caller's.
"""

from __future__ import annotations

import time
from typing import Any, Generic, TypeVar

import msgspec

from shared.bus import (
    ERROR_CODE_HEADER,
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
    BadRequest,
    DeadlineExceeded,
    InternalError,
    NoResponders,
    ServiceError,
    StreamGap,
    StreamStalled,
    decode,
    encode,
)
from shared.subjects import INBOX_PREFIX, is_inbox

T = TypeVar("T")

# Answers to a probe that names a request (`stream_state`); an empty answer: the instance
# is alive and says nothing of its streams.
STREAM_OPEN = b"open"
STREAM_ENDED = b"ended"


class StreamWriter:
    """Publishes one stream's chunks to its inbox. Not safe for concurrent `send`s."""

    def __init__(self, bus: Bus, inbox: str, *, request_id: str = "") -> None:
        if not is_inbox(inbox):
            raise BadRequest(f"a stream goes to a reply inbox ({INBOX_PREFIX}.*), not {inbox!r}")
        self._bus = bus
        self.inbox = inbox
        self.request_id = request_id
        self.num_sent = 0
        self.is_finished = False
        if request_id:
            bus.open_streams[request_id] = self

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
        if final:
            self._finished()

    async def finish(self) -> None:
        """End the stream (idempotent)."""
        if not self.is_finished:
            await self._bus.publish_raw(self.inbox, b"", self._headers(final=True))
            self.num_sent += 1
            self._finished()

    async def fail(self, error: ServiceError) -> None:
        """End the stream with a typed error (idempotent; ignored after a normal finish)."""
        if self.is_finished:
            return
        headers = self._headers(final=True) | error_headers(error)
        await self._bus.publish_raw(self.inbox, encode(error.to_reply(self.request_id)), headers)
        self.num_sent += 1
        self._finished()

    def _finished(self) -> None:
        self.is_finished = True
        if self._bus.open_streams.get(self.request_id) is self:
            del self._bus.open_streams[self.request_id]


def stream_state(bus: Bus, request_id: str) -> bytes:
    """What a probe of `request_id`'s stream is answered: STREAM_OPEN while a writer of this
    process has not sent its final message, else STREAM_ENDED (also for a stream it never
    had). The answer leaves after every chunk the writer sent (one connection keeps order),
    so a reader told STREAM_ENDED that still waits has lost the end of its stream."""
    writer = bus.open_streams.get(request_id)
    return STREAM_OPEN if writer is not None and not writer.is_finished else STREAM_ENDED


class ChunkReader(Generic[T]):
    """Reads one stream's chunks from an inbox that is already open, checking what every
    reader must: sequence numbers, the final marker, error messages, idle and first-chunk
    timeouts, the absolute deadline. The request goes to one service while the chunks come
    from another (the router hands the inbox on to a decode worker).

    `subject` only names the producer in error messages.
    """

    def __init__(
        self,
        inbox: Inbox,
        chunk_type: type[T],
        subject: str,
        *,
        first_chunk_timeout_s: float = 30.0,
        idle_timeout_s: float = 30.0,
        deadline_ms: int | None = None,
    ) -> None:
        self.inbox = inbox
        self._chunk_type = chunk_type
        self._subject = subject
        self._first_chunk_timeout_s = first_chunk_timeout_s
        self._idle_timeout_s = idle_timeout_s
        self._deadline_ms = deadline_ms
        self.num_received = 0  # stream messages accepted, the final one included
        self.is_done = False  # nothing more will be returned
        self.has_final = False  # the producer ended the stream (normally or with an error)

    async def next(self) -> T | None:
        """The next chunk, or None once the stream has ended; raises the stream's typed error,
        or `StreamGap` / `StreamStalled` / `DeadlineExceeded` / `NoResponders`."""
        if self.is_done:
            return None
        timeout_s = self._first_chunk_timeout_s if self.num_received == 0 else self._idle_timeout_s
        is_deadline_bound = False
        if self._deadline_ms is not None:
            remaining_s = (self._deadline_ms - now_ms()) / 1000
            if remaining_s <= timeout_s:
                timeout_s, is_deadline_bound = max(remaining_s, 0.0), True
        started = time.monotonic()
        msg = await self.inbox.next(timeout_s)
        if msg is None:
            self.is_done = True
            if is_deadline_bound:
                raise DeadlineExceeded(f"stream from {self._subject} passed its deadline")
            raise StreamStalled(
                f"no chunk {self.num_received} from {self._subject} "
                f"within {time.monotonic() - started:.1f}s"
            )
        if msg.headers.get(STATUS_HEADER) == NO_RESPONDERS_STATUS:
            self.is_done = True
            raise NoResponders(f"no instance serves {self._subject}")
        seq_header = msg.headers.get(HEADER_SEQ, "")
        if not seq_header:  # an error from a hop that never streamed (router: OVERLOADED)
            self.is_done = True
            self.has_final = ERROR_CODE_HEADER in msg.headers
            raise_if_error(msg)
        if not seq_header.isdigit():
            self.is_done = True
            raise InternalError(f"stream message without a valid {HEADER_SEQ} header")
        if int(seq_header) != self.num_received:
            self.is_done = True
            raise StreamGap(f"expected chunk {self.num_received}, got {seq_header}")
        self.num_received += 1
        if msg.headers.get(HEADER_FINAL) == "1":
            self.is_done = self.has_final = True
        raise_if_error(msg)
        if self.is_done and not msg.data:
            return None
        try:
            return decode(msg.data, self._chunk_type)
        except msgspec.DecodeError as exc:
            self.is_done = True
            raise InternalError(f"malformed {self._chunk_type.__name__} chunk: {exc}") from exc
