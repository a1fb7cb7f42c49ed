"""The production trace (loadtest/data/README.md: 12,031 requests, one hour) replayed offline
through the router's real policy and kv-index's real index, and live through a cluster.

    python -m loadtest.bench_trace [--requests N] [--workers 8] [--speeds 1,2,4,8]
                                   [--capacities 8000000,2000000] [--bandwidths 9,2]
                                   [--trace PATH] [--offline] [--jobs 2]

Offline (loadtest/trace/offline.py): every policy -- the router's `kv` (its default),
`least-loaded` and `round-robin` (the router's own placements) and the oracle (each request
to the worker with the longest own hit) -- over the grid of per-worker memory (tokens;
unlimited first) x the store's read bandwidth per GPU (GB/s; unlimited first) x the trace's
rate. Per cell: hit share by tier (the worker's own memory, the store), the store's bytes
read per second, TTFT p50/p99/mean; kv's TTFT against least-loaded's and round-robin's, and
its own-memory hits against the oracle's. Then the rate is raised until round-robin's p99
passes 30 s (one cell: the tightest memory and bandwidth), and kv's mean TTFT is set against
round-robin's at the highest rate where round-robin's p99 is still within 30 s. The replay
is deterministic; TTFT is simulated (the cost model's clock), not measured. `--trace` takes
another trace in the same (Mooncake) format.

Live (loadtest/trace/live.py; skipped with --offline): the first requests through a
mock-engine cluster under each of the router's placements in turn (quick: kv alone), the hit
share its usage reports against the offline prediction for the same requests under the same
placement, TTFT p50/p99 (wall clock: noisy on a shared machine) beside the prediction's, and
errors.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path

from loadtest.results import BenchResult, OptionError, bench_options
from loadtest.trace.live import LiveConfig, run_live
from loadtest.trace.offline import ORACLE, POLICY_NAMES, ReplayConfig, ReplayResult, replay
from loadtest.trace.synth import (
    DEFAULT_TRACE,
    PromptHashes,
    TraceRequest,
    load_trace,
    upper_bound_hits,
)
from services.router.policy import KV, LEAST_LOADED, ROUND_ROBIN
from shared.models import model_path, served_name
from worker.engine.checkpoint import Checkpoint

SHARE = "share of prompt tokens"
P99_LIMIT_S = 30.0  # round-robin "still answers": its p99 within this
DEFAULTS: dict[str, object] = {
    "requests": None,  # the whole trace
    "trace": str(DEFAULT_TRACE),
    "workers": 8,
    "speeds": "1,2,4,8",  # 8 workers at 8x the trace's rate: ~45% of their prefill time busy
    "capacities": "8000000,2000000",
    "bandwidths": "9,2",  # GB/s per GPU: the reference's ~9, and a starved store
    "saturation_speeds": "12,14,16,17,18,19,20",
    "offline": False,
    "jobs": min(os.cpu_count() or 1, 4),
    "model": "tiny-coder",
    "live_requests": 200,
    "live_speed": 2.0,  # LiveConfig.speed: why not faster
    "live_workers": 4,  # prefill workers; the live shape: 4 prefill, 2 decode
    "live_decode_workers": 2,
    "mock_speedup": 10.0,
}
QUICK = {
    "requests": 1000,
    "speeds": "8",
    "capacities": "500000",
    "bandwidths": "2",
    "saturation_speeds": "16",
    "live_requests": 40,
    "live_workers": 2,
}

# The requests and their hashes, set before the pool forks: its processes inherit them
# instead of unpickling 180K ids' hashes per replay.
_INPUTS: dict[str, object] = {}

Cell = tuple[int | None, float | None, float]  # memory per worker, GB/s per GPU, speed


def _replay_one(args: tuple[ReplayConfig, str]) -> ReplayResult:
    config, policy = args
    return replay(_INPUTS["requests"], _INPUTS["prompts"], config, policy)  # type: ignore[arg-type]


def _memory(capacity: int | None) -> str:
    return "unlimited" if capacity is None else f"{capacity / 1e6:g}M"


def _bandwidth(gbps: float | None) -> str:
    return "unlimited" if gbps is None else f"{gbps:g} GB/s"


def _cell(cell: Cell) -> str:
    capacity, gbps, speed = cell
    return f"memory {_memory(capacity)}, store {_bandwidth(gbps)}, {speed:g}x"


def _run_all(
    base: ReplayConfig, runs: Sequence[tuple[Cell, str]], jobs: int
) -> dict[tuple[Cell, str], ReplayResult]:
    tasks = [
        (replace(base, capacity_tokens=c, store_gbps_per_gpu=g, speed=s), policy)
        for (c, g, s), policy in runs
    ]
    if jobs > 1:
        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("fork")) as pool:
            outs = list(pool.map(_replay_one, tasks))
    else:
        outs = [_replay_one(t) for t in tasks]
    return dict(zip(runs, outs, strict=True))


def offline_table(
    result: BenchResult,
    requests: list[TraceRequest],
    prompts: PromptHashes,
    base: ReplayConfig,
    grid: tuple[Sequence[int | None], Sequence[float | None], Sequence[float]],
    saturation_speeds: Sequence[float],
    jobs: int,
) -> None:
    """Every policy in every cell of the grid, then the saturation sweep; ratios, figures
    and the table."""
    for request in requests:  # hash every prompt once, before the pool forks
        prompts.hashes(request)
    _INPUTS.update(requests=requests, prompts=prompts)
    capacities, bandwidths, speeds = grid
    cells = [(c, g, s) for c in capacities for g in bandwidths for s in speeds]
    runs = [(cell, p) for cell in cells for p in POLICY_NAMES]
    tight = (capacities[-1], bandwidths[-1])
    sweep = [((*tight, s), p) for s in saturation_speeds for p in (KV, ROUND_ROBIN)]
    total = len(runs) + len(sweep)
    print(f"trace: {total} offline replays on {jobs} processes ...", file=sys.stderr, flush=True)
    got = _run_all(base, runs + [r for r in sweep if r not in runs], jobs)

    hits = upper_bound_hits(requests, prompts.block_size)
    bound = sum(hits) / sum(r.input_length for r in requests)
    result.figure("upper bound: prompt tokens in blocks seen before", bound, SHARE)
    result.note(
        "cell | policy | hit share: own memory / store | store GB/s read | TTFT p50 / p99 / mean ms"
    )
    for cell in cells:
        for policy in POLICY_NAMES:
            out = got[cell, policy]
            result.note(
                f"{_cell(cell)} | {policy} | {out.local_hit_rate:.3f} / {out.store_hit_rate:.3f}"
                f" | {out.store_bytes_per_s / 1e9:.3f} | {out.ttft_s(0.5) * 1e3:,.0f} / "
                f"{out.ttft_s(0.99) * 1e3:,.0f} / {out.mean_ttft_s * 1e3:,.0f}"
            )
    for cell in cells:
        kv = got[cell, KV]
        for peer in (LEAST_LOADED, ROUND_ROBIN):
            for q in (0.5, 0.99):
                result.ratio(
                    f"TTFT p{q * 100:g}, kv vs {peer}, {_cell(cell)}",
                    kv.ttft_s(q),
                    got[cell, peer].ttft_s(q),
                    peer,
                    "s",
                    1.0,
                    lower_is_better=True,
                )
        result.ratio(
            f"own-memory hits, kv vs the oracle, {_cell(cell)}",
            kv.local_hit_rate,
            got[cell, ORACLE].local_hit_rate,
            "oracle",
            SHARE,
            0.9,
        )
        if cell[0] is None and cell[1] is None:
            result.ratio(
                f"hit share, the oracle vs the upper bound, {_cell(cell)}",
                got[cell, ORACLE].hit_rate,
                bound,
                "upper bound",
                SHARE,
            )
    _saturation(result, got, tight, sorted({*saturation_speeds, *speeds}))
    result.note(
        f"offline: {len(requests):,} requests, {base.num_workers} prefill workers (a node "
        "each) with their own memory (LRU past capacity) over one store that keeps every "
        f"block; KV {base.cost.kv_bytes_per_token:,} bytes/token; deterministic (no wall "
        "clock involved)"
    )


def _saturation(
    result: BenchResult,
    got: dict[tuple[Cell, str], ReplayResult],
    tight: tuple[int | None, float | None],
    speeds: Sequence[float],
) -> None:
    """kv's mean TTFT against round-robin's at the highest rate where round-robin's p99 is
    within P99_LIMIT_S."""
    answered = [
        s
        for s in speeds
        if ((*tight, s), ROUND_ROBIN) in got
        and ((*tight, s), KV) in got
        and got[(*tight, s), ROUND_ROBIN].ttft_s(0.99) <= P99_LIMIT_S
    ]
    for s in speeds:
        if ((*tight, s), ROUND_ROBIN) in got and ((*tight, s), KV) in got:
            rr, kv = got[(*tight, s), ROUND_ROBIN], got[(*tight, s), KV]
            result.note(
                f"saturation: {_cell((*tight, s))}: round-robin p99 {rr.ttft_s(0.99):,.1f} s, "
                f"mean {rr.mean_ttft_s * 1e3:,.0f} ms; kv p99 {kv.ttft_s(0.99):,.1f} s, mean "
                f"{kv.mean_ttft_s * 1e3:,.0f} ms; utilization {kv.utilization:.2f}"
            )
    if not answered:
        result.note(f"saturation: round-robin's p99 passed {P99_LIMIT_S:g} s at every rate")
        return
    edge = (*tight, max(answered))
    result.ratio(
        f"mean TTFT, kv vs round-robin at the highest rate where round-robin's p99 <= "
        f"{P99_LIMIT_S:g} s ({_cell(edge)})",
        got[edge, KV].mean_ttft_s,
        got[edge, ROUND_ROBIN].mean_ttft_s,
        "round-robin",
        "s",
        1 / 25,
        lower_is_better=True,
    )


def live_figures(result: BenchResult, trace: list[TraceRequest], config: LiveConfig) -> None:
    """The cluster under `config.placement` against the offline replay of the same requests
    under the same placement."""
    live = run_live(trace, config)
    name = config.placement
    if live.answered:
        result.ratio(
            f"live hit share vs offline prediction, {name}",
            live.hit_share,
            live.predicted_share,
            "offline replay, same requests",
            SHARE,
        )
    result.figure(f"live {name}: hit share from the cluster's usage", live.hit_share, SHARE)
    result.figure(f"live {name}: predicted hit share", live.predicted_share, SHARE)
    result.figure(f"live {name}: requests answered", len(live.answered), "requests")
    result.figure(
        f"live {name}: requests with exactly the predicted hit", live.num_exact, "requests"
    )
    result.figure(
        f"live {name}: errors", sum(live.errors.values()), "requests", 0, lower_is_better=True
    )
    if any(o.ttft_s is not None for o in live.answered):
        for q in (0.5, 0.99):
            result.figure(f"live {name}: TTFT p{q * 100:g}", live.ttft_s(q) * 1e3, "ms")
            result.figure(
                f"live {name}: predicted TTFT p{q * 100:g}", live.predicted.ttft_s(q) * 1e3, "ms"
            )
    for line in live.reductions():
        result.note(f"live {name}: {line}")
    for error, count in live.errors.items():
        result.note(f"live {name}: {count} x {error}")


def _values(text: object, what: str, cast: type) -> list:
    # `--set speeds=8` arrives as a number, `--set speeds=1,2` as text.
    try:
        values = [cast(float(v)) for v in str(text).split(",") if v.strip()]
    except ValueError:
        raise OptionError(f"{what} must be numbers separated by commas: {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise OptionError(f"{what} must be > 0: {text!r}")
    return values


def run(quick: bool = False, **options: object) -> BenchResult:
    """Options: the CLI's (requests, trace, workers, speeds, capacities, bandwidths,
    saturation_speeds, offline, jobs, model, live_requests, live_speed, live_workers,
    live_decode_workers, mock_speedup). Quick: 1,000 requests, one cell and one rate of the
    sweep, 40 live requests on 2 prefill and 2 decode workers."""
    args = bench_options(DEFAULTS, options, QUICK if quick else None)
    result = BenchResult("trace", quick)
    trace = load_trace(Path(args.trace), args.requests)
    vocab_size = Checkpoint(model_path(args.model)).config().vocab_size
    prompts = PromptHashes(served_name(args.model), vocab_size)
    base = ReplayConfig(num_workers=args.workers)
    capacities = [None, *sorted(_values(args.capacities, "capacities", int), reverse=True)]
    bandwidths = [None, *sorted(_values(args.bandwidths, "bandwidths", float), reverse=True)]
    speeds = sorted(_values(args.speeds, "speeds", float))
    saturation = sorted(_values(args.saturation_speeds, "saturation_speeds", float))
    print(f"trace: offline replay of {len(trace):,} requests ...", file=sys.stderr, flush=True)
    offline_table(
        result, trace, prompts, base, (capacities, bandwidths, speeds), saturation, args.jobs
    )
    if not args.offline:
        print("trace: live replay ...", file=sys.stderr, flush=True)
        # Each placement in turn on a fresh cluster (quick: kv alone).
        for placement in (KV,) if quick else (KV, LEAST_LOADED, ROUND_ROBIN):
            live = LiveConfig(
                num_requests=args.live_requests,
                speed=args.live_speed,
                mock_speedup=args.mock_speedup,
                num_workers=args.live_workers,
                num_decode_workers=args.live_decode_workers,
                model=args.model,
                placement=placement,
            )
            live_figures(result, trace, live)
        result.note("live: TTFT on the wall clock of a shared machine (noisy)")
    return result.finish()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, help="the first N requests (default: all)")
    parser.add_argument("--trace", default=DEFAULTS["trace"], help="a trace in Mooncake's format")
    parser.add_argument("--workers", type=int, default=DEFAULTS["workers"])
    parser.add_argument(
        "--speeds",
        default=DEFAULTS["speeds"],
        help="the trace's rate multiples of the grid, comma-separated",
    )
    parser.add_argument(
        "--capacities",
        default=DEFAULTS["capacities"],
        help="each worker's own memory, tokens, comma-separated (unlimited too)",
    )
    parser.add_argument(
        "--bandwidths",
        default=DEFAULTS["bandwidths"],
        help="the store's read bandwidth per GPU, GB/s, comma-separated (unlimited too)",
    )
    parser.add_argument(
        "--saturation-speeds",
        default=DEFAULTS["saturation_speeds"],
        help="rates of the sweep that looks for round-robin's 30 s p99",
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
    parser.add_argument(
        "--live-workers", type=int, default=DEFAULTS["live_workers"], help="prefill workers"
    )
    parser.add_argument("--live-decode-workers", type=int, default=DEFAULTS["live_decode_workers"])
    parser.add_argument("--mock-speedup", type=float, default=DEFAULTS["mock_speedup"])
    parser.add_argument("--quick", action="store_true", help="small sizes (CI)")
    args = vars(parser.parse_args())
    quick = args.pop("quick")
    if quick:  # the quick sizes, unless a flag says otherwise
        args = {k: v for k, v in args.items() if v != DEFAULTS[k] and v is not None}
    run(quick, **args).print()


if __name__ == "__main__":
    main()
