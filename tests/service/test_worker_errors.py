"""A worker's unexpected failure reaches its caller as a code and a fixed message, never the
exception's text, and the log holds its traceback exactly once. The real workers in this
process over the mock's simulated model and a real nats-server; what fails is a forward
pass that raises, or the join of a suffix."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
import torch
from structlog.testing import capture_logs
from tokenizers import Tokenizer

from services.decode.config import DecodeConfig
from services.decode.finish import Finisher
from services.decode.worker import DecodeWorker
from services.prefill import handoff
from services.prefill.config import PrefillConfig
from services.prefill.restore import PrefixRestorer, RestorePolicy
from services.prefill.worker import PrefillWorker
from shared import schema
from shared.bus import Bus, Context, Endpoint
from shared.client import build_request
from shared.schema import (
    BadRequest,
    DecodeJob,
    GenerateRequest,
    InternalError,
    JobAccepted,
    PrefillDone,
    PrefillJob,
    PrefillTimings,
    Resume,
    RouteDecision,
    SuffixReady,
    TokenChunk,
    Unavailable,
)
from shared.streams import ChunkReader
from shared.subjects import DECODE, PREFILL
from shared.testing.fixtures import BusFactory
from shared.usage import open_usage_outbox
from worker.engine.engine import Engine
from worker.engine.runner import ModelRunner
from worker.engine.worker import ModelThread, build_runner
from worker.kvstore.backends import alloc_staging
from worker.kvstore.writer import KvEventPublisher
from worker.mock_engine.simulated import SimulatedCausalLM, simulated_model
from worker.serving.kv_io import open_store
from worker.serving.staging import StagingSpace
from worker.transfer import KvTransferAgent

pytestmark = pytest.mark.nats

SECRET = "secret token in /srv/keys/prod.pem"
BLOCK = 16
STAGING_NBYTES = 1 << 20


class BrokenModel(SimulatedCausalLM):
    def __call__(self, *args: object) -> torch.Tensor:
        raise RuntimeError(SECRET)


def broken_model(config: PrefillConfig, dtype: torch.dtype) -> SimulatedCausalLM:
    model = simulated_model(config, dtype)
    return BrokenModel(model.config, model.cost, model.speedup, dtype)


def decision(request_id: str) -> RouteDecision:
    return RouteDecision(
        request_id=request_id,
        prefill_worker_id="prefill-0",
        decode_worker_id="decode-0",
        num_prompt_tokens=100,
        num_cached_blocks=0,
    )


def one_traceback(events: list[dict[str, object]]) -> None:
    """The failure is logged with its traceback once, and its text is in no log field (only
    in that traceback, rendered from the exception)."""
    with_trace = [e for e in events if e.get("exc_info")]
    assert len(with_trace) == 1, events
    assert not any(SECRET in str(value) for e in events for value in e.values()), events


@contextlib.asynccontextmanager
async def prefill_worker(
    bus: Bus, tmp_path: Path, make_model: Callable[..., SimulatedCausalLM]
) -> AsyncIterator[tuple[PrefillWorker, PrefillConfig]]:
    """A real prefill worker over `make_model`, serving its run endpoint on `bus`."""
    config = PrefillConfig(engine="mock", store_dir=tmp_path, kv_block_size_tokens=BLOCK)
    runner = build_runner(config, make_model)
    store = await open_store(config, bus.instance_id, runner.layout.block_nbytes)
    publisher = KvEventPublisher(bus, store)
    agent = KvTransferAgent(bus, alloc_staging(STAGING_NBYTES), service=PREFILL)
    thread, lock = ModelThread(), asyncio.Lock()
    worker = PrefillWorker(
        bus,
        runner,
        PrefixRestorer(runner, store, None, RestorePolicy(), lock, thread),
        publisher,
        None,
        agent,
        StagingSpace(0, STAGING_NBYTES),
        model_name=config.model_name,
        max_batch_tokens=config.max_batch_tokens,
        max_model_len=runner.config.max_position_embeddings,
        handoff_timeout_s=config.handoff_timeout_s,
        compute_lock=lock,
        model_thread=thread,
    )
    worker.start()
    try:
        await bus.serve(Endpoint("run", bus.subjects.prefill_run, PrefillJob, worker.handle_job))
        yield worker, config
    finally:
        await worker.stop()
        await thread.close()
        agent.close()
        store.close()


async def test_a_failed_prefill_pass_answers_a_fixed_message(
    bus_factory: BusFactory, tmp_path: Path
) -> None:
    bus = await bus_factory("prefill", "prefill-0")
    async with prefill_worker(bus, tmp_path, broken_model) as (worker, config):
        client = await bus_factory("router")
        request = build_request(
            list(range(3, 103)), model=config.model_name, block_size_tokens=BLOCK
        )
        with capture_logs() as events, pytest.raises(InternalError) as caught:
            await client.request(
                client.subjects.instance(client.subjects.prefill_run, "prefill-0"),
                PrefillJob(request=request, decision=decision(request.request_id)),
                PrefillDone,
            )
        assert caught.value.message == "prefill forward pass failed"
        failed = worker.metrics.snapshot()['kvfabric_prefill_jobs_ended_total{outcome="failed"}']
        assert failed == 1
        one_traceback(events)


async def test_a_token_outside_the_vocabulary_is_a_bad_request(
    bus_factory: BusFactory, tmp_path: Path
) -> None:
    """Not a forward pass that fails on it (an index error, INTERNAL): refused up front."""
    bus = await bus_factory("prefill", "prefill-0")
    async with prefill_worker(bus, tmp_path, simulated_model) as (worker, config):
        vocab_size = worker.runner.config.vocab_size
        client = await bus_factory("router")
        request = build_request(
            [3, 4, vocab_size, 5], model=config.model_name, block_size_tokens=BLOCK
        )
        with pytest.raises(BadRequest, match=f"token id {vocab_size} is outside the vocab"):
            await client.request(
                client.subjects.instance(client.subjects.prefill_run, "prefill-0"),
                PrefillJob(request=request, decision=decision(request.request_id)),
                PrefillDone,
            )


@contextlib.asynccontextmanager
async def decode_worker(
    bus: Bus, tmp_path: Path
) -> AsyncIterator[tuple[DecodeWorker, DecodeConfig]]:
    """A real decode worker over the simulated model, its usage outbox under `tmp_path`;
    started, its endpoints not yet served."""
    config = DecodeConfig(engine="mock", store_dir=tmp_path, kv_block_size_tokens=BLOCK)
    runner: ModelRunner = build_runner(config, simulated_model)
    store = await open_store(config, bus.instance_id, runner.layout.block_nbytes)
    outbox = await open_usage_outbox(bus, DECODE, tmp_path / "outbox", bus.instance_id)
    finisher = Finisher(bus, store, KvEventPublisher(bus, store), None, outbox)
    agent = KvTransferAgent(bus, alloc_staging(STAGING_NBYTES), service=DECODE)
    thread = ModelThread()
    tokenizer = Tokenizer.from_file(str(config.model_path / "tokenizer.json"))
    worker = DecodeWorker(
        bus,
        Engine(runner),
        tokenizer,
        agent,
        StagingSpace(0, STAGING_NBYTES),
        finisher,
        model_name=config.model_name,
        retry_after_s=config.retry_after_s,
        pull_timeout_s=config.pull_timeout_s,
        suffix_timeout_s=config.suffix_timeout_s,
        model_thread=thread,
    )

    worker.start()
    try:
        yield worker, config
    finally:
        await worker.stop()
        await thread.close()
        agent.close()
        await outbox.close()
        store.close()


async def a_job_awaiting_its_suffix(
    bus: Bus, bus_factory: BusFactory, worker: DecodeWorker, config: DecodeConfig
) -> tuple[Bus, Any, GenerateRequest]:
    """`worker` serving its run and suffix endpoints on `bus`, and one job it accepted from
    a caller (ingress's bus), waiting for its suffix: (the caller, its stream inbox, the
    request)."""
    subjects = bus.subjects
    await bus.serve(Endpoint("run", subjects.decode_run, DecodeJob, worker.handle_job))
    await bus.serve(Endpoint("suffix", subjects.decode_suffix, SuffixReady, worker.handle_suffix))
    caller = await bus_factory("ingress")
    inbox = await caller.open_inbox()
    request = build_request(list(range(3, 103)), model=config.model_name, block_size_tokens=BLOCK)
    request = msgspec.structs.replace(request, stream_inbox=inbox.subject)
    await caller.request(
        subjects.instance(subjects.decode_run, "decode-0"),
        DecodeJob(request=request, decision=decision(request.request_id)),
        JobAccepted,
    )
    return caller, inbox, request


def suffix_without_blocks(
    request: GenerateRequest,
    worker: DecodeWorker,
    prefill_worker_id: str,
    num_computed_tokens: int = 0,
) -> SuffixReady:
    """A prefill worker's SuffixReady for `request` that stages no block."""
    return SuffixReady(
        request_id=request.request_id,
        attempt=0,
        prefill_worker_id=prefill_worker_id,
        num_computed_tokens=num_computed_tokens,
        first_block_index=0,
        num_blocks=0,
        block_nbytes=worker.runner.layout.block_nbytes,
        region_offset=0,
        window_nbytes=0,
    )


