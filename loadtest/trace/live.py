"""The trace replayed live: a cluster of real processes on the mock engine, started here;
the trace's first requests sent at their time-scaled arrivals through `shared.client`
(token ids straight to the router, as bench_ingress's direct side does); the hit share the
cluster reports in each request's usage set against the offline replay's prediction for the
same requests on the same topology (one shared store, as many workers, the same clock).

What is reduced, and `LiveResult.reductions` says so with the numbers of the run:
- the first `num_requests` requests only, arriving `speed` x faster than in the trace;
- prompts cut to `max_model_len - max_output_tokens` tokens (the mock workers' context is
  set to `max_model_len`; tiny-coder's own is 512, and the mock runs no model, so the
  context is only a limit here); a cut prompt keeps the prefix it shares with the others;
- each answer capped at `max_output_tokens` (answer blocks never hit a synthetic prompt, so
  output length moves no hit, only time);
- the mock's simulated GPU time runs `mock_speedup` x faster than the wall clock (the
  prediction's cost model is sped up by as much), and the router's admission control is
  off, so no request is refused and retried (the offline replay admits everything too).
"""

from __future__ import annotations

import asyncio
import tempfile
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import msgspec

from loadtest.trace.offline import ReplayConfig, ReplayResult, replay
from loadtest.trace.synth import PromptHashes, TraceRequest, arrivals_s, prompt_token_ids
from services.admin.launcher import Cluster, ClusterSpec
from services.router.policy import PLACEMENTS
from shared.bus import Bus, now_ms
from shared.client import build_request, generate
from shared.models import model_path, served_name
from shared.schema import GenerateRequest
from shared.subjects import BILLING, DECODE, DEFAULT_ROOT, INGRESS, PREFILL, ROUTER
from worker.cost_model import CostModel
from worker.engine.checkpoint import Checkpoint

# The router admits every request, as the offline replay does: no TTFT objective, no bound on
# a prefill queue (a refused request would be sent again later than the trace says).
NO_ADMISSION = ["--ttft-objective-s", "0", "--max-queued-tokens", str(1 << 40)]


