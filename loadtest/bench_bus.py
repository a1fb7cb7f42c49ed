"""Bus benchmark: request/reply latency and event throughput through `shared.bus` against raw
nats-py, side by side in one run on one nats-server (this machine is shared and noisy, so
only the ratios mean anything).

    python -m loadtest.bench_bus [--requests 3000] [--events 50000]

Request/reply: the same payload bytes, one request at a time, raw and bus blocks interleaved.
The bus side pays for what the cluster relies on: MessagePack encode/decode of typed structs,
request id / deadline / schema / traceparent headers, a server span per request and a task
per request. Events: one publisher, one subscriber; the bus side decodes every event.
Targets (issue 2): p50 within 1.3x of raw, events/s at least 0.8x.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import nats
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from loadtest.results import BenchResult
from shared import telemetry
from shared.bus import Bus, Context, Endpoint
from shared.natsd import NatsServer
from shared.schema import Message, encode
from shared.subjects import Subjects


class Ping(Message, tag="bench_ping"):
    request_id: str
    payload: bytes


PAYLOAD = Ping(request_id="bench-0001", payload=b"x" * 200)
BLOCK = 200  # requests per interleaved block


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def bench_requests(url: str, num_requests: int) -> tuple[list[float], list[float]]:
    subjects = Subjects("bench.kvf.v1")
    raw_subject, bus_subject = subjects.endpoint("bench", "raw"), subjects.endpoint("bench", "bus")
    raw_server, raw_client = await nats.connect(url), await nats.connect(url)

    async def raw_handler(msg) -> None:  # noqa: ANN001
        await msg.respond(msg.data)

    await raw_server.subscribe(raw_subject, queue="bench", cb=raw_handler)
    server = await Bus.connect(url, service="bench", root=subjects.root)
    client = await Bus.connect(url, service="bench-client", root=subjects.root)

    async def bus_handler(request: Ping, ctx: Context) -> Ping:
        return request

    await server.serve(Endpoint("bus", bus_subject, Ping, bus_handler))
    await server.flush()
    data = encode(PAYLOAD)
    raw_s: list[float] = []
    bus_s: list[float] = []
    for _ in range(20):  # warm up both paths
        await raw_client.request(raw_subject, data, timeout=5)
        await client.request(bus_subject, PAYLOAD, Ping, request_id=PAYLOAD.request_id)
    for _ in range(num_requests // BLOCK):
        for _ in range(BLOCK):
            started = time.perf_counter()
            await raw_client.request(raw_subject, data, timeout=5)
            raw_s.append(time.perf_counter() - started)
        for _ in range(BLOCK):
            started = time.perf_counter()
            await client.request(bus_subject, PAYLOAD, Ping, request_id=PAYLOAD.request_id)
            bus_s.append(time.perf_counter() - started)
    for closer in (raw_server.drain(), raw_client.drain(), server.close(), client.close()):
        await closer
    return raw_s, bus_s


async def events_per_s_raw(url: str, subject: str, num_events: int) -> float:
    publisher, consumer = await nats.connect(url), await nats.connect(url)
    done, received = asyncio.Event(), [0]
    data = encode(PAYLOAD)

    async def on_event(msg) -> None:  # noqa: ANN001
        received[0] += 1
        if received[0] == num_events:
            done.set()

    await consumer.subscribe(subject, cb=on_event, pending_msgs_limit=num_events + 1)
    await consumer.flush()
    await consumer.flush()
    started = time.perf_counter()
    for _ in range(num_events):
        await publisher.publish(subject, data)
    await asyncio.wait_for(done.wait(), 120)
    elapsed = time.perf_counter() - started
    await publisher.drain()
    await consumer.drain()
    return num_events / elapsed


async def events_per_s_bus(url: str, subject: str, num_events: int) -> float:
    publisher = await Bus.connect(url, service="bench-pub", root="bench.kvf.v1")
    consumer = await Bus.connect(url, service="bench-sub", root="bench.kvf.v1")
    done, received = asyncio.Event(), [0]

    async def on_event(event: Ping) -> None:
        received[0] += 1
        if received[0] == num_events:
            done.set()

    await consumer.subscribe(subject, Ping, on_event)
    await consumer.flush()
    started = time.perf_counter()
    for _ in range(num_events):
        await publisher.publish(subject, PAYLOAD)
    await asyncio.wait_for(done.wait(), 120)
    elapsed = time.perf_counter() - started
    await publisher.close()
    await consumer.close()
    return num_events / elapsed


async def measure(num_requests: int, num_events: int, trace: bool, result: BenchResult) -> None:
    # As in a service: tracing off unless exporting. --trace records every span (in memory)
    # to show what tracing costs.
    processor = SimpleSpanProcessor(InMemorySpanExporter()) if trace else None
    telemetry.setup_tracing("bench", "bench-0", processor=processor)
    with (
        tempfile.TemporaryDirectory(prefix="kvf-bench-") as state_dir,
        NatsServer(Path(state_dir)) as server,
    ):
        result.note(
            f"{num_requests} requests, {num_events} events per side on one nats-server; "
            f"tracing {'on (every span recorded)' if trace else 'off (the default)'}"
        )
        raw_s, bus_s = await bench_requests(server.url, num_requests)
        subjects = Subjects("bench.kvf.v1")
        raw_rates, bus_rates = [], []
        for round_id in range(3):  # alternate to spread the machine's noise over both
            subject = subjects.endpoint("events", f"r{round_id}")
            raw_rates.append(await events_per_s_raw(server.url, subject + "raw", num_events))
            bus_rates.append(await events_per_s_bus(server.url, subject + "bus", num_events))
    result.ratio(
        "request/reply p50",
        statistics.median(bus_s) * 1e6,
        statistics.median(raw_s) * 1e6,
        "raw nats-py",
        "us",
        1.3,
        lower_is_better=True,
    )
    result.ratio(
        "request/reply p99",
        percentile(bus_s, 0.99) * 1e6,
        percentile(raw_s, 0.99) * 1e6,
        "raw nats-py",
        "us",
        lower_is_better=True,
    )
    result.ratio(
        "events/s, one publisher and one subscriber",
        statistics.median(bus_rates),
        statistics.median(raw_rates),
        "raw nats-py",
        "events/s",
        0.8,
    )


def run(
    quick: bool = False,
    *,
    num_requests: int | None = None,
    num_events: int | None = None,
    trace: bool = False,
) -> BenchResult:
    result = BenchResult("bus", quick)
    num_requests = num_requests or (400 if quick else 3000)
    num_events = num_events or (5000 if quick else 50_000)
    asyncio.run(measure(num_requests, num_events, trace, result))
    return result.finish()


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--events", type=int, default=50_000)
    parser.add_argument("--trace", action="store_true", help="record a span per request")
    parser.add_argument("--quick", action="store_true", help="small sizes (CI)")
    args = parser.parse_args()
    sizes = {} if args.quick else {"num_requests": args.requests, "num_events": args.events}
    run(args.quick, trace=args.trace, **sizes).print()


if __name__ == "__main__":
    main()