class HeldPull:
    """A decode worker's join whose pull runs until `release`, then fails as a read from a
    prefill that died: each join's prefill worker in `joins`."""

    def __init__(self) -> None:
        self.pulling, self.release = asyncio.Event(), asyncio.Event()
        self.joins: list[str] = []

    async def __call__(self, state: Any, ready: SuffixReady) -> int:
        self.joins.append(ready.prefill_worker_id)
        self.pulling.set()
        await self.release.wait()
        raise Unavailable(f"NIXL READ to {ready.prefill_worker_id} failed")


async def test_a_failed_join_ends_the_stream_with_a_fixed_message(
    bus_factory: BusFactory, tmp_path: Path
) -> None:
    bus = await bus_factory("decode", "decode-0")
    async with decode_worker(bus, tmp_path) as (worker, config):

        async def broken_join(state: object, ready: object) -> int:
            raise RuntimeError(SECRET)

        worker._join = broken_join  # type: ignore[method-assign]
        caller, inbox, request = await a_job_awaiting_its_suffix(bus, bus_factory, worker, config)
        subjects = bus.subjects
        ready = suffix_without_blocks(request, worker, "prefill-0", num_computed_tokens=99)
        with capture_logs() as events, pytest.raises(InternalError) as caught:
            await caller.request(
                subjects.instance(subjects.decode_suffix, "decode-0"), ready, JobAccepted
            )
        assert caught.value.message == "internal error"
        reader = ChunkReader(inbox, TokenChunk, "decode-0", first_chunk_timeout_s=5)
        with pytest.raises(InternalError) as ended:
            await reader.next()
        assert ended.value.message == "joining the suffix failed"
        # the failed request is billed all the same
        assert await worker.finisher.outbox.flush(timeout_s=5)
        one_traceback(events)


