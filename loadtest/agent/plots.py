"""PNG plots of agent runs (matplotlib, Agg: no display needed). Each plot takes several
reports by label, so runs measured side by side (two protocols, or kvfabric and another
server) share axes:

- ttft_per_step.png: p50 (solid) and p90 (dashed) time to first token by step index;
- hit_share_per_step.png: the share of prompt tokens served from the cache, by step index;
- latency_cdf.png: the distribution of TTFT and of end-to-end latency over all requests.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)
import numpy as np  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from loadtest.agent.report import AgentReport  # noqa: E402


def write_plots(reports: Mapping[str, AgentReport], out_dir: Path) -> list[Path]:
    """The three plots of `reports` (label -> report) in `out_dir`; returns their paths."""
    if not reports:
        raise ValueError("no reports to plot")
    out_dir.mkdir(parents=True, exist_ok=True)
    return [
        _save(_ttft_per_step(reports), out_dir / "ttft_per_step.png"),
        _save(_hit_share_per_step(reports), out_dir / "hit_share_per_step.png"),
        _save(_latency_cdf(reports), out_dir / "latency_cdf.png"),
    ]


def _ms(value: float | None) -> float:
    return float("nan") if value is None else value * 1e3


def _ttft_per_step(reports: Mapping[str, AgentReport]) -> plt.Figure:
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, report in reports.items():
        steps = report.by_step()
        x = [s["step"] for s in steps]
        (line,) = ax.plot(x, [_ms(s["ttft_s"]["p50"]) for s in steps], "o-", label=f"{label} p50")
        ax.plot(
            x,
            [_ms(s["ttft_s"]["p90"]) for s in steps],
            "--",
            color=line.get_color(),
            label=f"{label} p90",
        )
    ax.set(xlabel="step in session", ylabel="time to first token (ms)", title="TTFT per step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylim(bottom=0)
    ax.legend()
    return fig


def _hit_share_per_step(reports: Mapping[str, AgentReport]) -> plt.Figure:
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(reports)
    for i, (label, report) in enumerate(reports.items()):
        steps = report.by_step()
        x = np.array([s["step"] for s in steps]) + (i - (len(reports) - 1) / 2) * width
        shares = [100 * (s["hit_share"] or 0.0) for s in steps]
        ax.bar(x, shares, width=width, label=label)
    ax.set(
        xlabel="step in session",
        ylabel="prompt tokens from the cache (%)",
        title="Cache-hit share per step",
        ylim=(0, 100),
    )
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend()
    return fig


def _latency_cdf(reports: Mapping[str, AgentReport]) -> plt.Figure:
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, metric, title in zip(axes, ("ttft_s", "e2e_s"), ("TTFT", "end to end"), strict=True):
        for label, report in reports.items():
            values = np.sort(
                [_ms(getattr(r, metric)) for r in report.answered if getattr(r, metric) is not None]
            )
            if values.size:
                ax.step(
                    values, np.arange(1, values.size + 1) / values.size, where="post", label=label
                )
        ax.set(
            xlabel=f"{title} (ms)", ylabel="share of requests", title=f"{title} CDF", ylim=(0, 1.01)
        )
        ax.legend()
    return fig


def _save(fig: plt.Figure, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
