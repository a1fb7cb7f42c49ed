"""What a benchmark returns: the figures it measured side by side in one run and the ratios
between them. `kvfabric bench` prints a result and writes it as JSON (`--json`) from the same
object, so the JSON holds every ratio printed.

A benchmark module exposes `run(quick: bool = False, **options) -> BenchResult`; `quick` is
the small size CI runs. A ratio is ours / the peer's measured in the same run (higher is
better unless `lower_is_better`), with the issue's target when there is one.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Ratio:
    name: str  # what is compared: "decode tokens/s, batch 8"
    ours: float
    peer: float
    peer_name: str  # "transformers generate"
    unit: str  # of `ours` and `peer`: "tokens/s"
    target: float | None = None  # a floor for `value` (a ceiling when lower_is_better)
    lower_is_better: bool = False

    @property
    def value(self) -> float:
        return self.ours / self.peer if self.peer else float("inf")

    @property
    def met(self) -> bool | None:
        if self.target is None:
            return None
        return self.value <= self.target if self.lower_is_better else self.value >= self.target

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "value": self.value, "met": self.met}


@dataclass(frozen=True)
class Figure:
    name: str
    value: float
    unit: str
    target: float | None = None  # an absolute target (">= 5,000 records/s")
    lower_is_better: bool = False

    @property
    def met(self) -> bool | None:
        if self.target is None:
            return None
        return self.value <= self.target if self.lower_is_better else self.value >= self.target

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "met": self.met}


def machine() -> dict[str, Any]:
    """Where a result was measured: enough to tell two machines (and a loaded one) apart."""
    return {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "load_average_1m": round(os.getloadavg()[0], 2),
    }


@dataclass
class BenchResult:
    name: str
    quick: bool = False
    ratios: list[Ratio] = field(default_factory=list)
    figures: list[Figure] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    command: str = ""  # what produced it, for the docs (kvfabric bench sets it)
    started_at: str = field(default_factory=lambda: datetime.now(UTC).isoformat(timespec="seconds"))
    _started: float = field(default_factory=time.perf_counter, repr=False)
    duration_s: float = 0.0

    def ratio(
        self,
        name: str,
        ours: float,
        peer: float,
        peer_name: str,
        unit: str,
        target: float | None = None,
        *,
        lower_is_better: bool = False,
    ) -> Ratio:
        ratio = Ratio(name, ours, peer, peer_name, unit, target, lower_is_better)
        self.ratios.append(ratio)
        return ratio

    def figure(
        self,
        name: str,
        value: float,
        unit: str,
        target: float | None = None,
        *,
        lower_is_better: bool = False,
    ) -> Figure:
        figure = Figure(name, value, unit, target, lower_is_better)
        self.figures.append(figure)
        return figure

    def note(self, text: str) -> None:
        self.notes.append(text)

    def finish(self) -> BenchResult:
        self.duration_s = time.perf_counter() - self._started
        return self

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "quick": self.quick,
            "command": self.command,
            "started_at": self.started_at,
            "duration_s": round(self.duration_s, 3),
            "machine": machine(),
            "ratios": [r.to_dict() for r in self.ratios],
            "figures": [f.to_dict() for f in self.figures],
            "notes": self.notes,
        }

    def write_json(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    def lines(self) -> list[str]:
        """The result as printed: every ratio and figure, one line each."""
        out = [f"{self.name}{' (quick)' if self.quick else ''}"]
        for r in self.ratios:
            ours, peer = format_number(r.ours), format_number(r.peer)
            out.append(
                f"  {r.name}: ours {ours} vs {r.peer_name} {peer} {r.unit}"
                f" = {r.value:.2f}x{_target(r.met, r.target, r.lower_is_better, 'x')}"
            )
        for f in self.figures:
            out.append(
                f"  {f.name}: {format_number(f.value)} {f.unit}"
                f"{_target(f.met, f.target, f.lower_is_better, '')}"
            )
        out.extend(f"  note: {n}" for n in self.notes)
        return out

    def print(self) -> None:
        print("\n".join(self.lines()), flush=True)


def format_number(value: float) -> str:
    if value == 0 or abs(value) >= 100 or float(value).is_integer():
        return f"{value:,.0f}"
    if abs(value) >= 1:
        return f"{value:,.2f}"
    return f"{value:.3g}"


def _target(met: bool | None, target: float | None, lower: bool, suffix: str) -> str:
    if met is None or target is None:
        return ""
    bound = "<=" if lower else ">="
    return f" (target {bound} {format_number(target)}{suffix}: {'met' if met else 'NOT met'})"


class OptionError(ValueError):
    """A benchmark option (`--set KEY=VALUE`) the benchmark cannot take."""


class UnknownOption(OptionError):
    """An option the benchmark does not take (the message names those it does)."""


def bench_options(
    defaults: dict[str, Any], options: dict[str, Any], quick: dict[str, Any] | None = None
) -> argparse.Namespace:
    """A benchmark's options: `defaults`, then the `quick` sizes, then what the caller gave
    (`kvfabric bench NAME --set KEY=VALUE`); UnknownOption names an option it does not have."""
    unknown = set(options) - set(defaults)
    if unknown:
        raise UnknownOption(
            f"unknown option(s): {', '.join(sorted(unknown))}; known: {', '.join(sorted(defaults))}"
        )
    return argparse.Namespace(**(defaults | (quick or {}) | options))
