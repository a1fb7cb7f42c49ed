"""State staged across tool calls (issue #41, point 3): the TTFT of an agent's next turn, after
its tool ran, with ingress staging the session on its prefill worker and without.

    python -m loadtest.bench_staging [--quick] [--seed 0] [--out DIR]

Two clusters of separate processes serving SmolLM2-135M-Instruct on this CPU (the mock engine
never completes a tool call, so nothing would be staged), alike but for ingress's staging:
off on one (`--stage-max-s 0`), on on the other. Each has one prefill and one decode worker;
the prefill worker's KV pool and host tier are small (`--num-kv-blocks`, `--host-tier-bytes`),
so that other sessions' turns push a session's blocks out of both while its longer tools
run: without staging its next turn then reads them from the store. Both clusters serve the
same seeded sessions at the same time, so a load the shared machine puts on one it puts on
the other.

Sessions (`Workload(named_tools=True)`, loadtest/agent/tools.py): every step forces a call
of the tool the workload picked for it (a named `tool_choice`; the stop sequence `</tool_call>`
ends the answer there, as SmolLM2 rarely closes a call on its own), then waits the tool's
duration times `time_scale` and sends the next step with the tool's result. Staging's times
(`--stage-default-s`, `--stage-max-s`) and swa-memcache's snapshot TTL (`--ttl-s`) are scaled
the same way. Sessions start evenly over `spread_s`, at most `concurrency` requests in flight.

TTFT is ingress's own, per request: from the request reaching its pipeline to the first
tokens reaching ingress (the `kvfabric.ttft_ms` of its trace's `client generate` span; every
request is traced, on both sides). The client cannot see it: a forced call's opening is the
server's own, sent at once, and the model's first tokens (a call's arguments) are held until
they parse. From the same traces, the `prefill load` span: the time to bring the cached
prefix into the prefill worker's pool, and how many of its blocks were still in the pool,
came back from the host tier or were read from the store: the part staging changes.

Printed: the next turns' (every step after the first) TTFT p50 and p99 with staging on
against off, p50 after the tools whose median passes the 180 s snapshot TTL, and the prefix
load's p50 after them; per side the staged turns (ingress) and blocks (prefill), where the
next turns' prefix blocks were (all, after those tools, after those tools called before in
the session: the waits staging had learned), the share of their prompt tokens reported
cached, and the prefill worker's host-tier and store counters. `--out` gets bench.json and
turns.json (every turn), beside the clusters' logs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import httpx
import numpy as np
import openai

from loadtest.agent import texts
from loadtest.agent.tool_agents import ToolAgents, Turn
from loadtest.agent.tools import TOOLS
from loadtest.agent.workload import AgentSession, Workload
from loadtest.results import BenchResult
from services.admin.launcher import Cluster, ClusterSpec
from services.admin.top_cli import Samples, parse
from services.admin.trace_cli import trace_spans
from shared.bus import Bus
from shared.models import model_path
from shared.subjects import BILLING, DECODE, INGRESS, PREFILL, SWA_MEMCACHE
from shared.testing import unique_root
from worker.engine.checkpoint import Checkpoint

MODEL = "SmolLM2-135M-Instruct"
KEY = "kvf-bench-staging-key"
CALL_END = "</tool_call>"  # where SmolLM2's (ChatML) call closes: shared/tokenizer/formats
SIDES = ("off", "on")
SNAPSHOT_TTL_S = 180.0  # swa-memcache's default
STAGE_DEFAULT_S, STAGE_MAX_S = 120.0, 1800.0  # ingress's defaults
BLOCK_TOKENS = 64  # the workers' default KV block
LONG_TOOLS = tuple(t.name for t in TOOLS if t.median_s > SNAPSHOT_TTL_S)


@dataclass(frozen=True)
class Sizes:
    # Sessions long enough for a tool to come back: staging learns a tool's wait from the
    # session's earlier calls of it.
    num_sessions: int = 8
    num_steps: int = 10
    initial_tokens: int = 500  # system prompt (shared) and task; the tools' list comes on top
    growth_tokens: int = 150  # a tool's result
    max_tokens: int = 64  # SmolLM2 sometimes copies the tool's schema as its arguments
    spread_s: float = 20.0  # sessions start evenly over this
    # 240 s of tests in 24 s; a side's run then takes about five minutes here.
    time_scale: float = 1 / 10
    # Requests in flight: the prefill pool holds every admitted job's prefix at once (a job
    # short of free pages reads only part of its prefix and computes the rest,
    # worker/serving/pages.py: a cost that is neither side's staging).
    concurrency: int = 2
    # 64-token pages of SmolLM2 in float32, 2.8 MiB each: the pool holds two of the longest
    # prompts (2,913 tokens, 46 pages); half the host tier (what staging may hold) about three
    # sessions' prefixes.
    pool_blocks: int = 96
    host_tier_blocks: int = 160
    # The workers' own warm-up before they join (`--warmup-tokens`), then a one-shot request
    # of our own: the fresh processes' first request, which pays for their threads' start
    # (seconds here), is none of the sessions'.
    worker_warmup_tokens: int = 512
    warm_up: bool = True


FULL = Sizes()
# CI's: the path end to end, too few turns for the figures to mean much.
QUICK = replace(
    FULL,
    num_sessions=1,
    num_steps=2,
    initial_tokens=300,
    growth_tokens=100,
    max_tokens=32,
    time_scale=1 / 400,
    # CI's time: seconds each; the first step pays instead, on both sides alike.
    worker_warmup_tokens=0,
    warm_up=False,
)


@dataclass(frozen=True)
class Side:
    """One side's turns, and its counters' increase over its run."""

    name: str
    turns: list[Turn]
    wall_s: float
    counters: dict[str, float]

    def next_turns(
        self, tools: tuple[str, ...] | None = None, *, learned: bool = False
    ) -> list[Turn]:
        """The turns answered after a tool (one of `tools`, if given); `learned`: only those
        after a tool their session had called before, whose wait staging had learned."""
        out, seen = [], set()
        for t in sorted(self.turns, key=lambda t: (t.session, t.step)):
            if t.after_tool is None:
                continue
            repeat = (t.session, t.after_tool) in seen
            seen.add((t.session, t.after_tool))
            if t.error is None and (tools is None or t.after_tool in tools) and repeat >= learned:
                out.append(t)
        return out

    def quantile(
        self, field_name: str, q: float, tools: tuple[str, ...] | None = None
    ) -> float | None:
        """Quantile `q` of a Turn field over the next turns (after `tools` only, if given)."""
        values = [v for t in self.next_turns(tools) if (v := getattr(t, field_name)) is not None]
        return float(np.percentile(values, q)) if values else None


def workload(sizes: Sizes, seed: int) -> Workload:
    return Workload(
        num_sessions=sizes.num_sessions,
        num_steps=sizes.num_steps,
        initial_context_tokens=sizes.initial_tokens,
        growth_tokens_per_step=sizes.growth_tokens,
        max_output_tokens=sizes.max_tokens,
        seed=seed,
        named_tools=True,
        tool_time_scale=sizes.time_scale,
    )


def block_nbytes() -> int:
    """A KV page of the model in float32 (the workers' dtype): full layers x K/V x tokens x
    KV heads x head dim x 4 bytes."""
    config = Checkpoint(model_path(MODEL)).config()
    return config.num_full_layers * 2 * BLOCK_TOKENS * config.num_kv_heads * config.head_dim * 4


def spec(state_dir: Path, sizes: Sizes, side: str) -> ClusterSpec:
    scale = sizes.time_scale
    stage_max_s = STAGE_MAX_S * scale if side == "on" else 0  # 0: no staging
    # Store files are allocated whole: 64 MiB ones rather than 256 keep two clusters small.
    worker = [
        "--store-file-nbytes",
        str(64 << 20),
        "--warmup-tokens",
        str(sizes.worker_warmup_tokens),
    ]
    return ClusterSpec(
        state_dir=state_dir,
        nats_port=0,
        http_port=0,
        root=unique_root(),
        log_level="warning",
        shutdown_grace_s=3.0,
        models=(MODEL,),
        replicas={BILLING: 0, INGRESS: 1, PREFILL: 1, DECODE: 1},
        extra_args={
            PREFILL: [
                *worker,
                "--num-kv-blocks",
                str(sizes.pool_blocks),
                "--host-tier-bytes",
                str(sizes.host_tier_blocks * block_nbytes()),
            ],
            DECODE: worker,
            SWA_MEMCACHE: ["--ttl-s", f"{SNAPSHOT_TTL_S * scale:g}"],
            INGRESS: [
                "--stage-default-s",
                f"{STAGE_DEFAULT_S * scale:g}",
                "--stage-max-s",
                f"{stage_max_s:g}",
            ],
        },
        dev_api_key=KEY,
        trace_dir=state_dir / "traces",
        trace_sample_ratio=1.0,
    )


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


# -- what the cluster says -----------------------------------------------------------------
PREFILL_COUNTERS = {
    "staged_blocks": ("kvfabric_prefill_staged_blocks_total", {}),
    "host_evicted": ("kvfabric_worker_host_tier_blocks_total", {"outcome": "evicted"}),
}
INGRESS_COUNTERS = {"staged_turns": ("kvfabric_ingress_staged_turns_total", {})}


def total(samples: Samples, name: str, labels: dict[str, str]) -> float:
    wanted = set(labels.items())
    return sum(v for (sample, have), v in samples.items() if sample == name and wanted <= have)


async def counters(urls: dict[str, str]) -> dict[str, float]:
    """A cluster's counters now: its prefill worker's and its ingress's."""
    async with httpx.AsyncClient(timeout=10) as http:
        scraped = {i: parse((await http.get(url)).text) for i, url in urls.items()}
    out = dict.fromkeys([*PREFILL_COUNTERS, *INGRESS_COUNTERS], 0.0)
    for instance, samples in scraped.items():
        wanted = PREFILL_COUNTERS if instance.startswith(PREFILL) else {}
        wanted = INGRESS_COUNTERS if instance.startswith(INGRESS) else wanted
        for key, (name, labels) in wanted.items():
            out[key] += total(samples, name, labels)
    return out


def timed(turns: list[Turn], trace_dir: Path) -> list[Turn]:
    """`turns` with their TTFT, prefix load and its blocks' tiers from their traces (all
    written by then: the cluster has stopped, its spans flushed)."""
    found: dict[str, dict] = {}
    for span in trace_spans(trace_dir):
        attributes, got = span.get("attributes", {}), found.setdefault(span["trace_id"], {})
        if span["name"] == "client generate":
            got["ttft_ms"] = attributes.get("kvfabric.ttft_ms")
        elif span["name"] == "prefill load":
            got["load_ms"] = (span["end_ns"] - span["start_ns"]) / 1e6
            got["num_pool_blocks"] = attributes.get("kvfabric.num_local_blocks", 0)
            got["num_host_blocks"] = attributes.get("kvfabric.num_host_blocks", 0)
            got["num_store_blocks"] = attributes.get("kvfabric.num_blocks", 0)
    return [replace(t, **found.get(t.trace_id, {})) for t in turns]


# -- the run -------------------------------------------------------------------------------
async def warm_up(client: openai.AsyncOpenAI, seed: int) -> None:
    """A one-shot prompt in a namespace of its own."""
    rng = random.Random(f"{seed}:warm-up")
    await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": texts.code_listing(rng, 500, "src/warm.py")}],
        max_tokens=1,
        extra_body={"cache_salt": "bench-staging-warm-up"},
    )