async def test_a_duplicate_suffix_during_the_first_join_is_accepted_not_joined_again(
    bus_factory: BusFactory, tmp_path: Path
) -> None:
    """A prefill killed after it sent its suffix is retried by another, whose suffix can come
    while the first is still being pulled from the dead one: it is answered and not joined
    again (the prefix it would take is in use), and the request ends with the first pull's
    retryable error, never an internal one."""
    bus = await bus_factory("decode", "decode-0")
    async with decode_worker(bus, tmp_path) as (worker, config):
        pull = HeldPull()
        worker._join = pull  # type: ignore[method-assign]
        caller, inbox, request = await a_job_awaiting_its_suffix(bus, bus_factory, worker, config)
        subjects = bus.subjects

        def ready(prefill_worker_id: str) -> SuffixReady:
            return suffix_without_blocks(request, worker, prefill_worker_id)

        suffix = subjects.instance(subjects.decode_suffix, "decode-0")
        first = asyncio.create_task(caller.request(suffix, ready("prefill-0"), JobAccepted))
        await pull.pulling.wait()
        second = await caller.request(suffix, ready("prefill-1"), JobAccepted)
        assert second.request_id == request.request_id
        pull.release.set()
        with pytest.raises(Unavailable):
            await first
        assert pull.joins == ["prefill-0"]
        reader = ChunkReader(inbox, TokenChunk, "decode-0", first_chunk_timeout_s=5)
        with pytest.raises(Unavailable) as ended:
            await reader.next()
        assert "prefill-0" in ended.value.message


