"""`shared.client.generate` against a fake router and a fake decode worker on a real
nats-server: the result, router errors, a decode worker that dies, stream errors, cancel."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from shared.block_hashing import BlockHasher
from shared.bus import Bus, Context, RawMessage, now_ms
from shared.client import build_request, generate
from shared.schema import (
    CancelRequest,
    GenerateRequest,
    InstanceState,
    LoadReport,
    NoResponders,
    Overloaded,
    RouteDecision,
    StreamGap,
    TokenChunk,
    TokenUsage,
    Unavailable,
    UsageRecord,
    UsageStatus,
    unpack_block_hashes,
    unpack_token_ids,
)
from shared.subjects import ROUTER
from shared.testing.fixtures import BusFactory
from tests.service.fake_cluster import DECODE_ID, FakeDecode, cluster, collect

pytestmark = pytest.mark.nats

STOPPED = InstanceState.STOPPED
PROMPT = list(range(100, 300))  # 200 tokens: 3 complete blocks of 64


def a_request(**overrides) -> GenerateRequest:  # noqa: ANN003
    return build_request(PROMPT, model="tiny-coder", api_key_id="key-1", **overrides)


@pytest.mark.parametrize("reply_delay_s", [0.0, 0.3])  # 0.3: the stream ends before the reply
async def test_a_full_stream_becomes_the_result(
    bus_factory: BusFactory, reply_delay_s: float
) -> None:
    decode = FakeDecode(await bus_factory("decode", DECODE_ID), [[0, 1], [2], [3]])
    decode.reply_delay_s = reply_delay_s
    client = await bus_factory("client")
    seen: list[int] = []
    async with cluster(bus_factory, decode):
        result = await generate(client, a_request(), on_chunk=lambda c: seen.append(c.seq))
    assert seen == [0, 1, 2]
    assert result.token_ids == [0, 1, 2, 3]
    assert result.text == "abcd"
    assert result.finish_reason == "length"
    assert result.usage == TokenUsage(
        num_prompt_tokens=200, num_cached_tokens=128, num_output_tokens=4
    )
    assert result.stats is not None and result.stats.num_forward_passes == 4
    assert result.decision.decode_worker_id == DECODE_ID
    assert result.ttft_s is not None and 0 <= result.ttft_s <= result.total_s


async def test_router_error_is_raised_typed_once_the_overload_wait_is_spent(
    bus_factory: BusFactory,
) -> None:
    calls: list[str] = []

    async def refuse(request: GenerateRequest, ctx: Context) -> RouteDecision:
        calls.append(request.request_id)
        raise Overloaded("all decode workers are full", retry_after_s=0.2)

    client = await bus_factory("client")
    async with cluster(bus_factory, route=refuse):
        with pytest.raises(Overloaded, match="full") as caught:
            await generate(client, a_request(), overload_wait_s=0.5)
        assert caught.value.retry_after_s == 0.2
        assert len(calls) == 3  # the first try and two more after 0.2 s each: 0.4 <= 0.5
        calls.clear()
        with pytest.raises(Overloaded):
            await generate(client, a_request(), overload_wait_s=0)
        assert len(calls) == 1


async def test_an_overloaded_router_is_asked_again_after_its_retry_after(
    bus_factory: BusFactory,
) -> None:
    decode = FakeDecode(await bus_factory("decode", DECODE_ID), [[0, 1], [2]])
    refusals: list[str] = []

    async def busy_once(request: GenerateRequest, ctx: Context) -> RouteDecision:
        if not refusals:
            refusals.append(request.stream_inbox)
            raise Overloaded("no decode worker has 124 free KV pages", retry_after_s=0.1)
        assert request.stream_inbox != refusals[0]  # a fresh stream for the new attempt
        return await decode.route(request, ctx)

    client = await bus_factory("client")
    async with cluster(bus_factory, decode, route=busy_once):
        result = await generate(client, a_request())
    assert result.token_ids == [0, 1, 2] and len(refusals) == 1


async def test_no_retry_past_the_request_s_deadline(bus_factory: BusFactory) -> None:
    calls: list[str] = []

    async def refuse(request: GenerateRequest, ctx: Context) -> RouteDecision:
        calls.append(request.request_id)
        raise Overloaded("busy", retry_after_s=5.0)

    client = await bus_factory("client")
    async with cluster(bus_factory, route=refuse):
        with pytest.raises(Overloaded):
            await generate(client, a_request(deadline_s=2.0))
    assert len(calls) == 1  # waiting 5 s would pass the 2 s deadline: refused at once


async def test_a_request_a_stopped_router_never_received_is_sent_again(
    bus_factory: BusFactory,
) -> None:
    """The chosen router left while the request was on its way (through another NATS server
    of a cluster, the message is dropped): its last report says STOPPED, and the caller sends
    the request to any router at once instead of waiting out the router's liveness timeout."""
    decode = FakeDecode(await bus_factory("decode", DECODE_ID), [[0, 1], [2], [3]])
    leaving = await bus_factory("router", "router-leaving")
    subjects = leaving.subjects
    lost: list[bytes] = []

    async def drop(msg: RawMessage) -> None:
        lost.append(msg.data)
        report = LoadReport(
            service=ROUTER, instance_id="router-leaving", seq=8, ts_ms=now_ms(), state=STOPPED
        )
        await leaving.publish(subjects.load(ROUTER, "router-leaving"), report)

    await leaving.subscribe_raw(subjects.instance(subjects.router_generate, "router-leaving"), drop)
    await leaving.flush()
    client = await bus_factory("client")
    async with cluster(bus_factory, decode):
        result = await generate(
            client, a_request(), router_id="router-leaving", router_seq=7, liveness_timeout_s=60
        )
    assert len(lost) == 1
    assert [r.request_id for r in decode.requests] == [result.request_id]
    assert result.token_ids == [0, 1, 2, 3]