def run(quick: bool = False, seed: int = 0, out: str | None = None) -> BenchResult:
    sizes = QUICK if quick else FULL
    result = BenchResult("staging", quick)
    out_dir = Path(out or tempfile.mkdtemp(prefix="kvf-bench-staging-"))
    load = os.getloadavg()[0]
    sides = asyncio.run(_measure(sizes, seed, out_dir))
    report(result, sizes, sides, load)
    turns = {name: [asdict(t) for t in side.turns] for name, side in sides.items()}
    (out_dir / "turns.json").write_text(json.dumps(turns, indent=1) + "\n")
    result.note(f"wrote bench.json and turns.json to {out_dir}, beside the cluster's logs")
    result.finish()
    result.write_json(out_dir / "bench.json")
    return result


async def _measure(sizes: Sizes, seed: int, out_dir: Path) -> dict[str, Side]:
    clusters = {side: Cluster(spec(out_dir / side, sizes, side)) for side in SIDES}
    say("staging: starting the clusters")
    began = time.perf_counter()
    try:
        for cluster in clusters.values():
            cluster.start()
        urls = dict(zip(SIDES, await asyncio.gather(*map(ready, clusters.values())), strict=True))
        say(f"staging: clusters ready in {time.perf_counter() - began:.0f} s")
        sessions = workload(sizes, seed).sessions()
        sides = await asyncio.gather(
            *(drive(clusters[s], urls[s], s, sizes, seed, sessions) for s in SIDES)
        )
    finally:
        stopping = time.perf_counter()
        await asyncio.gather(*(asyncio.to_thread(stop, c) for c in clusters.values()))
        say(f"staging: clusters stopped in {time.perf_counter() - stopping:.0f} s")
    return {s.name: replace(s, turns=timed(s.turns, out_dir / s.name / "traces")) for s in sides}


