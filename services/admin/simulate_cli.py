"""`kvfabric simulate`: a cluster simulated on this machine, every request routed by the
production router policy over kv-index's production index (`simulator/`, docs/simulator.md).

Prints a row per window of simulated time (requests, measured hit rate, TTFT, GPU
utilization, tokens/s), the steady state after the warm-up, the run's ledger and how many
decisions the real policy + index made per CPU-second. Progress goes to stderr per window.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import typer

from services.admin.output import check_format, emit, format_option

_WHAT_IF_NAMES = (
    "hit-90",
    "store-half",
    "kv-double",
    "swa-ttl-60",
    "replay-off",
    "index-shard-lost",
    "decode-node-lost",
    "daily",
    "round-robin",
)

COLUMNS = (
    ("window", "{:>6}"),
    ("requests", "{:>8}"),
    ("refused", "{:>7}"),
    ("hit_rate", "{:>8.1%}"),
    ("ttft_p50_s", "{:>10.3f}"),
    ("ttft_p99_s", "{:>10.3f}"),
    ("prefill_util", "{:>12.1%}"),
    ("decode_util", "{:>11.1%}"),
    ("input_tokens_per_s", "{:>18,.0f}"),
    ("output_tokens_per_s", "{:>19,.0f}"),
)


def simulate_command(
    prefill_servers: int = typer.Option(1, help="prefill servers"),
    gpus_per_prefill_server: int = typer.Option(8, help="GPUs per prefill server"),
    decode_nodes: int = typer.Option(1, help="decode super-nodes"),
    decode_node_gpus: int = typer.Option(8, help="GPUs per decode super-node"),
    reference: bool = typer.Option(
        False, help="the reference shape: 150 prefill servers x 8, 19 decode nodes x 64"
    ),
    load: float = typer.Option(0.7, help="offered load: share of the reference rate per GPU"),
    duration: float = typer.Option(120.0, help="simulated seconds of arrivals"),
    warmup: float = typer.Option(30.0, help="simulated seconds left out of the steady state"),
    window: float = typer.Option(10.0, help="simulated seconds per window"),
    seed: int = typer.Option(0, help="the workload's seed (a seed gives one run)"),
    day: bool = typer.Option(
        False,
        "--day",
        help="a day: calibrate a fluid model on windows of this slice at --loads, run it on "
        "the plan's fleet and traffic, compare with `kvfabric plan`, print the limits",
    ),
    loads: str = typer.Option(
        "0.5,0.7,0.9", help="--day: offered loads of the calibration windows, comma-separated"
    ),
    calibration_duration: float = typer.Option(
        40.0, help="--day: simulated seconds of arrivals per calibration run"
    ),
    calibration_warmup: float = typer.Option(
        10.0, help="--day: simulated seconds left out of each calibration run"
    ),
    curve: str = typer.Option("flat", help="--day: the traffic over the day: flat | daily"),
    step: float = typer.Option(60.0, help="--day: seconds per step of the fluid day"),
    what_if: list[str] = typer.Option(  # noqa: B008 (typer's idiom)
        [], "--what-if", help="--day: a what-if row (repeatable): " + ", ".join(_WHAT_IF_NAMES)
    ),
    what_ifs: bool = typer.Option(False, "--what-ifs", help="--day: every what-if"),
    plots: Path | None = typer.Option(  # noqa: B008
        None, help="--day: write PNG plots (utilization, TTFT, store, revenue) here"
    ),
    bench_json: list[Path] = typer.Option(  # noqa: B008
        [],
        "--bench-json",
        help="--day: a `kvfabric bench NAME --json` result whose figures replace the recorded "
        "capacities of the limits table (repeatable)",
    ),
    json_output: bool = typer.Option(False, "--json", help="the same as --format json"),
    fmt: str = format_option(),
) -> None:
    """Simulate a cluster with the production router and kv-index, window by window (or a
    day with --day)."""
    fmt = "json" if json_output else check_format(fmt)
    if day:
        if reference:
            raise typer.BadParameter("--day calibrates on a slice: leave out --reference")
        _day_command(
            shape=(prefill_servers, gpus_per_prefill_server, decode_nodes, decode_node_gpus),
            loads=loads,
            duration=calibration_duration,
            warmup=calibration_warmup,
            window=window,
            seed=seed,
            curve=curve,
            step=step,
            what_ifs=list(_WHAT_IF_NAMES) if what_ifs else what_if,
            plots=plots,
            bench_json=bench_json,
            fmt=fmt,
        )
        return
    # Imported here: the simulator pulls the router and kv-index, which other commands skip.
    from simulator import SimConfig, Simulation, Window

    if reference:
        prefill_servers, gpus_per_prefill_server, decode_nodes, decode_node_gpus = 150, 8, 19, 64
    try:
        config = SimConfig.scaled(
            prefill_servers,
            decode_nodes,
            decode_node_gpus,
            gpus_per_prefill_server=gpus_per_prefill_server,
            load=load,
            duration_s=duration,
            warmup_s=warmup,
            window_s=window,
            seed=seed,
        )
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    started = time.perf_counter()

    def progress(done: Window, decision_cpu_s: float) -> None:
        print(
            f"simulated {done.end_s:.0f} s: {done.num_routed} requests in the last window, "
            f"hit {done.hit_rate:.1%}, {time.perf_counter() - started:.1f} s wall",
            file=sys.stderr,
            flush=True,
        )

    sim = Simulation(config, progress=progress).run()
    wall_s = time.perf_counter() - started
    rows = [sim.summarize(w) for w in sim.windows.ordered()]
    steady = sim.steady()
    steady_row = sim.summarize(steady) if steady is not None else None
    ledger = vars(sim.ledger)
    document = {
        "config": {
            "num_prefill_gpus": config.num_prefill_gpus,
            "num_decode_gpus": config.num_decode_gpus,
            "load": load,
            "offered_requests_per_s": sim.rate_per_s,
            "duration_s": duration,
            "warmup_s": warmup,
            "window_s": window,
            "seed": seed,
        },
        "windows": rows,
        "steady": steady_row,
        "ledger": ledger,
        "decisions": sim.num_decisions,
        "decisions_per_cpu_s": sim.decisions_per_cpu_s,
        "wall_s": wall_s,
    }

    def table() -> None:
        print(
            f"{config.num_prefill_gpus} prefill GPUs ({prefill_servers} x "
            f"{gpus_per_prefill_server}), {config.num_decode_gpus} decode GPUs "
            f"({decode_nodes} x {decode_node_gpus}); {sim.rate_per_s:,.0f} requests/s offered "
            f"(load {load}); seed {seed}"
        )
        print("".join(f"{name:>{len(spec.format(0)) + 1}}" for name, spec in COLUMNS))
        for row in rows:
            print(_line(row))
        if steady_row is not None:
            print(f"steady state, {steady_row['start_s']:.0f}-{steady_row['end_s']:.0f} s:")
            print(_line({**steady_row, "window": "all"}))
        print(
            f"requests: {ledger['num_issued']} issued, {ledger['num_finished']} finished, "
            f"{ledger['num_refused']} refused; prompt tokens {ledger['num_hit_tokens']:,} hit "
            f"+ {ledger['num_computed_tokens']:,} computed"
        )
        print(
            f"router policy + kv-index: {sim.num_decisions} decisions, "
            f"{sim.decisions_per_cpu_s:,.0f} per CPU-second; run {wall_s:.1f} s wall"
        )

    emit(fmt, rows, table, document=document)


def _line(row: dict) -> str:
    cells = []
    for name, spec in COLUMNS:
        value = row[name]
        width = len(spec.format(0)) + 1
        if value is None:
            cells.append(f"{'-':>{width}}")
        elif isinstance(value, str):
            cells.append(f"{value:>{width}}")
        else:
            cells.append(" " + spec.format(value))
    return "".join(cells)


def _day_command(
    *,
    shape: tuple[int, int, int, int],
    loads: str,
    duration: float,
    warmup: float,
    window: float,
    seed: int,
    curve: str,
    step: float,
    what_ifs: list[str],
    plots: Path | None,
    bench_json: list[Path],
    fmt: str,
) -> None:
    from simulator import SimConfig
    from simulator.day import (
        WHAT_IFS,
        DaySettings,
        reference_plan,
        reproduction,
        run_fluid_day,
        run_what_ifs,
    )
    from simulator.fluid import FluidModel, calibrate
    from simulator.limits import limits, measured_capacities

    unknown = [name for name in what_ifs if name not in WHAT_IFS]
    if unknown:
        raise typer.BadParameter(f"unknown what-if {unknown[0]!r}: one of {', '.join(WHAT_IFS)}")
    if curve not in ("flat", "daily"):
        raise typer.BadParameter(f"--curve must be flat or daily, got {curve!r}")
    prefill_servers, gpus_per_prefill_server, decode_nodes, decode_node_gpus = shape
    try:
        load_values = tuple(float(v) for v in loads.split(",") if v.strip())
        if not load_values or min(load_values) <= 0:
            raise ValueError("--loads must be positive numbers")
        settings = DaySettings(
            num_prefill_servers=prefill_servers,
            num_decode_nodes=decode_nodes,
            decode_node_gpus=decode_node_gpus,
            loads=load_values,
            duration_s=duration,
            warmup_s=warmup,
            window_s=window,
            seed=seed,
            curve=curve,
            step_s=step,
            overrides={"gpus_per_prefill_server": gpus_per_prefill_server},
        )
        config = settings.slice_config()
        capacities = measured_capacities(bench_json)
    except (ValueError, OSError, KeyError) as exc:
        raise typer.BadParameter(str(exc)) from exc
    started = time.perf_counter()

    def progress(line: str) -> None:
        print(f"{line} ({time.perf_counter() - started:.1f} s)", file=sys.stderr, flush=True)

    the_plan = reference_plan()
    points = calibrate(config, settings.loads, progress)
    model = FluidModel(points)
    the_day = run_fluid_day(points, the_plan, curve, step)
    totals = the_day.totals()
    rows = reproduction(the_day, the_plan)
    decisions_per_cpu_s = min(p.decisions_per_cpu_s for p in points)
    limit_rows = [
        limit.to_dict()
        for limit in limits(the_day, the_plan, SimConfig(), decisions_per_cpu_s, capacities)
    ]
    what_if_rows = run_what_ifs(what_ifs, settings, points, the_plan, progress) if what_ifs else []
    written = []
    if plots is not None:
        from simulator.plots import write_plots

        written = [str(p) for p in write_plots(the_day, plots, SimConfig().store_read_bytes_per_s)]
    wall_s = time.perf_counter() - started
    document = {
        "slice": {
            "num_prefill_gpus": config.num_prefill_gpus,
            "num_decode_gpus": config.num_decode_gpus,
            "loads": list(settings.loads),
            "duration_s": duration,
            "warmup_s": warmup,
            "seed": seed,
        },
        "fleet": {
            "num_prefill_gpus": the_day.num_prefill_gpus,
            "num_decode_gpus": the_day.num_decode_gpus,
            "curve": curve,
            "step_s": step,
        },
        "calibration": [p.to_dict() for p in points],
        "sampling_error": model.leave_one_out(),
        "day": totals,
        "reproduction": rows,
        "limits": limit_rows,
        "capacities_source": capacities.source,
        "what_ifs": what_if_rows,
        "plots": written,
        "wall_s": wall_s,
    }

    def table() -> None:
        _print_day(document)

    emit(fmt, rows, table, document=document)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:+.1%}"


def _num(value: float, unit: str = "") -> str:
    magnitude = abs(value)
    if unit.startswith("bytes"):
        for size, name in ((1 << 40, "Ti"), (1 << 30, "Gi"), (1 << 20, "Mi")):
            if magnitude >= size:
                return f"{value / size:,.2f}{name}"
    if magnitude >= 1e12:
        return f"{value / 1e12:,.2f}T"
    if magnitude >= 1e9:
        return f"{value / 1e9:,.2f}G"
    if magnitude >= 1e6:
        return f"{value / 1e6:,.2f}M"
    if magnitude >= 100:
        return f"{value:,.0f}"
    if magnitude >= 1:
        return f"{value:,.2f}"
    return f"{value:.1%}" if value else "0"


def _print_day(doc: dict) -> None:
    sl, fleet = doc["slice"], doc["fleet"]
    print(
        f"calibration: a slice of {sl['num_prefill_gpus']} prefill + {sl['num_decode_gpus']} "
        f"decode GPUs (the reference's store per GPU), every request through the production "
        f"router policy and kv-index, {sl['duration_s']:g} s per load ({sl['warmup_s']:g} s "
        "warm-up); not a full-scale window: kv-index shard fan-out, NATS fan-in and a table of "
        "2,400 workers are not in it (see the limits)"
    )
    print(
        f"{'load':>6}{'req/s/GPU':>10}{'requests':>9}{'hit':>7}{'local':>7}{'prefill':>8}"
        f"{'decode':>8}{'ttft_p50':>9}{'ttft_p99':>9}{'refused':>8}{'prompt':>8}{'output':>7}"
        f"{'decisions/cpu-s':>16}{'wall_s':>7}"
    )
    for p in doc["calibration"]:
        print(
            f"{p['load']:>6g}{p['arrivals_per_s_per_gpu']:>10.2f}{p['num_requests']:>9}"
            f"{p['hit_rate']:>7.1%}{p['local_hit_share']:>7.1%}{p['prefill_util']:>8.1%}"
            f"{p['decode_util']:>8.1%}{p['ttft_p50_s']:>9.3f}{p['ttft_p99_s']:>9.3f}"
            f"{p['refused_share']:>8.1%}{p['input_tokens_per_request']:>8,.0f}"
            f"{p['output_tokens_per_request']:>7,.0f}{p['decisions_per_cpu_s']:>16,.0f}"
            f"{p['wall_s']:>7.1f}"
        )
    print("sampling error: each window against the fluid model of the others (leave-one-out)")
    print(
        f"{'load':>6}{'hit meas':>9}{'pred':>7}{'err':>7}{'sd':>6}{'prefill meas':>13}{'pred':>7}"
        f"{'err':>7}{'sd':>6}{'decode err':>11}{'ttft_p99 meas':>14}{'pred':>7}{'err':>8}"
    )
    for r in doc["sampling_error"]:
        h, pf, d, tt = r["hit_rate"], r["prefill_util"], r["decode_util"], r["ttft_p99_s"]
        print(
            f"{r['load']:>6g}{h['measured']:>9.1%}{h['predicted']:>7.1%}{_pct(h['error']):>7}"
            f"{r['hit_rate_sd']:>6.1%}{pf['measured']:>13.1%}{pf['predicted']:>7.1%}"
            f"{_pct(pf['error']):>7}{r['prefill_util_sd']:>6.1%}{_pct(d['error']):>11}"
            f"{tt['measured']:>14.3f}{tt['predicted']:>7.3f}{_pct(tt['error']):>8}"
        )
    day = doc["day"]
    print(
        f"the day: {fleet['num_prefill_gpus']:,} prefill + {fleet['num_decode_gpus']:,} decode "
        f"GPUs (the plan's fleet), {fleet['curve']} traffic at the plan's mean requests/s, "
        f"{fleet['step_s']:g} s steps; {day['steps_beyond']} steps past the highest "
        "calibrated load (served rate held there)"
    )
    print("reproduction of `kvfabric plan`:")
    print(f"  {'figure':<36}{'plan':>12}{'simulated':>12}{'diff':>8}  why")
    for r in doc["reproduction"]:
        unit = "bytes" if r["figure"].startswith("store") else ""
        print(
            f"  {r['figure']:<36}{_num(r['plan'], unit):>12}{_num(r['simulated'], unit):>12}"
            f"{_pct(r['difference']):>8}  {r['why']}"
        )
    print(f"limits (demand: the day's mean; capacity: {doc['capacities_source']}):")
    print(f"  {'part':<52}{'demand':>10}{'capacity':>10}{'headroom':>9}{'needs':>6}  unit; note")
    for r in doc["limits"]:
        capacity = "-" if r["capacity"] is None else _num(r["capacity"], r["unit"])
        headroom = "-" if r["headroom"] is None else f"{r['headroom']:.2f}x"
        needs = "-" if r["instances"] is None else str(r["instances"])
        print(
            f"  {r['part']:<52}{_num(r['demand'], r['unit']):>10}{capacity:>10}"
            f"{headroom:>9}{needs:>6}"
            f"  {r['unit']}; {r['note']}"
        )
    if doc["what_ifs"]:
        print("what-ifs (each calibrated at one load; a day on the plan's fleet):")
        print(
            f"  {'what-if':<44}{'hit':>7}{'ttft_p99':>9}{'prefill':>8}{'decode':>8}"
            f"{'refused':>8}{'CNY/busy GPU-h':>15}{'store TiB/s':>12}"
        )
        for r in doc["what_ifs"]:
            if r.get("not_modelled"):
                print(f"  {r['what_if']:<44}not modelled: {r['not_modelled']}")
                continue
            print(
                f"  {r['what_if']:<44}{r['hit_rate']:>7.1%}{r['ttft_p99_s']:>9.3f}"
                f"{r['prefill_util']:>8.1%}{r['decode_util']:>8.1%}{r['refused']:>8.1%}"
                f"{r['revenue_per_busy_gpu_hour']:>15,.2f}"
                f"{r['store_read_bytes_per_s'] / (1 << 40):>12.3f}"
            )
    if doc["plots"]:
        print(f"plots: {', '.join(doc['plots'])}")
    print(f"run {doc['wall_s']:.1f} s wall")
