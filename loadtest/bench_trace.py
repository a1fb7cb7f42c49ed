"""The production trace (loadtest/data/README.md: 12,031 requests, one hour) replayed offline
through the router's real policy and kv-index's real index, and live through a cluster.

    python -m loadtest.bench_trace [--requests N] [--workers 8] [--speed 8]
                                   [--capacities 2000000,8000000] [--offline] [--jobs 2]

Offline (loadtest/trace/offline.py), for each cache capacity per prefill worker (tokens;
unlimited first): the token hit rate of our policy (`RoutePolicy.choose`), round-robin,
random and least-loaded, against the upper bound (every block of every earlier request
cached: the trace's own repeat share), and ours against each baseline. Two more rows: the
same policy given each worker's own hit (what the router could do with per-writer match
results), and one store shared by all workers (kvfabric's SSD tier) of the same total size.
The replay is deterministic: hit rates do not depend on this machine's load. TTFT figures
are simulated (the cost model's clock), not measured.

Live (loadtest/trace/live.py; skipped with --offline): the first requests through a
mock-engine cluster, the hit share its usage reports against the offline prediction for the
same requests, TTFT p50/p99 (wall clock: noisy on a shared machine) and errors.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace

from loadtest.results import BenchResult, bench_options
from loadtest.trace.live import LiveConfig, run_live
from loadtest.trace.offline import ReplayConfig, ReplayResult, replay
from loadtest.trace.policies import BASELINES, OURS, OURS_PER_WORKER, POLICY_NAMES
from loadtest.trace.synth import (
    DEFAULT_TRACE,
    PromptHashes,
    TraceRequest,
    load_trace,
    upper_bound_hits,
)
from shared.models import model_path, served_name
from worker.engine.checkpoint import Checkpoint

SHARE = "share of prompt tokens"
DEFAULTS: dict[str, object] = {
    "requests": None,  # the whole trace
    "workers": 8,
    "speed": 8.0,  # 8 workers at 8x the trace's rate: ~60% of their prefill time busy
    "capacities": "2000000,8000000",
    "offline": False,
    "jobs": min(os.cpu_count() or 1, 4),
    "model": "tiny-coder",
    "live_requests": 200,
    "live_speed": 2.0,  # LiveConfig.speed: why not faster
    "live_workers": 2,
    "mock_speedup": 10.0,
}
QUICK = {"requests": 1000, "capacities": "500000", "live_requests": 40}

# The requests and their hashes, set before the pool forks: its processes inherit them
# instead of unpickling 180K ids' hashes per replay.
_INPUTS: dict[str, object] = {}


def _replay_one(args: tuple[ReplayConfig, str]) -> ReplayResult:
    config, policy = args
    return replay(_INPUTS["requests"], _INPUTS["prompts"], config, policy)  # type: ignore[arg-type]


def _label(capacity: int | None) -> str:
    return "unlimited" if capacity is None else f"{capacity / 1e6:g}M tokens per worker"


def offline_table(
    result: BenchResult,
    requests: list[TraceRequest],
    prompts: PromptHashes,
    base: ReplayConfig,
    capacities: Sequence[int | None],
    jobs: int,
) -> None:
    """Every policy at every capacity, and the shared store; ratios and figures."""
    for request in requests:  # hash every prompt once, before the pool forks
        prompts.hashes(request)
    _INPUTS.update(requests=requests, prompts=prompts)
    runs = [(c, p, False) for c in capacities for p in POLICY_NAMES]
    runs += [(c, OURS, True) for c in capacities]
    tasks = [
        (
            replace(
                base,
                capacity_tokens=c and (c * base.num_workers if shared else c),
                shared_cache=shared,
            ),
            policy,
        )
        for c, policy, shared in runs
    ]
    if jobs > 1:
        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("fork")) as pool:
            outs = list(pool.map(_replay_one, tasks))
    else:
        outs = [_replay_one(t) for t in tasks]
    got = {(c, p, s): out for (c, p, s), out in zip(runs, outs, strict=True)}

    hits = upper_bound_hits(requests, prompts.block_size)
    bound = sum(hits) / sum(r.input_length for r in requests)
    result.figure("upper bound: prompt tokens in blocks seen before", bound, SHARE)
    num_ids = sum(len(r.hash_ids) for r in requests)
    seen: set[int] = set()
    repeats = 0
    for r in requests:
        repeats += sum(h in seen for h in r.hash_ids)
        seen.update(r.hash_ids)
    result.figure(
        "trace blocks (512 tokens) repeating an earlier one", repeats / num_ids, "share of blocks"
    )
    for c in capacities:
        label = _label(c)
        ours = got[c, OURS, False].hit_rate
        result.ratio(f"hit rate / upper bound, ours, {label}", ours, bound, "upper bound", SHARE)
        for name in BASELINES:
            result.ratio(
                f"hit rate, ours vs {name}, {label}",
                ours,
                got[c, name, False].hit_rate,
                name,
                SHARE,
            )
        result.ratio(
            f"hit rate, RoutePolicy given per-worker hits vs as is, {label}",
            got[c, OURS_PER_WORKER, False].hit_rate,
            ours,
            "RoutePolicy as is",
            SHARE,
        )
        result.ratio(
            f"hit rate, ours, one shared store vs a cache per worker, {label}",
            got[c, OURS, True].hit_rate,
            ours,
            "a cache per worker",
            SHARE,
        )
    for c in capacities:
        for name in POLICY_NAMES:
            result.figure(f"hit rate, {name}, {_label(c)}", got[c, name, False].hit_rate, SHARE)
        total = "unlimited" if c is None else f"{c * base.num_workers / 1e6:g}M tokens"
        result.figure(
            f"hit rate, ours, one shared store ({total})", got[c, OURS, True].hit_rate, SHARE
        )
    result.figure(
        f"simulated prefill utilization, ours, {_label(None)}",
        got[None, OURS, False].utilization,
        "share of worker time",
    )
    tight = capacities[-1]
    for name in POLICY_NAMES:
        out = got[tight, name, False]
        for q in (0.5, 0.99):
            result.figure(
                f"simulated TTFT p{q * 100:g}, {name}, {_label(tight)}", out.ttft_s(q) * 1e3, "ms"
            )
    result.note(
        f"offline: {len(requests):,} requests at {base.speed:g}x the trace's rate, "
        f"{base.num_workers} prefill workers (a node each) with a cache each, LRU past "
        "capacity; deterministic (no wall clock involved)"
    )


def live_figures(result: BenchResult, trace: list[TraceRequest], config: LiveConfig) -> None:
    live = run_live(trace, config)
    if live.answered:
        result.ratio(
            "live hit share vs offline prediction",
            live.hit_share,
            live.predicted_share,
            "offline replay, same requests",
            SHARE,
        )
    result.figure("live: hit share from the cluster's usage", live.hit_share, SHARE)
    result.figure("live: predicted hit share", live.predicted_share, SHARE)
    result.figure("live: requests answered", len(live.answered), "requests")
    result.figure("live: requests with exactly the predicted hit", live.num_exact, "requests")
    result.figure("live: errors", sum(live.errors.values()), "requests", 0, lower_is_better=True)
    if any(o.ttft_s is not None for o in live.answered):
        result.figure("live: TTFT p50", live.ttft_s(0.5) * 1e3, "ms")
        result.figure("live: TTFT p99", live.ttft_s(0.99) * 1e3, "ms")
    for line in live.reductions():
        result.note(f"live: {line}")
    for error, count in live.errors.items():
        result.note(f"live: {count} x {error}")
    result.note("live: TTFT on the wall clock of a shared machine (noisy)")


def _capacities(text: str) -> list[int | None]:
    try:
        values = [int(float(v)) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"capacities must be token counts separated by commas: {text!r}") from None
    if any(v <= 0 for v in values):
        raise ValueError(f"capacities must be > 0: {text!r}")
    return [None, *sorted(values, reverse=True)]


def run(quick: bool = False, **options: object) -> BenchResult:
    """Options: the CLI's (requests, workers, speed, capacities, offline, jobs, model,
    live_requests, live_speed, live_workers, mock_speedup). Quick: 1,000 requests, one
    bounded capacity, 40 live requests."""
    args = bench_options(DEFAULTS, options, QUICK if quick else None)
    result = BenchResult("trace", quick)
    trace = load_trace(DEFAULT_TRACE, args.requests)
    vocab_size = Checkpoint(model_path(args.model)).config().vocab_size
    prompts = PromptHashes(served_name(args.model), vocab_size)
    base = ReplayConfig(num_workers=args.workers, speed=args.speed)
    print(f"trace: offline replay of {len(trace):,} requests ...", file=sys.stderr, flush=True)
    offline_table(result, trace, prompts, base, _capacities(args.capacities), args.jobs)
    if not args.offline:
        print("trace: live replay ...", file=sys.stderr, flush=True)
        live = LiveConfig(
            num_requests=args.live_requests,
            speed=args.live_speed,
            mock_speedup=args.mock_speedup,
            num_workers=args.live_workers,
            model=args.model,
        )
        live_figures(result, trace, live)
    return result.finish()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, help="the first N requests (default: all)")
    parser.add_argument("--workers", type=int, default=DEFAULTS["workers"])
    parser.add_argument(
        "--speed",
        type=float,
        default=DEFAULTS["speed"],
        help="the trace's arrivals, this many times faster",
    )
    parser.add_argument(
        "--capacities",
        default=DEFAULTS["capacities"],
        help="cache sizes per worker, tokens, comma-separated (unlimited too)",
    )
    parser.add_argument("--offline", action="store_true", help="skip the live replay")
    parser.add_argument(
        "--jobs",
        type=int,
        default=DEFAULTS["jobs"],
        help="offline replays run in parallel processes",
    )
    parser.add_argument("--model", default=DEFAULTS["model"])
    parser.add_argument("--live-requests", type=int, default=DEFAULTS["live_requests"])
    parser.add_argument("--live-speed", type=float, default=DEFAULTS["live_speed"])
    parser.add_argument("--live-workers", type=int, default=DEFAULTS["live_workers"])
    parser.add_argument("--mock-speedup", type=float, default=DEFAULTS["mock_speedup"])
    parser.add_argument("--quick", action="store_true", help="small sizes (CI)")
    args = vars(parser.parse_args())
    quick = args.pop("quick")
    if quick:  # the quick sizes, unless a flag says otherwise
        args = {k: v for k, v in args.items() if v != DEFAULTS[k] and v is not None}
    run(quick, **args).print()


if __name__ == "__main__":
    main()