async def test_no_router_is_no_responders(bus_factory: BusFactory) -> None:
    with pytest.raises(NoResponders):
        await generate(await bus_factory("client"), a_request())


async def _usage_record(client: Bus) -> UsageRecord:
    usage: asyncio.Queue[UsageRecord] = asyncio.Queue()

    async def on_usage(record: UsageRecord, stream_seq: int) -> None:
        await usage.put(record)

    subjects = client.subjects
    await client.js.consume(subjects.usage_stream, subjects.usage_all, UsageRecord, on_usage)
    return await asyncio.wait_for(usage.get(), 5)


async def test_a_decode_worker_that_stops_heartbeating_is_billed_and_raised(
    bus_factory: BusFactory,
) -> None:
    decode = FakeDecode(await bus_factory("decode", DECODE_ID), [[5, 6], [7]], end="die")
    client = await bus_factory("client")
    cancels = await collect(client, client.subjects.cancel, CancelRequest)
    request = a_request()
    async with cluster(bus_factory, decode):
        with pytest.raises(Unavailable, match=f"decode worker {DECODE_ID} stopped") as caught:
            # The idle timeout (30 s) is far off: only the heartbeats can end this in time.
            async with asyncio.timeout(10):
                await generate(
                    client, request, liveness_timeout_s=0.5, idle_timeout_s=30, max_failovers=0
                )
    assert type(caught.value) is Unavailable  # not StreamStalled
    record = await _usage_record(client)
    assert record.request_id == request.request_id
    assert record.status is UsageStatus.FAILED and record.finish_reason == "error"
    assert record.num_output_tokens == 3
    assert (record.num_cache_hit_tokens, record.num_cache_miss_tokens) == (128, 72)
    assert (record.prefill_worker_id, record.decode_worker_id) == ("prefill-a", DECODE_ID)
    assert (record.api_key_id, record.model) == ("key-1", "tiny-coder")
    cancel = await asyncio.wait_for(cancels.get(), 5)  # the worker may only be unreachable
    assert cancel.request_id == request.request_id


async def test_a_stream_whose_end_was_lost_is_raised_retryable_at_once(
    bus_factory: BusFactory,
) -> None:
    """The worker sent its final chunk and it never came (a NATS server died with it in
    flight): the worker, alive and beating, answers the stalled stream's probe that the
    stream has ended, and the caller raises the retryable StreamGap, not after the idle
    timeout and not as a failover (the worker billed the request)."""
    decode = FakeDecode(await bus_factory("decode", DECODE_ID), [[5, 6], [7]], end="lose")
    client = await bus_factory("client")
    async with cluster(bus_factory, decode):
        with pytest.raises(StreamGap, match="was lost"):
            async with asyncio.timeout(10):  # the idle timeout (30 s) is far off
                await generate(client, a_request(), idle_timeout_s=30, probe_after_s=0.05)
    assert len(decode.requests) == 1  # no continuation