async def ready(cluster: Cluster) -> str:
    """Once every process answers: the ingress's URL."""
    bus = await Bus.connect(
        cluster.nats_url, service="bench", root=cluster.spec.root, creds=cluster.nats_creds
    )
    try:
        instances = await cluster.wait_ready(bus, timeout_s=300)
    finally:
        await bus.close()
    return next(i.metadata["http_url"] for i in instances if i.service == INGRESS)


def stop(cluster: Cluster) -> None:
    cluster.stop()
    shutil.rmtree(cluster.spec.state_dir / "kvstore", ignore_errors=True)  # the bulk


async def drive(
    cluster: Cluster, url: str, side: str, sizes: Sizes, seed: int, sessions: list[AgentSession]
) -> Side:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=300)
    try:
        if sizes.warm_up:
            await warm_up(client, seed)
        before = await counters(cluster.metrics_urls)
        say(f"staging {side}: {len(sessions)} sessions")
        started = time.perf_counter()
        agents = ToolAgents(
            client,
            MODEL,
            f"bench-staging-{side}-{seed}",
            max_tokens=sizes.max_tokens,
            stop=(CALL_END,),
            spread_s=sizes.spread_s,
            concurrency=sizes.concurrency,
            say=say,
        )
        turns = await agents.run(sessions)
        wall_s = time.perf_counter() - started
        await asyncio.sleep(0.5)  # the last StageRequest is published, not awaited
        after = await counters(cluster.metrics_urls)
    finally:
        await client.close()
    say(f"staging {side}: done in {wall_s:.0f} s")
    return Side(side, turns, wall_s, {k: after[k] - before[k] for k in after})


