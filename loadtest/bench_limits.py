"""Rate-limit benchmark: how exactly two ingress replicas hold a limit together, and what the
limiter costs a request, side by side in one run on one nats-server.

    python -m loadtest.bench_limits [--window-s 60] [--limit 600]

Accuracy: two `Limiter`s (services/ingress/limits.py) on connections of their own, as two
ingress replicas, are offered 3x a requests-per-minute limit, alternately and evenly paced,
for one window; what they admitted together against the limit (target: within 5%).
Cost: a request's bus round trip (what ingress pays to reach the router) with and without
the limiter's admission and settlement on it, for a key and an account with every
per-minute limit and a concurrency limit set (never reached), interleaved in blocks.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from loadtest.results import BenchResult
from services.ingress.errors import ApiError
from services.ingress.limits import Limiter, Scope
from shared.accounts import Limits
from shared.bus import Bus, Context, Endpoint
from shared.natsd import NatsServer
from shared.schema import CancelRequest

# A root per measurement: the limits stream of one is not the window of the other.
ACCURACY_ROOT, COST_ROOT = "benchlimits-accuracy.kvf.v1", "benchlimits-cost.kvf.v1"
BLOCK = 100


async def accuracy(url: str, window_s: float, limit: int) -> tuple[int, int]:
    """(admitted, offered) by two replicas offered 3x `limit` over one window."""
    replicas = []
    for name in ("ingress-0", "ingress-1"):
        bus = await Bus.connect(url, service="ingress", instance_id=name, root=ACCURACY_ROOT)
        limiter = Limiter(bus, window_s=window_s)
        await limiter.start()
        replicas.append((bus, limiter))
    scope = Scope("account.bench", Limits(requests_per_minute=limit))
    interval_s = window_s / (3 * limit)
    admitted = offered = 0
    started = time.monotonic()
    try:
        while time.monotonic() - started < window_s * 0.98:
            limiter = replicas[offered % 2][1]
            offered += 1
            try:
                await limiter.admit(
                    [scope], num_prompt_tokens=100, max_output_tokens=100, protocol="openai"
                )
                admitted += 1
            except ApiError:
                pass
            next_at = started + offered * interval_s
            await asyncio.sleep(max(next_at - time.monotonic(), 0))
    finally:
        for bus, limiter in replicas:
            await limiter.stop()
            await bus.close()
    return admitted, offered


async def cost(url: str, num_requests: int) -> tuple[list[float], list[float]]:
    """Seconds per request: a bus round trip alone, and with admit + end around it."""
    server = await Bus.connect(url, service="router", root=COST_ROOT)
    client = await Bus.connect(url, service="ingress", instance_id="ingress-9", root=COST_ROOT)
    subject = server.subjects.endpoint("bench", "echo")

    async def echo(request: CancelRequest, ctx: Context) -> CancelRequest:
        return request

    await server.serve(Endpoint("echo", subject, CancelRequest, echo))
    await server.flush()
    limiter = Limiter(client)
    await limiter.start()
    big = 10**12  # every limit set, none reached
    limits = Limits(
        requests_per_minute=big,
        input_tokens_per_minute=big,
        output_tokens_per_minute=big,
        concurrent_requests=big,
    )
    scopes = [Scope("key.key_0123456789ab", limits), Scope("account.bench", limits)]
    message = CancelRequest(request_id="bench")
    plain: list[float] = []
    limited: list[float] = []
    try:
        for _ in range(20):
            await client.request(subject, message, CancelRequest)
        for _ in range(num_requests // BLOCK):
            for _ in range(BLOCK):
                started = time.perf_counter()
                await client.request(subject, message, CancelRequest)
                plain.append(time.perf_counter() - started)
            for _ in range(BLOCK):
                started = time.perf_counter()
                admission = await limiter.admit(
                    scopes, num_prompt_tokens=1000, max_output_tokens=200, protocol="openai"
                )
                await client.request(subject, message, CancelRequest)
                await limiter.end(admission, 150)
                limited.append(time.perf_counter() - started)
    finally:
        await limiter.stop()
        await client.close()
        await server.close()
    return plain, limited


async def measure(window_s: float, limit: int, num_requests: int, result: BenchResult) -> None:
    with tempfile.TemporaryDirectory() as tmp, NatsServer(Path(tmp)) as server:
        plain, limited = await cost(server.url, num_requests)
        p50_plain, p50_limited = statistics.median(plain), statistics.median(limited)
        result.ratio(
            "request p50 with the limiter (admit + end around a bus round trip)",
            p50_limited * 1e6,
            p50_plain * 1e6,
            "the round trip alone",
            "us",
            lower_is_better=True,
        )
        result.figure("limiter cost per request (p50)", (p50_limited - p50_plain) * 1e6, "us")
        admitted, offered = await accuracy(server.url, window_s, limit)
        result.ratio(
            f"admitted by two replicas offered 3x the limit over one {window_s:g} s window",
            admitted,
            limit,
            "the limit",
            "requests",
            target=1.05,
            lower_is_better=True,
        )
        result.figure("requests offered", offered, "requests")
        result.note(
            f"Limit {limit} requests per window of {window_s:g} s; admitted must be within 5% "
            "of it (the ratio above, at most 1.05, and at least 0.95)."
        )


def run(
    quick: bool = False,
    *,
    window_s: float | None = None,
    limit: int | None = None,
    num_requests: int | None = None,
) -> BenchResult:
    result = BenchResult("limits", quick)
    asyncio.run(
        measure(
            window_s or (3.0 if quick else 60.0),
            limit or (30 if quick else 600),
            num_requests or (400 if quick else 3000),
            result,
        )
    )
    return result.finish()


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--window-s", type=float, default=60.0)
    parser.add_argument("--limit", type=int, default=600)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--quick", action="store_true", help="a 3 s window, small sizes (CI)")
    args = parser.parse_args()
    sizes = (
        {}
        if args.quick
        else {"window_s": args.window_s, "limit": args.limit, "num_requests": args.requests}
    )
    run(args.quick, **sizes).print()


if __name__ == "__main__":
    main()
