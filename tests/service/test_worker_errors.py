"""A worker's unexpected failure reaches its caller as a code and a fixed message, never the
exception's text, and the log holds its traceback exactly once. Mock workers in this process
(their engine is the only thing replaced: a pass that raises), over a real nats-server."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
from structlog.testing import capture_logs
from tokenizers import Tokenizer

from services.decode.config import DecodeConfig
from services.decode.finish import Finisher
from services.decode.mock_worker import MockDecodeWorker
from services.prefill.config import PrefillConfig
from services.prefill.mock_worker import MockPrefillWorker
from shared.bus import Endpoint
from shared.client import build_request
from shared.schema import (
    DecodeJob,
    InternalError,
    JobAccepted,
    PrefillDone,
    PrefillJob,
    RouteDecision,
    SuffixReady,
    TokenChunk,
)
from shared.streams import ChunkReader
from shared.subjects import DECODE
from shared.testing.fixtures import BusFactory
from shared.usage import open_usage_outbox
from worker.kvstore.writer import KvEventPublisher
from worker.mock_engine import MockEngine, MockEngineConfig, MockModel
from worker.serving.kv_io import open_mock_store

pytestmark = pytest.mark.nats

SECRET = "secret token in /srv/keys/prod.pem"
BLOCK = 16


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


async def test_a_failed_prefill_pass_answers_a_fixed_message(
    bus_factory: BusFactory, tmp_path: Path
) -> None:
    bus = await bus_factory("prefill", "prefill-0")
    config = PrefillConfig(engine="mock", store_dir=tmp_path, kv_block_size_tokens=BLOCK)
    store = await open_mock_store(config, bus.instance_id)
    publisher = KvEventPublisher(bus, store)
    worker = MockPrefillWorker(bus, publisher, None, config, MockModel.from_config(config))

    async def broken_pass(batch: object) -> float:
        raise RuntimeError(SECRET)

    worker._forward = broken_pass  # type: ignore[method-assign]
    worker.start()
    await bus.serve(Endpoint("run", bus.subjects.prefill_run, PrefillJob, worker.handle_job))
    client = await bus_factory("router")
    request = build_request(list(range(3, 103)), model=config.model_name, block_size_tokens=BLOCK)
    try:
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
    finally:
        await worker.stop()
        store.close()


async def test_a_failed_join_ends_the_stream_with_a_fixed_message(
    bus_factory: BusFactory, tmp_path: Path
) -> None:
    bus = await bus_factory("decode", "decode-0")
    config = DecodeConfig(engine="mock", store_dir=tmp_path, kv_block_size_tokens=BLOCK)
    model = MockModel.from_config(config)
    store = await open_mock_store(config, bus.instance_id)
    outbox = await open_usage_outbox(bus, DECODE, tmp_path / "outbox", bus.instance_id)
    finisher = Finisher(bus, store, KvEventPublisher(bus, store), None, outbox)
    engine = MockEngine(MockEngineConfig(model_id=model.name, block_size_tokens=BLOCK))
    tokenizer = Tokenizer.from_file(str(config.model_path / "tokenizer.json"))
    worker = MockDecodeWorker(bus, engine, tokenizer, finisher, config, model)

    async def broken_join(state: object, ready: object) -> int:
        raise RuntimeError(SECRET)

    worker._join = broken_join  # type: ignore[method-assign]
    worker.start()
    subjects = bus.subjects
    await bus.serve(Endpoint("run", subjects.decode_run, DecodeJob, worker.handle_job))
    await bus.serve(Endpoint("suffix", subjects.decode_suffix, SuffixReady, worker.handle_suffix))
    caller = await bus_factory("ingress")
    inbox = await caller.open_inbox()
    request = build_request(list(range(3, 103)), model=model.name, block_size_tokens=BLOCK)
    request = msgspec.structs.replace(request, stream_inbox=inbox.subject)
    try:
        await caller.request(
            subjects.instance(subjects.decode_run, "decode-0"),
            DecodeJob(request=request, decision=decision(request.request_id)),
            JobAccepted,
        )
        ready = SuffixReady(
            request_id=request.request_id,
            attempt=0,
            prefill_worker_id="prefill-0",
            num_computed_tokens=99,
            first_block_index=0,
            num_blocks=0,
            block_nbytes=4096,
            region_offset=0,
            window_nbytes=0,
        )
        with capture_logs() as events, pytest.raises(InternalError) as caught:
            await caller.request(
                subjects.instance(subjects.decode_suffix, "decode-0"), ready, JobAccepted
            )
        assert caught.value.message == "internal error"
        reader = ChunkReader(inbox, TokenChunk, "decode-0", first_chunk_timeout_s=5)
        with pytest.raises(InternalError) as ended:
            await reader.next()
        assert ended.value.message == "joining the suffix failed"
        assert await outbox.flush(timeout_s=5)  # the failed request is billed all the same
        one_traceback(events)
    finally:
        await worker.stop()
        await outbox.close()
        store.close()