async def test_the_same_prefills_resend_is_answered_once_the_pull_it_resends_for_is_done(
    bus_factory: BusFactory, tmp_path: Path
) -> None:
    """A prefill whose SuffixReady got no answer in time sends it again (its first copy, or
    the answer, lost with a NATS server): the resend is not joined again, and not answered
    while the first copy's pull still reads the prefill's staged region, but with the pull's
    outcome once it is done."""
    bus = await bus_factory("decode", "decode-0")
    async with decode_worker(bus, tmp_path) as (worker, config):
        pull = HeldPull()
        worker._join = pull  # type: ignore[method-assign]
        caller, _, request = await a_job_awaiting_its_suffix(bus, bus_factory, worker, config)
        subjects = bus.subjects
        suffix = subjects.instance(subjects.decode_suffix, "decode-0")

        def send(prefill_worker_id: str) -> asyncio.Task[JobAccepted]:
            ready = suffix_without_blocks(request, worker, prefill_worker_id)
            return asyncio.create_task(caller.request(suffix, ready, JobAccepted))

        first = send("prefill-0")
        await pull.pulling.wait()
        resend = send("prefill-0")
        # Sent after the resend on the same connection, answered at once: by its answer the
        # worker has taken the resend in too.
        assert (await send("prefill-1")).request_id == request.request_id
        assert not resend.done()
        pull.release.set()
        for call in (first, resend):
            with pytest.raises(Unavailable):
                await call
        assert pull.joins == ["prefill-0"]


