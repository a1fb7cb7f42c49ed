"""The resume gap: a decode worker killed mid-stream, and how long its client waits for the
next token, against recomputing the whole context (how vLLM and Dynamo migrate a request).

Part of `kvfabric bench faults`. A cluster of one model (two decode workers, a supervisor)
answers one greedy request at a time through `shared.client.generate`; once `kill_at`
tokens have arrived, the decode worker streaming them is sent SIGKILL. The gap is the time
from the kill to the first chunk after the stream's longest pause (chunks the worker sent
before it died may still arrive just after the kill). Each run's answer must equal the
uninterrupted reference, byte for byte. The peer is the same cluster and request with
`failover_recompute=True`: the continuation misses the cache and recomputes the prompt and
everything delivered. Both include the same detection (a ping with no responders once the
stream has stalled 0.25 s).
"""

from __future__ import annotations

import asyncio
import os
import signal
import statistics
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from loadtest.bench_prefix_reuse import corpus_tokens
from loadtest.fault_load import serving_instances
from loadtest.results import BenchResult
from services.admin.launcher import Cluster, ClusterSpec
from services.admin.supervisor import RestartPolicy
from shared.bus import Bus
from shared.client import GenerateResult, build_request, generate
from shared.models import model_path, served_name
from shared.schema import RouteDecision, TokenChunk, unpack_token_ids
from shared.subjects import DECODE
from shared.testing.fixtures import unique_root
from worker.engine.checkpoint import Checkpoint

BLOCK = 64
GAP_TARGET = 0.3  # of the recompute's gap
RECOVERY_BOUND_S = 120.0


@dataclass(frozen=True)
class Case:
    model: str
    num_prompt_tokens: int
    max_tokens: int
    kill_at: int  # tokens delivered before the kill
    num_runs: int


def cases(quick: bool) -> tuple[Case, ...]:
    tiny = Case("tiny-coder", 448, 64, 24, 1 if quick else 3)
    if quick:
        return (tiny,)
    # SmolLM2 at its whole 8K context: the prompt and the answer fill 8,192 positions.
    return (tiny, Case("SmolLM2-135M-Instruct", 8192 - 96, 96, 40, 2))


@dataclass
class Run:
    result: GenerateResult
    gap_s: float | None  # kill -> first chunk after the longest pause since
    killed: str


async def _run(cluster: Cluster, bus: Bus, case: Case, prompt: list[int], **failover) -> Run:  # noqa: ANN003
    model = served_name(case.model)
    request = build_request(
        prompt,
        model=model,
        block_size_tokens=BLOCK,
        max_tokens=case.max_tokens,
        cache_salt=uuid.uuid4().hex,  # nothing of this answer cached before it runs
    )
    decisions: list[RouteDecision] = []
    arrivals: list[float] = []
    killed_at: list[float] = []
    num_tokens = 0

    def on_chunk(chunk: TokenChunk) -> None:
        nonlocal num_tokens
        arrivals.append(time.perf_counter())
        num_tokens += len(unpack_token_ids(chunk.token_ids))
        if failover and not killed_at and num_tokens >= case.kill_at:
            killed_at.append(time.perf_counter())
            pid = cluster.child(decisions[0].decode_worker_id).process.pid
            os.kill(pid, signal.SIGKILL)

    result = await generate(
        bus,
        request,
        on_chunk=on_chunk,
        on_decision=decisions.append,
        **failover,
    )
    if not killed_at:
        return Run(result, None, "")
    after = [t for t in arrivals if t > killed_at[0]]
    pauses = [b - a for a, b in zip([killed_at[0], *after], after, strict=False)]
    resumed = after[pauses.index(max(pauses))] if pauses else None
    gap_s = None if resumed is None else resumed - killed_at[0]
    return Run(result, gap_s, decisions[0].decode_worker_id)


async def _both_decode_serving(cluster: Cluster, since: float) -> None:
    """Until the supervisor has restarted the killed worker and both decode workers serve."""
    decodes = {f"{DECODE}-0", f"{DECODE}-1"}
    while not decodes <= await serving_instances(cluster):
        if time.monotonic() - since > RECOVERY_BOUND_S:
            raise RuntimeError(f"the decode workers were not serving {RECOVERY_BOUND_S:.0f} s on")
        await asyncio.sleep(0.1)


