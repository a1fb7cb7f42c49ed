"""The cost of instrumentation: the same requests through three mock-engine clusters that differ
only in their observability, side by side in one run.

    python -m loadtest.bench_observability [--requests 200] [--concurrency 8] [--rounds 3]

- **off**: nothing exports spans (the tracer samples nothing, so no request makes a span) and
  nothing scrapes `/metrics`. Metric updates themselves are always made: discovery and
  `kvfabric status` read the same registry, so there is no build without them.
- **1%** and **100%**: every process writes its spans to a trace directory (`--trace-dir`, as
  `kvfabric up --trace-dir` does; the OTLP exporter batches the same spans on the same
  background thread) with that share of requests traced, and every process's `/metrics` is
  scraped once a second while the cluster is measured (Prometheus' default is 15 s).

Each cluster (kv-index, swa-memcache, router, a mock prefill and decode worker of tiny-coder,
ingress, billing) runs as separate processes; all three are up for the whole run and take
their rounds in turn, the order rotated each round, so machine noise lands on all of them.
Each request is a streamed chat completion over HTTP (~100 prompt tokens, 16 new tokens),
sent with aiohttp. The mock engine is sped up (`--mock-speedup`) so the serving path, where
the instrumentation lives, dominates: the harshest setting for the ratio.

Printed: requests/s and p50 latency of each instrumented cluster against the bare one
(target: >= 0.9x requests/s at 1%), and the spans each traced request wrote.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from loadtest.bench_ingress import KEY, MODEL, SYSTEM, cli, pct, question, timed
from loadtest.results import BenchResult, bench_options
from services.admin.launcher import Cluster, ClusterSpec
from shared.bus import Bus
from shared.subjects import DECODE, INGRESS, PREFILL
from shared.telemetry import REQUEST_ID
from shared.testing import unique_root

SCRAPE_INTERVAL_S = 1.0


@dataclass
class Setting:
    name: str
    sample_ratio: float | None  # None: no exporter, nothing scraped
    cluster: Cluster | None = None
    http: aiohttp.ClientSession | None = None

    @property
    def is_instrumented(self) -> bool:
        return self.sample_ratio is not None


SETTINGS = (("off", None), ("1%", 0.01), ("100%", 1.0))


def cluster_for(setting: Setting, state_dir: Path, mock_speedup: float) -> Cluster:
    mock = ["--engine", "mock", "--mock-speedup", str(mock_speedup)]
    traced = setting.is_instrumented
    spec = ClusterSpec(
        state_dir=state_dir,
        nats_port=0,
        http_port=0,
        root=unique_root(),
        models=(MODEL,),
        log_level="warning",
        extra_args={PREFILL: mock, DECODE: mock, INGRESS: ["--dev-api-key", KEY]},
        trace_dir=state_dir / "traces" if traced else None,
        trace_sample_ratio=setting.sample_ratio if traced else 1.0,
    )
    return Cluster(spec)


async def scrape_while(urls: list[str], http: aiohttp.ClientSession, stop: asyncio.Event) -> int:
    """GET every /metrics once per interval until `stop`; the number of scrapes."""
    scrapes = 0
    while not stop.is_set():
        for url in urls:
            async with http.get(url) as r:
                assert r.status == 200, f"{url}: {r.status}"
                await r.read()
            scrapes += 1
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), SCRAPE_INTERVAL_S)
    return scrapes


def chat_request(http: aiohttp.ClientSession, max_tokens: int) -> Callable[[int], Awaitable]:
    async def one(i: int) -> None:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question(i)}]
        body = {"model": MODEL, "max_tokens": max_tokens, "messages": messages, "stream": True}
        async with http.post("/v1/chat/completions", json=body) as r:
            assert r.status == 200, await r.text()
            chunks = 0
            async for line in r.content:
                if line.startswith(b"data: {"):
                    chunks += 1
                elif line.startswith(b"data: [DONE]"):
                    break
            assert chunks > 0, "a stream without a chunk"

    return one


async def measure(args: argparse.Namespace, settings: list[Setting], result: BenchResult) -> None:
    for s in settings:
        assert s.cluster is not None
        bus = await Bus.connect(
            s.cluster.nats_url,
            service="bench",
            root=s.cluster.spec.root,
            creds=s.cluster.nats_creds,
        )
        await s.cluster.wait_ready(bus, timeout_s=120)
        await bus.close()
        s.http = aiohttp.ClientSession(
            s.cluster.http_urls[0],
            connector=aiohttp.TCPConnector(limit=args.concurrency),
            headers={"authorization": f"Bearer {KEY}"},
        )
    scraper = aiohttp.ClientSession()
    rps: dict[str, list[float]] = {s.name: [] for s in settings}
    latencies: dict[str, list[float]] = {s.name: [] for s in settings}
    scrapes = 0
    try:
        for s in settings:  # warm-up: connections, lazy imports, the tokenizer's caches
            assert s.http is not None
            await timed(min(20, args.requests), args.concurrency, chat_request(s.http, 4))
        for round_ in range(args.rounds):
            for s in settings[round_ % len(settings) :] + settings[: round_ % len(settings)]:
                assert s.http is not None and s.cluster is not None
                stop = asyncio.Event()
                scraping = None
                if s.is_instrumented:
                    urls = list(s.cluster.metrics_urls.values())
                    scraping = asyncio.create_task(scrape_while(urls, scraper, stop))
                one = chat_request(s.http, args.max_tokens)
                r, lat = await timed(args.requests, args.concurrency, one)
                stop.set()
                if scraping is not None:
                    scrapes += await scraping
                rps[s.name].append(r)
                latencies[s.name].extend(lat)
    finally:
        await scraper.close()
        for s in settings:
            if s.http is not None:
                await s.http.close()
    off = settings[0].name
    base_rps, base_p50 = statistics.median(rps[off]), pct(latencies[off], 0.5) * 1e3
    for s in settings[1:]:
        peer = "the same cluster with nothing exported or scraped"
        target = 0.9 if s.name == "1%" else None
        result.ratio(
            f"requests/s, tracing at {s.name} and metrics scraped",
            statistics.median(rps[s.name]),
            base_rps,
            peer,
            "requests/s",
            target,
        )
        result.ratio(
            f"latency p50, tracing at {s.name} and metrics scraped",
            pct(latencies[s.name], 0.5) * 1e3,
            base_p50,
            peer,
            "ms",
            lower_is_better=True,
        )
    result.note(
        f"{args.rounds} rounds of {args.requests} streamed requests per cluster at concurrency "
        f"{args.concurrency}, {args.max_tokens} new tokens each (mock engine, speedup "
        f"{args.mock_speedup:g}); every /metrics scraped each {SCRAPE_INTERVAL_S:g} s while "
        f"measured ({scrapes} scrapes)"
    )


def spans_written(trace_dir: Path) -> tuple[int, int]:
    """(spans, requests traced) in a cluster's trace files: the spans of traces that carry a
    request id (a request's), and how many such traces."""
    spans: dict[str, int] = {}
    of_requests: set[str] = set()
    for path in trace_dir.glob("*.jsonl"):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            spans[record["trace_id"]] = spans.get(record["trace_id"], 0) + 1
            if REQUEST_ID in record["attributes"]:
                of_requests.add(record["trace_id"])
    return sum(spans[t] for t in of_requests), len(of_requests)


def run(quick: bool = False, **options: object) -> BenchResult:
    """Options: the CLI's (requests, concurrency, rounds, max_tokens, mock_speedup). Quick: 30
    requests, one round."""
    defaults = {
        "requests": 200,
        "concurrency": 8,
        "rounds": 3,
        "max_tokens": 16,
        "mock_speedup": 100.0,
    }
    if quick:
        defaults |= {"requests": 30, "rounds": 1}
    args = bench_options(defaults, options)
    result = BenchResult("observability", quick)
    settings = [Setting(name, ratio) for name, ratio in SETTINGS]
    with tempfile.TemporaryDirectory(prefix="kvf-bench-observability-") as tmp:
        try:
            for s in settings:
                s.cluster = cluster_for(s, Path(tmp) / s.name.rstrip("%"), args.mock_speedup)
                s.cluster.start()
            asyncio.run(measure(args, settings, result))
        finally:
            for s in settings:
                if s.cluster is not None:
                    s.cluster.stop()  # flushes every process's spans
        # warm-up plus measured requests, per cluster
        sent = min(20, args.requests) + args.rounds * args.requests
        for s in settings[1:]:
            assert s.cluster is not None and s.cluster.spec.trace_dir is not None
            num_spans, num_traces = spans_written(s.cluster.spec.trace_dir)
            if s.sample_ratio == 1.0:
                if num_traces < sent:
                    raise RuntimeError(
                        f"tracing at 100% wrote {num_traces} traces for {sent} "
                        "requests: the instrumented side did not trace"
                    )
                result.figure("spans per traced request", num_spans / num_traces, "spans")
            result.note(
                f"tracing at {s.name}: {num_traces} of {sent} requests traced, {num_spans} spans"
            )
    return result.finish()


def main() -> None:
    cli(__doc__ or "", run)


if __name__ == "__main__":
    main()
