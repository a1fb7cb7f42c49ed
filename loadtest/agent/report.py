"""What an agent run measured: one record per request sent, and the summaries drawn from them.

Percentiles are numpy's (linear interpolation) over the requests that have the value: TTFT
needs a first token, TPOT two output tokens. The cache-hit share is cached / prompt tokens as
the server reported them, summed over answered requests that report both (a server that
reports no cached count has no hit share, rather than a share of 0). Step 0 is every
session's first request (cold but for a shared system prompt); later steps re-send it all.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

QUANTILES = (50, 90, 99)
METRICS = ("ttft_s", "tpot_s", "e2e_s")


@dataclass(frozen=True)
class RequestRecord:
    session: int
    step: int
    started_s: float  # since the run began
    e2e_s: float  # until the stream ended (or the request failed)
    ttft_s: float | None = None  # until the first non-empty text
    tpot_s: float | None = None  # (e2e - ttft) / (output tokens - 1)
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    output_tokens: int | None = None
    error: str | None = None  # `HTTP 429`, `APIConnectionError`, ...; None: answered
    cache_cause: str | None = None  # the server's cache-miss diagnosis, where it gives one


def percentiles(values: Iterable[float | None]) -> dict[str, float | None]:
    """p50/p90/p99 and the mean of the values that are not None (None when there are none)."""
    present = np.array([v for v in values if v is not None], dtype=float)
    keys = [f"p{q}" for q in QUANTILES] + ["mean"]
    if present.size == 0:
        return dict.fromkeys(keys)
    numbers = [*np.percentile(present, QUANTILES), present.mean()]
    return {k: float(v) for k, v in zip(keys, numbers, strict=True)}


def hit_share(records: Iterable[RequestRecord]) -> float | None:
    counted = [
        r for r in records if r.error is None and r.prompt_tokens and r.cached_tokens is not None
    ]
    num_prompt = sum(r.prompt_tokens or 0 for r in counted)
    return sum(r.cached_tokens or 0 for r in counted) / num_prompt if num_prompt else None


def summary(records: list[RequestRecord]) -> dict[str, Any]:
    answered = [r for r in records if r.error is None]
    return {
        "num_requests": len(records),
        "num_answered": len(answered),
        "hit_share": hit_share(answered),
        **{metric: percentiles(getattr(r, metric) for r in answered) for metric in METRICS},
    }


@dataclass
class AgentReport:
    target: dict[str, str]  # base_url, model, protocol
    workload: dict[str, Any]
    concurrency: int
    wall_s: float
    records: list[RequestRecord] = field(default_factory=list)
    num_skipped: int = 0  # steps never sent: their session had failed

    @property
    def answered(self) -> list[RequestRecord]:
        return [r for r in self.records if r.error is None]

    @property
    def errors_by_class(self) -> dict[str, int]:
        return dict(Counter(r.error for r in self.records if r.error is not None).most_common())

    def first_step(self) -> list[RequestRecord]:
        return [r for r in self.records if r.step == 0]

    def later_steps(self) -> list[RequestRecord]:
        return [r for r in self.records if r.step > 0]

    def by_step(self) -> list[dict[str, Any]]:
        """`summary` of each step index, with the step's mean prompt size."""
        out = []
        for step in sorted({r.step for r in self.records}):
            records = [r for r in self.records if r.step == step]
            prompts = [r.prompt_tokens for r in records if r.prompt_tokens is not None]
            mean_prompt = sum(prompts) / len(prompts) if prompts else None
            out.append({"step": step, "mean_prompt_tokens": mean_prompt, **summary(records)})
        return out

    def causes(self) -> dict[str, int]:
        """How many later steps the server diagnosed with each cause (kvfabric_cache)."""
        later = self.later_steps()
        return dict(Counter(r.cache_cause for r in later if r.cache_cause).most_common())

    def throughput(self) -> dict[str, float]:
        """Per second of the whole run: answered requests, prompt and output tokens."""
        answered, wall_s = self.answered, self.wall_s or float("inf")
        return {
            "requests_per_s": len(answered) / wall_s,
            "prompt_tokens_per_s": sum(r.prompt_tokens or 0 for r in answered) / wall_s,
            "output_tokens_per_s": sum(r.output_tokens or 0 for r in answered) / wall_s,
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "workload": self.workload,
            "concurrency": self.concurrency,
            "wall_s": self.wall_s,
            "num_skipped": self.num_skipped,
            "errors_by_class": self.errors_by_class,
            "throughput": self.throughput(),
            "all": summary(self.records),
            "first_step": summary(self.first_step()),
            "later_steps": summary(self.later_steps()),
            "by_step": self.by_step(),
            "cache_causes": self.causes(),
            "records": [asdict(r) for r in self.records],
        }

    def write_json(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: Path) -> AgentReport:
        """A report `write_json` wrote (its records; the summaries are derived again)."""
        data = json.loads(path.read_text())
        return cls(
            target=data["target"],
            workload=data["workload"],
            concurrency=data["concurrency"],
            wall_s=data["wall_s"],
            records=[RequestRecord(**r) for r in data["records"]],
            num_skipped=data["num_skipped"],
        )