async def test_a_suffix_whose_answer_does_not_come_is_sent_again(
    bus_factory: BusFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prefill's side: a SuffixReady lost in flight (a NATS server of three killed with it)
    is sent again after RESEND_AFTER_S, not waited on for the whole handoff timeout."""
    monkeypatch.setattr(handoff, "RESEND_AFTER_S", 0.05)
    prefill = await bus_factory("prefill", "prefill-0")
    decode = await bus_factory("decode", "decode-0")
    subjects = decode.subjects
    received: list[SuffixReady] = []

    async def lose_the_first(msg: Any) -> None:
        received.append(schema.decode(msg.data, SuffixReady))
        if len(received) > 1:
            await decode.publish(msg.reply, JobAccepted(request_id="r", instance_id="decode-0"))

    await decode.subscribe_raw(
        subjects.instance(subjects.decode_suffix, "decode-0"), lose_the_first
    )
    await decode.flush()
    request = build_request(list(range(3, 103)), model="m", block_size_tokens=BLOCK)
    job = PrefillJob(request=request, decision=decision(request.request_id))
    entry = SimpleNamespace(
        job=job,
        token_ids=list(range(100)),
        num_cached_blocks=0,
        first_token_id=None,
        sampler_state=b"",
    )
    transfer_ms = await handoff.tell_decode(
        prefill,
        entry,
        PrefillTimings(),
        num_blocks=0,
        block_nbytes=64,
        region_offset=0,
        window_nbytes=0,
        timeout_s=30.0,
    )
    assert len(received) == 2 and received[0] == received[1]
    assert transfer_ms < 30_000


async def test_a_continuation_replaces_the_attempt_a_live_decode_worker_holds(
    bus_factory: BusFactory, tmp_path: Path
) -> None:
    """The caller lost sight of a decode worker that is still alive (its host cut off and
    back) and its continuation is routed there: taken, the older attempt ended without a
    usage record of its own (the continuation bills the whole request) and its prefix read
    stopped. An attempt older than the one held is still refused."""
    bus = await bus_factory("decode", "decode-0")
    async with decode_worker(bus, tmp_path) as (worker, config):
        subjects = bus.subjects
        await bus.serve(Endpoint("run", subjects.decode_run, DecodeJob, worker.handle_job))
        caller = await bus_factory("ingress")
        tokens = list(range(3, 103))
        request = build_request(tokens, model=config.model_name, block_size_tokens=BLOCK)
        resume = Resume(num_prompt_tokens=100, num_cached_tokens=0, num_output_tokens=0)
        ended: list[str] = []
        end = worker.finisher.end

        async def seen_end(state, *args):  # noqa: ANN001, ANN002, ANN202
            ended.append(state.request_id)
            return await end(state, *args)

        worker.finisher.end = seen_end  # type: ignore[method-assign]

        async def send(attempt: GenerateRequest) -> JobAccepted:
            inbox = await caller.open_inbox()
            attempt = msgspec.structs.replace(attempt, stream_inbox=inbox.subject)
            job = DecodeJob(request=attempt, decision=decision(request.request_id))
            subject = subjects.instance(subjects.decode_run, "decode-0")
            return await caller.request(subject, job, JobAccepted)

        await send(request)
        first = worker.requests[request.request_id]
        await send(msgspec.structs.replace(request, resume=resume))
        second = worker.requests[request.request_id]
        assert second is not first and second.job.request.failover_attempt == 1
        assert request.request_id not in ended  # the older attempt billed nothing
        with pytest.raises(BadRequest, match="already decoding"):
            await send(request)
        assert worker.requests[request.request_id] is second


async def test_a_continuation_takes_the_place_of_the_attempt_it_continues(
    bus_factory: BusFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The decode worker died while prefill was handing the request's suffix to it: the
    caller's continuation (same request id, `resume`) is taken, not refused as a duplicate;
    the older attempt ends its own handoff and its pages are freed. An attempt older than
    the one held is still refused."""
    # The gate holds decode's answers on purpose: no resend of an unanswered suffix here
    # (a loaded machine passed RESEND_AFTER_S and counted one suffix twice).
    monkeypatch.setattr(handoff, "RESEND_AFTER_S", 600.0)
    bus = await bus_factory("prefill", "prefill-0")
    decode = await bus_factory("decode", "decode-0")
    gate = asyncio.Event()
    suffixes: list[SuffixReady] = []

    async def hold_suffix(ready: SuffixReady, ctx: Context) -> JobAccepted:
        suffixes.append(ready)
        await gate.wait()
        return JobAccepted(request_id=ready.request_id, instance_id="decode-0")

    await decode.serve(Endpoint("suffix", decode.subjects.decode_suffix, SuffixReady, hold_suffix))
    async with prefill_worker(bus, tmp_path, simulated_model) as (worker, config):
        client = await bus_factory("router")
        tokens = list(range(3, 103))
        request = build_request(tokens, model=config.model_name, block_size_tokens=BLOCK)
        resume = Resume(num_prompt_tokens=100, num_cached_tokens=0, num_output_tokens=0)
        continuation = msgspec.structs.replace(request, resume=resume)

        def run(attempt: GenerateRequest) -> asyncio.Task[PrefillDone]:
            job = PrefillJob(request=attempt, decision=decision(request.request_id))
            subject = client.subjects.instance(client.subjects.prefill_run, "prefill-0")
            # Answered once the gate opens, however long a loaded machine took to get there.
            return asyncio.create_task(client.request(subject, job, PrefillDone, timeout_s=60))

        def num_taken() -> float:
            return worker.metrics.snapshot()["kvfabric_prefill_jobs_received_total"]

        first = run(request)
        async with asyncio.timeout(10):
            while not suffixes:  # the first attempt is handing off
                await asyncio.sleep(0.01)
        second = run(continuation)
        async with asyncio.timeout(10):
            while num_taken() < 2:  # taken, not refused
                await asyncio.sleep(0.01)
        with pytest.raises(BadRequest, match="already being prefilled"):
            await run(request)  # older than the attempt held
        assert not second.done()
        gate.set()
        await asyncio.gather(first, second)
        assert len(suffixes) == 2
        pages = worker.runner.allocator
        assert pages.num_free_blocks == pages.num_blocks  # both attempts' pages freed
