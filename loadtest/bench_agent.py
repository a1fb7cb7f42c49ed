"""Coding agents over HTTP: sessions whose every step re-sends the whole conversation, through
the official `openai` and `anthropic` SDKs, against a cluster this benchmark starts or any
server that speaks either protocol.

    python -m loadtest.bench_agent [--quick] [--protocol openai|anthropic|both]
        [--sessions 16 --steps 8 --initial-tokens 6000 --growth-tokens 600 --max-tokens 64]
        [--concurrency 8] [--think-time-s 0] [--model tiny-coder] [--engine mock|model]
        [--volatile-system] [--prefix-guard off|on|both]
        [--base-url URL --api-key KEY --model NAME] [--out DIR]

Without `--base-url` it starts a cluster of separate processes (kv-index, swa-memcache,
router, prefill and decode workers, ingress; no billing) on free ports: by default the mock
engine serving tiny-coder, whose timing is the router's cost model of a GPU (`--mock-speedup`
divides it) and whose context limit is raised to fit the workload. `--engine model` (or
`torch`) runs the real model on this CPU at reduced scale (`--model SmolLM2-135M-Instruct`).

Printed (per protocol): the p50 time to first token of every session's first step (cold but
for the shared system prompt) against the later steps' (warm: all but the newest text is
cached) as a ratio; the share of prompt tokens the server reported as cached (first step,
later steps, all); p50/p99 TTFT, time per output token and end-to-end latency; requests/s
and output tokens/s; errors by class. `--out` (default a fresh temp dir) receives
bench.json (every printed figure), report-<protocol>.json (every request) and three PNGs.
With `--protocol both` the Anthropic pass uses the next seed, so it starts cold too.

Every session sends a session id (`x-session-id`; Anthropic's `metadata.user_id`), so a
kvfabric server diagnoses each step's cache miss: the causes of the later steps are printed
(`diagnosis, <cause>`). `--volatile-system` stamps every request's system prompt as a
popular harness does (a billing header with a fresh nonce, the current time), and
`--prefix-guard` sends as an account with the server's prefix guard off (the default), on,
or `both`: the same sessions twice, guard off then on (each account caches apart, so both
start cold), with their hit shares and TTFTs set side by side. A cluster this benchmark
starts only: the guarded account and its key are made on its NATS.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from loadtest.agent.plots import write_plots
from loadtest.agent.report import AgentReport, summary
from loadtest.agent.runner import PROTOCOLS, Target, TargetUnreachable, run_agents
from loadtest.agent.workload import Workload
from loadtest.results import BenchResult
from services.admin.launcher import Cluster, ClusterSpec
from shared.accounts import AccountStore
from shared.api_keys import KeyStore
from shared.bus import Bus
from shared.models import model_path, served_name
from shared.subjects import BILLING, DECODE, PREFILL
from shared.testing import unique_root
from worker.engine.checkpoint import Checkpoint

KEY = "kvf-bench-agent-key"
GUARDED = "bench-guarded"  # the account with the prefix guard on (--prefix-guard)
GUARDS = ("off", "on", "both")
# Sizes by scale: (sessions, steps, initial tokens, growth tokens, max tokens, concurrency).
FULL = (16, 8, 6000, 600, 64, 8)
QUICK = (4, 4, 1000, 200, 16, 4)
REAL_MODEL = (2, 3, 600, 150, 16, 2)  # the model on this CPU: ~1 s a step
SIZE_NAMES = ("sessions", "steps", "initial_tokens", "growth_tokens", "max_tokens", "concurrency")
ENGINES = {"mock": "mock", "model": "model", "torch": "model"}


def run(quick: bool = False, **options: Any) -> BenchResult:
    """Options: protocol ("openai", "anthropic", "both"), the SIZE_NAMES, think_time_s, seed,
    model, engine, mock_speedup, workers (prefill and decode of each), base_url and api_key
    (an existing server), out (a directory), progress."""
    engine = ENGINES.get(options.get("engine", "mock"))
    if engine is None:
        raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {options['engine']!r}")
    guard = options.get("prefix_guard", "off")
    if guard not in GUARDS:
        raise ValueError(f"prefix_guard must be one of {', '.join(GUARDS)}, got {guard!r}")
    if guard != "off" and options.get("base_url"):
        raise ValueError("--prefix-guard needs a cluster this benchmark starts (no --base-url)")
    protocol = options.get("protocol", "openai")
    protocols = PROTOCOLS if protocol == "both" else (protocol,)
    if not set(protocols) <= set(PROTOCOLS):
        raise ValueError(
            f"protocol must be one of {', '.join(PROTOCOLS)} or both, got {protocol!r}"
        )
    preset = QUICK if quick else REAL_MODEL if engine == "model" else FULL
    sizes = {
        name: default if options.get(name) is None else options[name]
        for name, default in zip(SIZE_NAMES, preset, strict=True)
    }
    workload = Workload(
        num_sessions=sizes["sessions"],
        num_steps=sizes["steps"],
        initial_context_tokens=sizes["initial_tokens"],
        growth_tokens_per_step=sizes["growth_tokens"],
        max_output_tokens=sizes["max_tokens"],
        think_time_s=options.get("think_time_s", 0.0),
        seed=options.get("seed", 0),
        volatile_system=options.get("volatile_system", False),
    )
    out_dir = Path(options.get("out") or tempfile.mkdtemp(prefix="kvf-bench-agent-"))
    result = BenchResult("agent", quick)
    asyncio.run(
        _measure(workload, protocols, sizes["concurrency"], engine, out_dir, options, result)
    )
    result.finish()
    result.write_json(out_dir / "bench.json")
    return result


async def _measure(
    workload: Workload,
    protocols: tuple[str, ...],
    concurrency: int,
    engine: str,
    out_dir: Path,
    options: dict[str, Any],
    result: BenchResult,
) -> None:
    base_url = options.get("base_url")
    model = options.get("model") or "tiny-coder"
    cluster = None
    guard = options.get("prefix_guard", "off")
    keys = {}
    if base_url is None:
        cluster = await _start_cluster(workload, model, engine, options, out_dir)
        base_url, api_key, model = cluster.http_urls[0], KEY, served_name(model)
        if guard != "off":
            keys["on"] = await _guarded_key(cluster)
        speed = f", mock speedup {options.get('mock_speedup', 1.0):g}" if engine == "mock" else ""
        result.note(
            f"a cluster of this tree: {model} on the {engine} engine{speed}, on the machine "
            "the clients run on (noisy figures)"
        )
    else:
        api_key = options.get("api_key") or "none"
        result.note(f"an existing server at {base_url}, model {model}")
    result.note(
        f"{workload.num_sessions} sessions x {workload.num_steps} steps at concurrency "
        f"{concurrency}: ~{workload.initial_context_tokens} tokens first, "
        f"+{workload.growth_tokens_per_step} of tool output a step, <= "
        f"{workload.max_output_tokens} out, think time {workload.think_time_s:g} s, seed "
        f"{workload.seed}"
    )
    reports: dict[str, AgentReport] = {}
    passes = ("off", "on") if guard == "both" else (guard,)
    try:
        for index, protocol in enumerate(protocols):
            seeded = dataclasses.replace(workload, seed=workload.seed + index)
            progress = options.get("progress", False)
            for side in passes:
                label = protocol if guard == "off" else f"{protocol}, guard {side}"
                target = Target(base_url, keys.get(side, api_key), model, protocol)
                reports[label] = await run_agents(target, seeded, concurrency, progress)
                name = label.replace(", guard ", "-guard-")
                reports[label].write_json(out_dir / f"report-{name}.json")
                add_figures(result, label, reports[label])
            if guard == "both":
                compare_guard(
                    result,
                    protocol,
                    reports[f"{protocol}, guard off"],
                    reports[f"{protocol}, guard on"],
                )
    finally:
        if cluster is not None:
            cluster.stop()
            shutil.rmtree(cluster.spec.state_dir / "kvstore", ignore_errors=True)  # the bulk
    plots = write_plots(reports, out_dir)
    result.note(f"wrote bench.json, {len(reports)} report JSON, {len(plots)} PNGs to {out_dir}")


async def _start_cluster(
    workload: Workload, model: str, engine: str, options: dict[str, Any], out_dir: Path
) -> Cluster:
    context = Checkpoint(model_path(model)).config().max_position_embeddings
    # The workload's sizes are estimates (within 15% for the bundled tokenizers): room for
    # half again as much.
    needed = int(workload.max_context_tokens * 1.5)
    worker = ["--engine", engine]
    if engine == "mock":
        # The mock's only context limit is the one it is given; its blocks are 4 KiB, so
        # 16 MiB store files (preallocated) rather than the model's 256 MiB.
        worker += [
            "--mock-speedup",
            str(options.get("mock_speedup", 1.0)),
            "--max-model-len",
            str(max(context, needed)),
            "--store-file-nbytes",
            str(16 << 20),
        ]
    elif needed > context:
        raise ValueError(
            f"the workload reaches ~{workload.max_context_tokens} tokens; {model} holds "
            f"{context}: fewer steps or smaller --initial-tokens / --growth-tokens"
        )
    num_workers = options.get("workers", 1)
    spec = ClusterSpec(
        state_dir=out_dir / "cluster",
        nats_port=0,  # its logs stay there
        http_port=0,
        root=unique_root(),
        log_level="warning",
        models=(model,),
        replicas={BILLING: 0, PREFILL: num_workers, DECODE: num_workers},
        extra_args={PREFILL: worker, DECODE: worker},
        dev_api_key=KEY,
    )
    cluster = Cluster(spec)
    cluster.start()
    try:
        bus = await Bus.connect(
            cluster.nats_url, service="bench", root=spec.root, creds=cluster.nats_creds
        )
        try:
            await cluster.wait_ready(bus, timeout_s=300)
        finally:
            await bus.close()
    except BaseException:
        cluster.stop()
        raise
    return cluster


async def _guarded_key(cluster: Cluster) -> str:
    """A key of an account with the prefix guard on, in its own cache namespace."""
    bus = await Bus.connect(
        cluster.nats_url, service="bench", root=cluster.spec.root, creds=cluster.nats_creds
    )
    try:
        keys, accounts = KeyStore(bus), AccountStore(bus)
        await keys.start()
        await accounts.start()
        await accounts.set(GUARDED, prefix_guard=True)
        return (await keys.create(GUARDED))[0]
    finally:
        await bus.close()


def compare_guard(result: BenchResult, protocol: str, off: AgentReport, on: AgentReport) -> None:
    """The same sessions without and with the prefix guard, side by side."""
    before, after = summary(off.later_steps()), summary(on.later_steps())
    if before["hit_share"] is not None and after["hit_share"] is not None:
        result.ratio(
            f"{protocol}: cache-hit share of later steps, guard on / off",
            100 * after["hit_share"],
            100 * before["hit_share"],
            "guard off",
            "%",
        )
    if before["ttft_s"]["p50"] is not None and after["ttft_s"]["p50"] is not None:
        result.ratio(
            f"{protocol}: TTFT p50 of later steps, guard on / off",
            after["ttft_s"]["p50"] * 1e3,
            before["ttft_s"]["p50"] * 1e3,
            "guard off",
            "ms",
            lower_is_better=True,
        )


def add_figures(result: BenchResult, label: str, report: AgentReport) -> None:
    """What one protocol's run printed: every number from `report`, none computed apart."""
    first, later = summary(report.first_step()), summary(report.later_steps())
    overall = summary(report.records)
    cold, warm = first["ttft_s"]["p50"], later["ttft_s"]["p50"]
    if cold is not None and warm is not None:
        result.ratio(
            f"{label}: TTFT p50, first step (cold) / later steps (warm)",
            cold * 1e3,
            warm * 1e3,
            "later steps",
            "ms",
        )
    else:
        result.note(f"{label}: no cold/warm TTFT ratio (a side has no first token)")
    for name, part in (("first step", first), ("later steps", later), ("all steps", overall)):
        if part["hit_share"] is not None:
            result.figure(f"{label}: cache-hit share, {name}", 100 * part["hit_share"], "%")
    for metric, title in (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("e2e_s", "end-to-end")):
        for quantile in ("p50", "p99"):
            if overall[metric][quantile] is not None:
                result.figure(f"{label}: {title} {quantile}", overall[metric][quantile] * 1e3, "ms")
    throughput = report.throughput()
    result.figure(f"{label}: requests/s", throughput["requests_per_s"], "requests/s")
    result.figure(f"{label}: output tokens/s", throughput["output_tokens_per_s"], "tokens/s")
    result.figure(f"{label}: requests answered", overall["num_answered"], "requests")
    result.figure(f"{label}: errors", overall["num_requests"] - overall["num_answered"], "requests")
    for error, count in report.errors_by_class.items():
        result.figure(f"{label}: errors, {error}", count, "requests")
    for cause, count in report.causes().items():
        result.figure(f"{label}: later steps diagnosed, {cause}", count, "requests")
    if report.num_skipped:
        result.figure(f"{label}: steps skipped after a failed step", report.num_skipped, "requests")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (CI)")
    parser.add_argument("--protocol", default="openai", choices=[*PROTOCOLS, "both"])
    for name, full, quick in zip(SIZE_NAMES, FULL, QUICK, strict=True):
        parser.add_argument(
            f"--{name.replace('_', '-')}",
            type=int,
            dest=name,
            help=f"default {full} ({quick} quick)",
        )
    parser.add_argument("--think-time-s", type=float, default=0.0)
    parser.add_argument(
        "--volatile-system",
        action="store_true",
        help="stamp every request's system prompt (a billing header's nonce, the time)",
    )
    parser.add_argument(
        "--prefix-guard",
        default="off",
        choices=GUARDS,
        help="send as an account with the server's prefix guard off, on, or both in turn",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", help="a served name (default tiny-coder)")
    parser.add_argument("--engine", default="mock", choices=sorted(ENGINES))
    parser.add_argument("--mock-speedup", type=float, default=1.0)
    parser.add_argument("--workers", type=int, default=1, help="prefill and decode workers each")
    parser.add_argument("--base-url", help="an existing server's root URL: no cluster started")
    parser.add_argument("--api-key", help="for --base-url")
    parser.add_argument("--out", help="where JSON and plots go (default a fresh temp dir)")
    parser.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=sys.stderr.isatty(),
        help="a live progress bar on stderr (default: when it is a terminal)",
    )
    args = parser.parse_args()
    if args.base_url and not args.model:
        parser.error("--base-url needs --model (what the server serves)")
    try:
        result = run(**vars(args))
    except (TargetUnreachable, ValueError) as exc:  # bad options or a server that says no
        parser.exit(2, f"bench_agent: {exc}\n")
    result.print()


if __name__ == "__main__":
    main()
