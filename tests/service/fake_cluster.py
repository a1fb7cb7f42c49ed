"""A fake router and a fake decode worker for the caller's side (`shared.client`, `kvfabric
generate`): the router answers a `RouteDecision` and hands the request's inbox to the decode
worker, which streams `TokenChunk`s there while it heartbeats, as docs/request-flow.md says."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from shared.bus import Bus, Context, Endpoint, Handler, RawMessage
from shared.schema import (
    DecodeStats,
    GenerateRequest,
    LoadReport,
    RouteDecision,
    TokenChunk,
    TokenUsage,
    Unavailable,
    pack_token_ids,
)
from shared.streams import StreamWriter, stream_state
from shared.subjects import DECODE
from shared.tasks import cancel_and_wait
from shared.testing.fixtures import BusFactory

DECODE_ID = "decode-a"


@dataclass
class FakeDecode:
    """Streams `chunks` (token id lists) to the request's inbox while heartbeating; then
    finishes, fails, dies (stops heartbeating and streaming), hangs (heartbeats only) or
    loses its final chunk in flight (sent, as the worker knows, but never delivered). It
    answers pings as a worker's runtime does."""

    bus: Bus
    chunks: list[list[int]]
    end: str = "finish"  # finish | fail | die | hang | lose
    reply_delay_s: float = 0.0
    heartbeat_s: float = 0.1
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    beating: bool = True
    requests: list[GenerateRequest] = field(default_factory=list)  # as routed, in order

    async def heartbeat(self) -> None:
        seq = 0
        while self.beating:
            report = LoadReport(service=DECODE, instance_id=DECODE_ID, seq=seq, ts_ms=0)
            await self.bus.publish(self.bus.subjects.load(DECODE, DECODE_ID), report)
            seq += 1
            await asyncio.sleep(self.heartbeat_s)

    async def stream(self, request: GenerateRequest) -> None:
        writer = StreamWriter(self.bus, request.stream_inbox, request_id=request.request_id)
        for seq, ids in enumerate(self.chunks):
            is_last = seq == len(self.chunks) - 1 and self.end in ("finish", "lose")
            if is_last and self.end == "lose":
                writer.inbox += ".lost"  # published where nobody listens
            chunk = TokenChunk(
                request_id=request.request_id,
                seq=seq,
                token_ids=pack_token_ids(ids),
                text="".join(chr(ord("a") + i % 26) for i in ids),
                final=is_last,
                finish_reason="length" if is_last else None,
                usage=TokenUsage(num_prompt_tokens=200, num_cached_tokens=128, num_output_tokens=4)
                if is_last
                else None,
                stats=DecodeStats(ttft_ms=5.0, num_forward_passes=4) if is_last else None,
            )
            await writer.send(chunk, final=is_last)
        if self.end == "fail":
            await writer.fail(Unavailable("decode ran out of pages"))
        elif self.end == "die":
            self.beating = False

    async def route(self, request: GenerateRequest, ctx: Context) -> RouteDecision:
        self.requests.append(request)
        self.tasks.add(asyncio.create_task(self.stream(request)))
        await asyncio.sleep(self.reply_delay_s)
        return RouteDecision(
            request_id=request.request_id,
            prefill_worker_id="prefill-a",
            decode_worker_id=DECODE_ID,
            num_prompt_tokens=200,
            num_cached_blocks=2,
        )


@contextlib.asynccontextmanager
async def cluster(
    bus_factory: BusFactory, decode: FakeDecode | None = None, *, route: Handler | None = None
) -> AsyncIterator[None]:
    """A fake router (serving `route`, default: the fake decode's) and the decode's heartbeat."""
    router = await bus_factory("router")
    handler = route or (decode.route if decode else None)
    if handler is None:
        raise ValueError("a cluster needs a decode worker or a route handler")
    await router.serve(
        Endpoint("generate", router.subjects.router_generate, GenerateRequest, handler)
    )
    if decode is not None:

        async def answer(msg: RawMessage) -> None:
            if not decode.beating:  # died, or cut off: nothing answers
                return
            request_id = msg.data.decode()
            await decode.bus.publish_raw(msg.reply, stream_state(decode.bus, request_id))

        await decode.bus.subscribe_raw(decode.bus.subjects.ping(DECODE_ID), answer)
        await decode.bus.flush()
    await router.flush()
    beat = asyncio.create_task(decode.heartbeat()) if decode else None
    try:
        yield
    finally:
        if decode is not None:
            decode.beating = False
            await cancel_and_wait(beat, *decode.tasks)


async def collect(bus: Bus, subject: str, message_type: type) -> asyncio.Queue:
    """Every `message_type` event on `subject`, from now on, in a queue."""
    queue: asyncio.Queue = asyncio.Queue()
    await bus.subscribe(subject, message_type, queue.put)
    await bus.flush()  # other connections publish: make sure the server has the subscription
    return queue
