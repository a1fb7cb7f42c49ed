"""`kvfabric simulate`: a cluster simulated on this machine, every request routed by the
production router policy over kv-index's production index (`simulator/`, docs/simulator.md).

Prints a row per window of simulated time (requests, measured hit rate, TTFT, GPU
utilization, tokens/s), the steady state after the warm-up, the run's ledger and how many
decisions the real policy + index made per CPU-second. Progress goes to stderr per window.
"""

from __future__ import annotations

import sys
import time

import typer

from services.admin.output import check_format, emit, format_option

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
    json_output: bool = typer.Option(False, "--json", help="the same as --format json"),
    fmt: str = format_option(),
) -> None:
    """Simulate a cluster with the production router and kv-index, window by window."""
    fmt = "json" if json_output else check_format(fmt)
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