def report(result: BenchResult, sizes: Sizes, sides: dict[str, Side], load_before: float) -> None:
    off, on = sides["off"], sides["on"]
    long = ", ".join(LONG_TOOLS)
    for label, field_name, q, tools in (
        ("next-turn TTFT p50", "ttft_ms", 50, None),
        ("next-turn TTFT p99", "ttft_ms", 99, None),
        (f"next-turn TTFT p50 after {long}", "ttft_ms", 50, LONG_TOOLS),
        (f"next-turn prefix load p50 after {long}", "load_ms", 50, LONG_TOOLS),
    ):
        ours, peer = on.quantile(field_name, q, tools), off.quantile(field_name, q, tools)
        if ours and peer:
            result.ratio(
                f"{label}, staging on / off", ours, peer, "off", "ms", lower_is_better=True
            )
        else:
            result.note(f"{label}: no ratio (a side measured none)")
    for side in (off, on):
        n, c = side.name, side.counters
        answered = [t for t in side.turns if t.error is None]
        called = sum(t.finish_reason == "tool_calls" for t in answered)
        result.figure(f"{n}: turns ending in a tool call", called, "turns")
        if errors := len(side.turns) - len(answered):
            result.figure(f"{n}: turns failed", errors, "turns")
        result.figure(f"{n}: staged turns (ingress)", c["staged_turns"], "turns")
        result.figure(f"{n}: staged blocks (prefill)", c["staged_blocks"], "blocks")
        parts = {"pool": "the pool", "host": "the host tier", "store": "the store"}
        for which, tools, learned, tiers in (
            ("next turns", None, False, ("pool", "host", "store")),
            (f"next turns after {long}", LONG_TOOLS, False, ("host", "store")),
            (
                f"next turns after {long} called before in the session",
                LONG_TOOLS,
                True,
                ("host", "store"),
            ),
        ):
            turns = side.next_turns(tools, learned=learned)
            result.figure(f"{n}: {which}", len(turns), "turns")
            for tier in tiers:
                num = sum(getattr(t, f"num_{tier}_blocks") for t in turns)
                result.figure(f"{n}: {which}, prefix blocks from {parts[tier]}", num, "blocks")
        following = side.next_turns()
        if prompt := sum(t.prompt_tokens for t in following):
            cached = sum(t.cached_tokens for t in following)
            result.figure(f"{n}: next turns' prompt tokens cached", 100 * cached / prompt, "%")
        call_p50 = side.quantile("call_s", 50)
        if call_p50 is not None:
            result.figure(f"{n}: next turns' whole call p50 (client)", call_p50 * 1e3, "ms")
        result.figure(f"{n}: host-tier evictions", c["host_evicted"], "blocks")
        result.figure(f"{n}: wall time", side.wall_s, "s")
    result.note(
        f"{sizes.num_sessions} sessions x {sizes.num_steps} steps of {MODEL} on this CPU, started "
        f"over {sizes.spread_s:g} s, <= {sizes.concurrency} requests in flight; "
        f"~{sizes.initial_tokens} tokens first, +{sizes.growth_tokens} a tool result; every step "
        f"a forced call (<= {sizes.max_tokens} tokens, stop at "
        f"{CALL_END}); tools' durations x {sizes.time_scale:.4g}, staging's times and the "
        "snapshot TTL too"
    )
    result.note(
        f"prefill worker: pool {sizes.pool_blocks} pages, host tier {sizes.host_tier_blocks} "
        f"blocks of {BLOCK_TOKENS} tokens, both empty at the start"
        f"; {MODEL} has no sliding window: no snapshot to keep"
    )
    result.note(
        f"load average (1 min) {load_before:.2f} before, {os.getloadavg()[0]:.2f} after, "
        f"{os.cpu_count()} CPUs shared by the cluster and the clients"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (CI)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="where bench.json goes (default a fresh temp dir)")
    args = parser.parse_args()
    run(**vars(args)).print()


if __name__ == "__main__":
    main()
