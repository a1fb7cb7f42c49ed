"""A trace started in one process continues in another (W3C traceparent in NATS headers)."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from shared import telemetry
from shared.natsd import NatsServer
from shared.testing.fixtures import BusFactory
from tests.service.messages import Echo, EchoReply

pytestmark = pytest.mark.nats
REPO = Path(__file__).resolve().parents[2]


async def test_trace_continues_in_another_process(
    nats_server: NatsServer, subject_root: str, bus_factory: BusFactory
) -> None:
    exporter = InMemorySpanExporter()
    telemetry.setup_tracing("test", "test-0", processor=SimpleSpanProcessor(exporter))
    peer = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.service.trace_peer",
        nats_server.url,
        subject_root,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        cwd=REPO,
    )
    try:
        assert peer.stdout is not None and peer.stdin is not None
        assert (await asyncio.wait_for(peer.stdout.readline(), 30)).strip() == b"ready"
        client = await bus_factory("client")
        with telemetry.tracer().start_as_current_span("agent step") as span:
            trace_id = format(span.get_span_context().trace_id, "032x")
            span_id = format(span.get_span_context().span_id, "016x")
            await client.request(
                client.subjects.endpoint("trace-peer", "echo"), Echo(text="x"), EchoReply
            )
        reply = await client.request(
            client.subjects.endpoint("trace-peer", "spans"), Echo(text=""), EchoReply
        )
        spans = json.loads(reply.text)
        echo_spans = [s for s in spans if s["name"] == "echo"]
        assert len(echo_spans) == 1
        assert echo_spans[0]["trace_id"] == trace_id
        assert echo_spans[0]["parent_span_id"] == span_id
        assert any(s.name == "agent step" for s in exporter.get_finished_spans())
    finally:
        peer.stdin.close()
        await asyncio.wait_for(peer.wait(), 10)