async def _one_case(cluster: Cluster, case: Case, result: BenchResult) -> None:
    tokenizer = Checkpoint(model_path(case.model)).tokenizer()
    bus = await Bus.connect(
        cluster.nats_url, service="bench", root=cluster.spec.root, creds=cluster.nats_creds
    )
    try:
        await cluster.wait_ready(bus, timeout_s=300)
        gaps: dict[str, list[float]] = {"resume": [], "recompute": []}
        # The continuation's own time to first token, from its send (detection excluded).
        ttfts: dict[str, list[float]] = {"resume": [], "recompute": []}
        continuation_hits: list[int] = []
        mismatches = 0
        for i in range(case.num_runs):
            prompt = corpus_tokens(tokenizer, case.num_prompt_tokens, offset=11 * i)
            reference = await _run(cluster, bus, case, prompt)
            for kind in ("resume", "recompute"):
                since = time.monotonic()
                run = await _run(
                    cluster,
                    bus,
                    case,
                    prompt,
                    failover_recompute=kind == "recompute",
                    max_failovers=2,
                )
                if run.result.num_failovers != 1 or run.gap_s is None:
                    raise RuntimeError(
                        f"{case.model} run {i} ({kind}): expected one failover, got "
                        f"{run.result.num_failovers} (the answer ended before the kill?)"
                    )
                gaps[kind].append(run.gap_s)
                ttfts[kind].append(run.result.ttft_s or 0.0)
                if kind == "resume":
                    continuation_hits.append(run.result.decision.num_cached_tokens)
                if run.result.token_ids != reference.result.token_ids:
                    mismatches += 1
                print(
                    f"  ... {case.model} run {i}: {kind} gap {run.gap_s * 1000:.0f} ms "
                    f"(continuation hit {run.result.decision.num_cached_tokens} of "
                    f"{run.result.decision.num_prompt_tokens} tokens)",
                    flush=True,
                )
                await _both_decode_serving(cluster, since)
        name = f"{served_name(case.model)}, {case.num_prompt_tokens}-token prompt"
        resume_s = statistics.median(gaps["resume"])
        recompute_s = statistics.median(gaps["recompute"])
        result.ratio(
            f"{name}: resume gap after a decode worker's SIGKILL (median of {case.num_runs})",
            resume_s * 1000,
            recompute_s * 1000,
            "the same failover recomputing the context",
            "ms",
            GAP_TARGET,
            lower_is_better=True,
        )
        result.figure(
            f"{name}: answers that differ from the uninterrupted one (of {2 * case.num_runs})",
            mismatches,
            "answers",
            0,
            lower_is_better=True,
        )
        result.note(
            f"{name}: killed after {case.kill_at} tokens; the continuation found "
            f"{statistics.median(continuation_hits):.0f} tokens in the store (median); gaps ms "
            f"resume {[round(g * 1000) for g in gaps['resume']]}, recompute "
            f"{[round(g * 1000) for g in gaps['recompute']]}; of which the continuation's own "
            f"time to first token (from its send; the rest is detection) ms resume "
            f"{[round(t * 1000) for t in ttfts['resume']]}, recompute "
            f"{[round(t * 1000) for t in ttfts['recompute']]}"
        )
    finally:
        await bus.close()


def run_failover_gap(result: BenchResult, quick: bool) -> None:
    for case in cases(quick):
        worker_args = [
            "--num-kv-blocks",
            str(4 * (case.num_prompt_tokens + case.max_tokens) // BLOCK + 64),
            "--max-model-len",
            str(case.num_prompt_tokens + case.max_tokens + BLOCK),
        ]
        with tempfile.TemporaryDirectory(prefix="kvf-bench-failover-") as tmp:
            spec = ClusterSpec(
                state_dir=Path(tmp),
                nats_port=0,
                http_port=0,
                root=unique_root(),
                replicas={DECODE: 2},
                extra_args={"prefill": worker_args, DECODE: worker_args},
                log_level="warning",
                models=(case.model,),
                restart_policy=RestartPolicy(budget=20, window_s=600.0),
            )
            cluster = Cluster(spec)
            cluster.start()
            try:
                cluster.supervise_in_background()
                asyncio.run(_one_case(cluster, case, result))
            finally:
                cluster.stop()