@dataclass(frozen=True)
class LiveConfig:
    num_requests: int = 200
    # The trace's arrivals, this many times faster. The mock moves the model's real KV bytes
    # (2.27M prompt tokens: 3.4 GB of tiny-coder blocks stored, and each prompt's pages
    # handed off): on a 2-core host the cluster keeps 2x (72 s of trace in 36.8 s, every hit
    # as predicted); at 10x it fell behind (33.7 s), and turns came before their prefixes
    # were stored.
    speed: float = 2.0
    mock_speedup: float = 10.0  # simulated GPU seconds per wall-clock second
    num_workers: int = 2  # prefill workers
    num_decode_workers: int | None = None  # None: as many as prefill workers
    max_model_len: int = 32_768  # the mock workers' context
    max_output_tokens: int = 16
    model: str = "tiny-coder"
    ready_timeout_s: float = 120.0
    placement: str = "kv"  # the router's (`[router] placement`), and the prediction's

    def __post_init__(self) -> None:
        if self.num_decode_workers is not None and self.num_decode_workers <= 0:
            raise ValueError(f"num_decode_workers must be > 0, got {self.num_decode_workers}")
        for name in ("num_requests", "num_workers", "max_output_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not self.speed > 0 or not self.mock_speedup > 0:
            raise ValueError("speed and mock_speedup must be > 0")
        if self.max_model_len <= self.max_output_tokens:
            raise ValueError("max_model_len must exceed max_output_tokens")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {', '.join(PLACEMENTS)}")

    @property
    def max_prompt_tokens(self) -> int:
        return self.max_model_len - self.max_output_tokens


@dataclass(frozen=True)
class LiveOutcome:
    index: int
    num_prompt_tokens: int
    num_cached_tokens: int  # as the cluster's usage says
    ttft_s: float | None  # request sent -> first token, wall clock (None: no token came)
    error: str | None = None  # the exception's type and message when the request failed


@dataclass
class LiveResult:
    config: LiveConfig
    requests: list[TraceRequest]  # as sent: cut
    outcomes: list[LiveOutcome]  # in trace order
    predicted: ReplayResult  # the offline replay of the same requests
    num_cut: int  # requests whose prompt was cut
    num_tokens_cut: int
    wall_s: float  # first request sent -> last answered

    @property
    def answered(self) -> list[LiveOutcome]:
        return [o for o in self.outcomes if o.error is None]

    @property
    def errors(self) -> Counter[str]:
        return Counter(o.error.split(":")[0] for o in self.outcomes if o.error is not None)

    @property
    def hit_share(self) -> float:
        """Cached over prompt tokens, from the usage of the requests answered."""
        answered = self.answered
        return sum(o.num_cached_tokens for o in answered) / max(
            sum(o.num_prompt_tokens for o in answered), 1
        )

    @property
    def predicted_share(self) -> float:
        """The offline replay's share over the same requests (those answered)."""
        indices = {o.index for o in self.answered}
        chosen = [o for o in self.predicted.outcomes if o.index in indices]
        return sum(o.num_cached_tokens for o in chosen) / max(
            sum(o.num_prompt_tokens for o in chosen), 1
        )

    @property
    def num_exact(self) -> int:
        """Answered requests whose cached tokens are exactly the prediction's."""
        predicted = {o.index: o.num_cached_tokens for o in self.predicted.outcomes}
        return sum(o.num_cached_tokens == predicted[o.index] for o in self.answered)

    def ttft_s(self, quantile: float) -> float:
        ordered = sorted(o.ttft_s for o in self.answered if o.ttft_s is not None)
        if not ordered:
            raise ValueError("no request produced a token")
        return ordered[min(len(ordered) - 1, int(quantile * len(ordered)))]

    def reductions(self) -> list[str]:
        c = self.config
        num_decode = c.num_decode_workers or c.num_workers
        span_s = (self.requests[-1].timestamp_ms - self.requests[0].timestamp_ms) / 1000
        return [
            f"the first {len(self.requests)} requests of the trace, arrivals {c.speed:g}x "
            f"faster ({span_s:.0f} s of trace in {self.wall_s:.1f} s)",
            f"{self.num_cut} prompts cut to {c.max_prompt_tokens:,} tokens ({self.num_tokens_cut:,}"
            f" of {sum(r.input_length for r in self.requests) + self.num_tokens_cut:,} prompt "
            "tokens dropped)",
            f"answers capped at {c.max_output_tokens} tokens; mock engine {c.mock_speedup:g}x "
            f"faster than its cost model; {c.num_workers} prefill + {num_decode} decode "
            f"workers of {c.model}; router admission control off",
        ]


def sped_up(cost: CostModel, factor: float) -> CostModel:
    """The cost model of a mock engine run `factor` x faster than simulated (`mock_speedup`)."""
    return cost.sped_up(factor)


def run_live(trace: Sequence[TraceRequest], config: LiveConfig) -> LiveResult:
    """Start the cluster, replay the first requests of `trace`, stop it; the figures."""
    full = list(trace[: config.num_requests])
    requests = [r.cut(config.max_prompt_tokens) for r in full]
    model = served_name(config.model)
    vocab_size = Checkpoint(model_path(config.model)).config().vocab_size
    prompts = PromptHashes(model, vocab_size)
    predicted = replay(
        requests,
        prompts,
        ReplayConfig(
            num_workers=config.num_workers,
            speed=config.speed,
            cost=sped_up(CostModel(), config.mock_speedup),
            max_output_tokens=config.max_output_tokens,
        ),
        config.placement,
    )
    generate_requests = [
        build_request(
            prompt_token_ids(r, vocab_size),
            model=model,
            request_id=f"trace-{r.index}",
            max_tokens=config.max_output_tokens,
        )
        for r in requests
    ]
    with tempfile.TemporaryDirectory(prefix="kvf-trace-") as tmp:
        cluster = Cluster(_spec(Path(tmp), config))
        cluster.start()
        try:
            outcomes, wall_s = asyncio.run(_drive(cluster, config, requests, generate_requests))
        finally:
            cluster.stop()
    num_cut = sum(r.input_length != f.input_length for r, f in zip(requests, full, strict=True))
    tokens_cut = sum(f.input_length - r.input_length for r, f in zip(requests, full, strict=True))
    return LiveResult(config, requests, outcomes, predicted, num_cut, tokens_cut, wall_s)


def _spec(state_dir: Path, config: LiveConfig) -> ClusterSpec:
    mock = [
        "--engine",
        "mock",
        "--mock-speedup",
        str(config.mock_speedup),
        "--max-model-len",
        str(config.max_model_len),
        "--store-file-nbytes",
        str(32 << 20),  # 4 workers x the 256 MiB default, preallocated
    ]
    return ClusterSpec(
        state_dir=state_dir,
        nats_port=0,
        http_port=0,
        root=f"trace{uuid.uuid4().hex[:8]}.{DEFAULT_ROOT}",
        replicas={
            PREFILL: config.num_workers,
            DECODE: config.num_decode_workers or config.num_workers,
            BILLING: 0,
            INGRESS: 0,
        },
        models=(config.model,),
        log_level="warning",
        shutdown_grace_s=3.0,
        extra_args={
            PREFILL: mock,
            DECODE: mock,
            ROUTER: [*NO_ADMISSION, "--placement", config.placement],
        },
    )


async def _drive(
    cluster: Cluster,
    config: LiveConfig,
    requests: Sequence[TraceRequest],
    generate_requests: Sequence[GenerateRequest],
) -> tuple[list[LiveOutcome], float]:
    bus = await Bus.connect(
        cluster.nats_url, service="bench", root=cluster.spec.root, creds=cluster.nats_creds
    )
    try:
        await cluster.wait_ready(bus, timeout_s=config.ready_timeout_s)
        await asyncio.sleep(1.5)  # every worker's first heartbeat reaches the router
        loop = asyncio.get_running_loop()
        start = loop.time()

        async def one(request: TraceRequest, sent: GenerateRequest, at_s: float) -> LiveOutcome:
            await asyncio.sleep(max(start + at_s - loop.time(), 0.0))
            sent = msgspec.structs.replace(sent, arrival_ms=now_ms())
            try:
                # Two cores serve the client and the whole cluster: a heartbeat may be late.
                result = await generate(bus, sent, liveness_timeout_s=10.0)
            except Exception as exc:  # counted and reported, never fatal to the replay
                error = f"{type(exc).__name__}: {exc}"
                return LiveOutcome(request.index, request.input_length, 0, None, error)
            usage = result.usage
            if usage is None:
                return LiveOutcome(
                    request.index,
                    request.input_length,
                    0,
                    result.ttft_s,
                    "NoUsage: the stream ended without usage",
                )
            return LiveOutcome(
                request.index, usage.num_prompt_tokens, usage.num_cached_tokens, result.ttft_s
            )

        at = arrivals_s(requests, config.speed)
        outcomes = await asyncio.gather(
            *(one(r, g, a) for r, g, a in zip(requests, generate_requests, at, strict=True))
        )
        return list(outcomes), loop.time() - start
    finally:
        await bus.close()
