"""A peer process for the tracing test: serves `echo`, and `spans`, which replies with the
spans this process finished (kept by an in-memory exporter) as JSON."""

from __future__ import annotations

import asyncio
import json
import sys

from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from shared import telemetry
from shared.bus import Bus, Context, Endpoint
from tests.service.messages import Echo, EchoReply


async def main(url: str, root: str) -> None:
    exporter = InMemorySpanExporter()
    telemetry.setup_tracing("trace-peer", "peer-0", processor=SimpleSpanProcessor(exporter))
    bus = await Bus.connect(url, service="trace-peer", instance_id="peer-0", root=root)

    async def echo(request: Echo, ctx: Context) -> EchoReply:
        return EchoReply(text=request.text, instance_id=bus.instance_id)

    async def spans(request: Echo, ctx: Context) -> EchoReply:
        finished = [
            {
                "name": s.name,
                "trace_id": format(s.context.trace_id, "032x"),
                "parent_span_id": format(s.parent.span_id, "016x") if s.parent else None,
            }
            for s in exporter.get_finished_spans()
        ]
        return EchoReply(text=json.dumps(finished), instance_id=bus.instance_id)

    for name, handler in (("echo", echo), ("spans", spans)):
        await bus.serve(Endpoint(name, bus.subjects.endpoint("trace-peer", name), Echo, handler))
    await bus.flush()
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until stdin closes
    await bus.stop_serving(1.0)
    await bus.close()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))
