"""The named tools an agent's step ends in, and how long each runs before the next step.

A tool's duration is lognormal: positive, right-skewed, its spread a factor rather than a
number of seconds (a test suite takes 2x longer, not 60 s longer), the usual model of task
times. The medians are assumptions, not measurements (no trace of tool timings is at hand):
reads, searches and edits return within seconds; a test run and a build take minutes, their
medians past the 180 s a sliding-window snapshot lives in swa-memcache.

Two levels of spread: each session draws its own median for a tool around the tool's
(`sigma_session`: repositories differ), then each call around the session's (`sigma_call`:
the same suite runs about as long each time). That a session's own calls spread less than
all sessions' is what a wait learned per session (services/ingress/staging.py) can use.

`time_scale` compresses the durations for a benchmark: 1/30 turns a 240 s test run into 8 s.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from loadtest.agent import texts


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameter: str  # its one (string) argument
    median_s: float  # over all sessions
    sigma_session: float  # of log(a session's median) around log(median_s)
    sigma_call: float  # of log(a call's duration) around log(the session's median)
    weight: float  # how often agents call it, relative to the others
    result: Callable[[random.Random, int], str]  # what it returns, about N tokens

    def schema(self) -> dict[str, Any]:
        """The tool as an OpenAI Chat Completions `tools` entry."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": {
                    "type": "object",
                    "properties": {self.parameter: {"type": "string"}},
                    "required": [self.parameter],
                },
            },
        }


def build_output(rng: random.Random, num_tokens: int) -> str:
    """A build's log: compile steps, then warnings."""
    targets: list[str] = []

    def step() -> list[str]:
        targets.append(texts.module_path(rng).replace(".py", ".o"))
        share = min(99, len(targets) * rng.randint(1, 4))
        return [f"[{share:3d}%] Building C object {targets[-1]}"]

    return texts.fill(num_tokens, texts.TESTS, step, "$ make -j8 build")


def read_output(rng: random.Random, num_tokens: int) -> str:
    return texts.code_listing(rng, num_tokens, texts.module_path(rng))


TOOLS: tuple[Tool, ...] = (
    Tool("read_file", "Read a file.", "path", 0.3, 0.5, 0.3, 0.30, read_output),
    Tool("grep", "Search the tree.", "pattern", 1.5, 0.6, 0.4, 0.20, texts.grep_output),
    Tool("edit", "Change a file.", "patch", 0.5, 0.5, 0.3, 0.20, texts.diff_output),
    Tool("run_tests", "Run the tests.", "target", 240.0, 0.6, 0.25, 0.20, texts.test_output),
    Tool("build", "Build the project.", "target", 420.0, 0.5, 0.2, 0.10, build_output),
)
BY_NAME = {t.name: t for t in TOOLS}


@dataclass(frozen=True)
class ToolCall:
    tool: str  # a name in TOOLS
    duration_s: float  # as the tool ran (not scaled)


def session_medians(rng: random.Random, tools: tuple[Tool, ...] = TOOLS) -> dict[str, float]:
    """One session's median duration per tool (its repository's)."""
    return {t.name: t.median_s * math.exp(rng.gauss(0.0, t.sigma_session)) for t in tools}


def plan_calls(
    rng: random.Random, num_calls: int, tools: tuple[Tool, ...] = TOOLS
) -> tuple[ToolCall, ...]:
    """A session's calls in order: each tool picked by weight, each duration drawn around
    the session's median for it."""
    medians = session_medians(rng, tools)
    weights = [t.weight for t in tools]
    picked = rng.choices(tools, weights=weights, k=num_calls)
    return tuple(
        ToolCall(t.name, medians[t.name] * math.exp(rng.gauss(0.0, t.sigma_call))) for t in picked
    )
