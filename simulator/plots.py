"""PNG plots of a simulated day (matplotlib, Agg): utilization, TTFT, store bandwidth and
revenue over the day's hours."""

from __future__ import annotations

from pathlib import Path

from simulator.fluid import Day


def write_plots(day: Day, directory: Path, store_capacity_bytes_per_s: float) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    hours = day.hours
    charts = {
        "utilization.png": (
            "GPU utilization",
            "busy share",
            [("prefill", day.prefill_util), ("decode", day.decode_util)],
            None,
        ),
        "ttft.png": (
            "time to first token",
            "seconds",
            [("p50", day.ttft_p50_s), ("p99", day.ttft_p99_s)],
            None,
        ),
        "store_bandwidth.png": (
            "store reads (hits not in node memory)",
            "TiB/s",
            [("demand", day.store_read_bytes_per_s / (1 << 40))],
            ("capacity", store_capacity_bytes_per_s / (1 << 40)),
        ),
        "revenue.png": (
            "revenue",
            "CNY per hour",
            [("revenue", day.revenue_micro_cny_per_s * 3600 / 1e6)],
            None,
        ),
    }
    written = []
    for name, (title, ylabel, series, line) in charts.items():
        fig, ax = plt.subplots(figsize=(8, 3.5))
        for label, values in series:
            ax.plot(hours, values, label=label)
        if line is not None:
            ax.axhline(line[1], color="red", linestyle="--", label=line[0])
        ax.set_title(f"{title} (fluid day; calibrated on a simulated slice)")
        ax.set_xlabel("hour of the day")
        ax.set_ylabel(ylabel)
        ax.set_xlim(0, 24)
        ax.set_ylim(bottom=0)
        ax.legend()
        fig.tight_layout()
        path = directory / name
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written
