"""The live progress bar of an agent run (rich, on stderr): requests done out of all, errors,
the p50 time to first token so far and the share of prompt tokens the server said it cached.
Off, it keeps the same counts and draws nothing."""

from __future__ import annotations

import bisect
from types import TracebackType

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from loadtest.agent.report import RequestRecord


class LiveProgress:
    def __init__(self, num_requests: int, *, enabled: bool) -> None:
        self.num_errors = 0
        self.num_prompt_tokens = 0
        self.num_cached_tokens = 0
        self._ttfts: list[float] = []  # sorted: the median is an index
        self._progress = (
            Progress(
                TextColumn("agents"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[stats]}"),
                TimeElapsedColumn(),
                console=Console(stderr=True),
            )
            if enabled
            else None
        )
        self._task = (
            self._progress.add_task("agents", total=num_requests, stats=self.stats())
            if self._progress
            else None
        )

    def stats(self) -> str:
        ttft = f"{self._ttfts[len(self._ttfts) // 2] * 1e3:.0f} ms" if self._ttfts else "-"
        hit = (
            f"{self.num_cached_tokens / self.num_prompt_tokens:.0%}"
            if self.num_prompt_tokens
            else "-"
        )
        return f"errors {self.num_errors}  TTFT p50 {ttft}  hit {hit}"

    def add(self, record: RequestRecord) -> None:
        if record.error is not None:
            self.num_errors += 1
        if record.ttft_s is not None:
            bisect.insort(self._ttfts, record.ttft_s)
        if record.prompt_tokens and record.cached_tokens is not None:
            self.num_prompt_tokens += record.prompt_tokens
            self.num_cached_tokens += record.cached_tokens
        self._advance(1)

    def skip(self, num_requests: int) -> None:
        """Requests that will never be sent (their session failed): done, as far as the bar
        is concerned."""
        self._advance(num_requests)

    def _advance(self, num_requests: int) -> None:
        if self._progress is not None and self._task is not None:
            self._progress.update(self._task, advance=num_requests, stats=self.stats())

    def __enter__(self) -> LiveProgress:
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._progress is not None:
            self._progress.stop()
