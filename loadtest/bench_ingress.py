"""Ingress overhead: the same requests through HTTP ingress and straight to the router with
`shared.client`, side by side in one run, against a mock-engine cluster.

    python -m loadtest.bench_ingress [--requests 200] [--concurrency 8]

The cluster (kv-index, swa-memcache, router, a mock prefill and decode worker of tiny-coder,
one ingress) runs as separate processes; the mock engine simulates a GPU's timing, sped up
(`--mock-speedup`) so the serving path, not the simulated model, dominates. Each request is a
short chat (a system prompt and a question, ~100 tokens, 16 new tokens, non-streaming).

The direct side sends the ids ingress would send (tokenized once, before timing) through
`shared.client.generate`; the ingress side posts the chat to `/v1/chat/completions` with
aiohttp (no SDK, so as little of the client's own cost as can be). Printed: requests/s and
p50/p99 latency of each, the ratio of requests/s and the latency ingress adds (targets:
>= 0.7x, <= 3 ms at p50; `--concurrency 1` shows the hop's own latency, without queueing).
Each side runs its rounds alternately, so machine noise lands on both.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import aiohttp

from loadtest.results import BenchResult, bench_options
from services.admin.launcher import Cluster, ClusterSpec
from shared.bus import Bus
from shared.client import build_request, generate
from shared.models import model_path
from shared.subjects import BILLING, DECODE, INGRESS, PREFILL
from shared.testing import unique_root
from shared.tokenizer import PromptTokenizer, format_for
from shared.tokenizer.chat import Chat, Message
from worker.engine.checkpoint import Checkpoint

MODEL = "tiny-coder"
KEY = "kvf-bench-ingress-key"
SYSTEM = "You are a careful coding assistant. Answer with short, tested Python code."


def question(i: int) -> str:
    return f"Request {i}: write a function that returns the {i}th Fibonacci number."


async def timed(n: int, concurrency: int, one) -> tuple[float, list[float]]:  # noqa: ANN001
    latencies: list[float] = []
    queue = list(range(n))

    async def worker() -> None:
        while queue:
            i = queue.pop()
            start = time.perf_counter()
            await one(i)
            latencies.append(time.perf_counter() - start)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return n / (time.perf_counter() - start), latencies


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def measure(args: argparse.Namespace, cluster: Cluster, result: BenchResult) -> None:
    bus = await Bus.connect(
        cluster.nats_url, service="bench", root=cluster.spec.root, creds=cluster.nats_creds
    )
    await cluster.wait_ready(bus, timeout_s=120)
    url = cluster.http_urls[0]
    checkpoint = Checkpoint(model_path(MODEL))
    tokenizer = PromptTokenizer(checkpoint.tokenizer(), format_for(checkpoint))
    prompts = {}
    for i in range(args.requests):
        chat = Chat((Message("system", SYSTEM), Message("user", question(i))))
        prompts[i] = tokenizer.encode(chat)
    result.note(
        f"prompt tokens: {statistics.mean(len(p) for p in prompts.values()):.0f} on average"
    )

    async def direct(i: int) -> None:
        request = build_request(
            prompts[i], model=MODEL, max_tokens=args.max_tokens, block_size_tokens=64
        )
        result = await generate(bus, request)
        assert result.usage is not None

    # aiohttp's client, lighter than httpx: this machine's two cores serve the client,
    # ingress and the whole cluster at once, so the client's own CPU shows in the ratio.
    http = aiohttp.ClientSession(
        url,
        connector=aiohttp.TCPConnector(limit=args.concurrency),
        headers={"authorization": f"Bearer {KEY}"},
    )

    async def via_ingress(i: int) -> None:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question(i)}]
        body = {"model": MODEL, "max_tokens": args.max_tokens, "messages": messages}
        async with http.post("/v1/chat/completions", json=body) as r:
            payload = await r.json()
            assert r.status == 200, payload
            assert payload["usage"]["completion_tokens"] > 0

    for warm in (direct, via_ingress):  # connections, caches, JIT-free but lazy imports
        await timed(min(20, args.requests), args.concurrency, warm)
    results: dict[str, list] = {"direct": [[], []], "ingress": [[], []]}
    for _ in range(args.rounds):
        for name, one in (("direct", direct), ("ingress", via_ingress)):
            rps, lat = await timed(args.requests, args.concurrency, one)
            results[name][0].append(rps)
            results[name][1].extend(lat)
    await http.close()
    await bus.close()
    result.note(
        f"{args.rounds} rounds of {args.requests} requests at concurrency {args.concurrency}, "
        f"{args.max_tokens} new tokens each (mock engine, speedup {args.mock_speedup:g})"
    )
    summary = {}
    for name, (rps, lat) in results.items():
        summary[name] = (statistics.median(rps), pct(lat, 0.5) * 1e3, pct(lat, 0.99) * 1e3)
    d, g = summary["direct"], summary["ingress"]
    peer = "shared.client straight to the router"
    result.ratio("requests/s through HTTP ingress", g[0], d[0], peer, "requests/s", 0.7)
    result.ratio("latency p50 through HTTP ingress", g[1], d[1], peer, "ms", lower_is_better=True)
    result.ratio("latency p99 through HTTP ingress", g[2], d[2], peer, "ms", lower_is_better=True)
    result.figure("latency ingress adds at p50", g[1] - d[1], "ms", 3.0, lower_is_better=True)
    result.figure("latency ingress adds at p99", g[2] - d[2], "ms")


def run(quick: bool = False, **options: object) -> BenchResult:
    """Options: the CLI's (requests, concurrency, rounds, max_tokens, mock_speedup). Quick: 40
    requests, one round."""
    defaults = {
        "requests": 200,
        "concurrency": 8,
        "rounds": 3,
        "max_tokens": 16,
        "mock_speedup": 100.0,
    }
    if quick:
        defaults |= {"requests": 40, "rounds": 1}
    args = bench_options(defaults, options)
    result = BenchResult("ingress", quick)
    mock = ["--engine", "mock", "--mock-speedup", str(args.mock_speedup)]
    with tempfile.TemporaryDirectory(prefix="kvf-bench-ingress-") as tmp:
        spec = ClusterSpec(
            state_dir=Path(tmp),
            nats_port=0,
            http_port=0,
            root=unique_root(),
            replicas={BILLING: 0},
            models=(MODEL,),
            log_level="warning",
            extra_args={PREFILL: mock, DECODE: mock, INGRESS: ["--dev-api-key", KEY]},
        )
        cluster = Cluster(spec)
        cluster.start()
        try:
            asyncio.run(measure(args, cluster, result))
        finally:
            cluster.stop()
    return result.finish()


def cli(doc: str, run: Callable[..., BenchResult]) -> None:
    """The command line of a benchmark of requests through a mock cluster (this one's and
    bench_observability's): sizes, then `run(quick, **sizes)` printed."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--mock-speedup", type=float, default=100.0)
    parser.add_argument("--quick", action="store_true", help="small sizes (CI)")
    args = vars(parser.parse_args())
    quick = args.pop("quick")
    run(quick, **({} if quick else args)).print()


def main() -> None:
    cli(__doc__ or "", run)


if __name__ == "__main__":
    main()