async def test_a_lost_decode_worker_s_request_continues_from_what_was_delivered(
    bus_factory: BusFactory,
) -> None:
    """Each attempt dies after three tokens: two continuations, each the prompt plus every
    token delivered so far, then the caller bills all of it once and raises."""
    decode = FakeDecode(await bus_factory("decode", DECODE_ID), [[5, 6], [7]], end="die")
    client = await bus_factory("client")
    request = a_request()
    seen: list[int] = []
    async with cluster(bus_factory, decode):
        with pytest.raises(Unavailable, match="after 9 tokens"):
            async with asyncio.timeout(20):
                await generate(
                    client,
                    request,
                    on_chunk=lambda c: seen.extend(unpack_token_ids(c.token_ids).tolist()),
                    liveness_timeout_s=0.5,
                    idle_timeout_s=30,
                    max_failovers=2,
                )
    assert seen == [5, 6, 7] * 3  # every chunk reached the caller once, in order
    prompt = unpack_token_ids(request.prompt_token_ids).tolist()
    first, *continuations = decode.requests
    assert first == msgspec.structs.replace(request, stream_inbox=first.stream_inbox)
    for attempt, sent in enumerate(continuations, start=1):
        assert sent.request_id == request.request_id
        assert unpack_token_ids(sent.prompt_token_ids).tolist() == prompt + [5, 6, 7] * attempt
        assert sent.sampling.max_tokens == request.sampling.max_tokens - 3 * attempt
        assert sent.resume is not None
        assert (sent.resume.attempt, sent.resume.num_output_tokens) == (attempt, 3 * attempt)
        assert (sent.resume.num_prompt_tokens, sent.resume.num_cached_tokens) == (200, 128)
        assert len(sent.block_hashes) // 8 == len(prompt + [5, 6, 7] * attempt) // 64
    record = await _usage_record(client)  # one record: the original prompt, all the output
    assert record.status is UsageStatus.FAILED and record.num_output_tokens == 9
    assert (record.num_cache_hit_tokens, record.num_cache_miss_tokens) == (128, 72)


async def test_an_error_chunk_is_raised_typed(bus_factory: BusFactory) -> None:
    decode = FakeDecode(await bus_factory("decode", DECODE_ID), [[1]], end="fail")
    client = await bus_factory("client")
    seen: list[TokenChunk] = []
    async with cluster(bus_factory, decode):
        with pytest.raises(Unavailable, match="out of pages"):
            await generate(client, a_request(), on_chunk=seen.append)
    assert [c.seq for c in seen] == [0]


async def test_cancelling_the_call_broadcasts_cancel_request(bus_factory: BusFactory) -> None:
    decode = FakeDecode(await bus_factory("decode", DECODE_ID), [[1]], end="hang")
    client = await bus_factory("client")
    cancels = await collect(client, client.subjects.cancel, CancelRequest)
    first_chunk = asyncio.Event()
    request = a_request()
    async with cluster(bus_factory, decode):
        call = asyncio.create_task(
            generate(client, request, on_chunk=lambda _: first_chunk.set(), liveness_timeout_s=1)
        )
        await asyncio.wait_for(first_chunk.wait(), 5)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        cancel = await asyncio.wait_for(cancels.get(), 5)
    assert cancel.request_id == request.request_id
    assert cancel.reason == "cancelled" and not cancel.error_code


def test_build_request_packs_ids_hashes_and_deadline() -> None:
    request = build_request(
        PROMPT,
        model="tiny-coder",
        block_size_tokens=64,
        cache_salt="t1",
        stop=["\n"],
        seed=3,
        deadline_s=2.0,
        request_id="r-1",
    )
    expected = BlockHasher("tiny-coder", block_size_tokens=64, salt="t1").hashes(PROMPT)
    assert unpack_block_hashes(request.block_hashes).tolist() == expected
    assert len(expected) == 3
    assert request.request_id == "r-1" and request.cache_salt == "t1"
    assert request.sampling.stop == ("\n",) and request.sampling.seed == 3
    assert request.deadline_ms == request.arrival_ms + 2000
    assert request.arrival_ms <= now_ms()
