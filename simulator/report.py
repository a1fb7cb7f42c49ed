"""What a run measures: per window of simulated time, and the ledger of the whole run that
the conservation checks read."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class Window:
    index: int
    start_s: float
    end_s: float
    num_arrived: int = 0  # requests whose first try came in this window
    num_routed: int = 0
    num_refused: int = 0  # gave up after waiting out OVERLOADED, or refused outright
    num_rejections: int = 0  # OVERLOADED answers (a request may get several)
    num_prompt_tokens: int = 0  # of the requests routed in this window
    num_hit_tokens: int = 0
    num_local_hit_tokens: int = 0  # of the hit, from the prefill node's own memory
    num_replayed_tokens: int = 0  # the window rebuilt without a snapshot
    prefill_busy_s: float = 0.0  # GPU-seconds computing, within the window
    num_output_tokens: float = 0.0  # decoded within the window
    store_read_bytes: int = 0
    ttft_s: list[float] = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_prompt_tokens if self.num_prompt_tokens else 0.0

    def percentile_ttft_s(self, q: float) -> float | None:
        """None when no request of the window reached its first token."""
        return float(np.percentile(self.ttft_s, q)) if self.ttft_s else None

    @classmethod
    def merged(cls, windows: list[Window]) -> Window:
        """One window spanning `windows` (consecutive), their counts summed."""
        total = cls(-1, windows[0].start_s, windows[-1].end_s)
        for window in windows:
            for name, value in vars(window).items():
                if name not in ("index", "start_s", "end_s"):
                    setattr(total, name, getattr(total, name) + value)
        return total

    def summary(self, num_prefill_gpus: int, num_decode_gpus: int, decode_rate: float) -> dict:
        span_s = self.end_s - self.start_s
        return {
            "window": self.index,
            "start_s": self.start_s,
            "end_s": self.end_s,
            "requests": self.num_routed,
            "arrived": self.num_arrived,
            "refused": self.num_refused,
            "rejections": self.num_rejections,
            "hit_rate": self.hit_rate,
            "local_hit_share": self.num_local_hit_tokens / max(self.num_hit_tokens, 1),
            "ttft_p50_s": self.percentile_ttft_s(50),
            "ttft_p99_s": self.percentile_ttft_s(99),
            "prefill_util": self.prefill_busy_s / (num_prefill_gpus * span_s),
            "decode_util": self.num_output_tokens / (num_decode_gpus * decode_rate * span_s),
            "input_tokens_per_s": self.num_prompt_tokens / span_s,
            "output_tokens_per_s": self.num_output_tokens / span_s,
            "store_read_gb_per_s": self.store_read_bytes / span_s / 1e9,
        }


@dataclass
class Ledger:
    """Every request and token of a run, for the conservation checks."""

    num_issued: int = 0  # requests sent by sessions (first tries)
    num_finished: int = 0
    num_refused: int = 0
    num_issued_prompt_tokens: int = 0
    num_finished_prompt_tokens: int = 0
    num_refused_prompt_tokens: int = 0
    num_hit_tokens: int = 0  # of the finished requests' prompts: read back
    num_computed_tokens: int = 0  # of the finished requests' prompts: computed
    num_requested_output_tokens: int = 0  # of the finished requests
    num_decoded_tokens: float = 0.0  # integrated over the decode GPUs' batches
    num_sessions: int = 0
    num_steps_cut: int = 0  # session steps not issued: the run's arrivals had stopped


class Windows:
    """Windows by index, made as time reaches them; spans split across their borders."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.by_index: dict[int, Window] = {}

    def at(self, t_s: float) -> Window:
        index = int(t_s // self.window_s)
        window = self.by_index.get(index)
        if window is None:
            start = index * self.window_s
            window = self.by_index[index] = Window(index, start, start + self.window_s)
        return window

    def spread(self, start_s: float, end_s: float, per_s: float, attr: str) -> None:
        """Add `per_s` x the time of [start_s, end_s) within each window to `attr`."""
        t = start_s
        while t < end_s:
            window = self.at(t)
            until = min(end_s, window.end_s)
            setattr(window, attr, getattr(window, attr) + per_s * (until - t))
            t = until

    def ordered(self) -> list[Window]:
        return [self.by_index[i] for i in sorted(self.by_index)]
