"""Coding-agent sessions, deterministic under a seed.

A session is what an agent sends step after step: a system prompt, the user's first task (a
request and the file it is about), then for every later step the model's own answer to the
previous one and a tool's result (a file, a test run, a search, a diff). Each step re-sends
the whole conversation, so its prompt is the previous step's prompt plus the answer plus
`growth_tokens_per_step` of new text: everything before the new text was sent already, which
is what a prefix cache turns into hits.

The texts come from `random.Random` seeded with the workload's seed and the session's (and
step's) index, so the same seed gives the same texts and another seed other texts; the
answers are the server's. Coding agents share one system prompt across their sessions
(`shared_system_prompt`, a quarter of the first step's context): a session that starts after
another one sent it hits it on its first step.

`volatile_system` makes the harness one that stamps its system prompt per request, as a
popular one does: a billing header with a fresh nonce on top, the current time at the end
(`AgentSession.system_for`). Everything after the first stamp then misses on every step,
unless the server's prefix guard moves or removes the stamps (services/ingress/stability.py).

`named_tools` makes every step's answer a call of a named tool (`tools.TOOLS`, picked by
weight), its result that tool's kind of text, and the wait before the next step the tool's
duration times `tool_time_scale` (`AgentSession.wait_s`). The last step's call never returns:
the session ends while it runs.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

from loadtest.agent import texts, tools
from loadtest.agent.tools import ToolCall

Role = Literal["user", "assistant"]
SYSTEM_SHARE = 0.25  # of the first step's context; the user's task is the rest


@dataclass(frozen=True)
class Message:
    role: Role
    content: str


@dataclass(frozen=True)
class AgentSession:
    index: int
    system: str
    task: str
    tool_results: tuple[str, ...]  # tool_results[k] follows the answer to step k
    stamps: tuple[str, ...] = ()  # per step: a nonce for the billing header (volatile only)
    calls: tuple[ToolCall, ...] = ()  # per step: the tool its answer calls (named tools only)
    time_scale: float = 1.0  # of the tools' durations, for the waits

    def wait_s(self, step: int) -> float:
        """How long after step `step`'s answer the next step is sent: its tool's duration,
        scaled (0 without named tools)."""
        return self.calls[step].duration_s * self.time_scale if self.calls else 0.0

    def system_for(self, step: int) -> str:
        """The system prompt step `step` sends: stamped per request when volatile."""
        if not self.stamps:
            return self.system
        at = f"2026-12-07T10:{step // 60:02d}:{step % 60:02d}Z"
        return (
            f"x-anthropic-billing-header: cc_version=2.0.14; cch={self.stamps[step]};\n"
            f"{self.system}\nCurrent time: {at}"
        )

    @property
    def num_steps(self) -> int:
        return len(self.tool_results) + 1

    def messages(self, answers: Sequence[str]) -> list[Message]:
        """The conversation of step `len(answers)` (the system prompt apart): the task, then
        each earlier answer followed by the tool result that came back after it."""
        step = len(answers)
        if step >= self.num_steps:
            raise ValueError(f"session {self.index} has {self.num_steps} steps; got {step} answers")
        out = [Message("user", self.task)]
        for answer, result in zip(answers, self.tool_results, strict=False):
            out += [Message("assistant", answer), Message("user", result)]
        return out


@dataclass(frozen=True)
class Workload:
    """What the sessions look like; sizes are in approximate tokens (`texts`)."""

    num_sessions: int = 8
    num_steps: int = 6  # requests per session
    initial_context_tokens: int = 2000  # the first step's system prompt and task
    growth_tokens_per_step: int = 400  # the tool result each later step adds
    max_output_tokens: int = 64
    think_time_s: float = 0.0  # an agent's pause between an answer and its next request
    seed: int = 0
    shared_system_prompt: bool = True
    volatile_system: bool = False  # a harness that stamps each request's system prompt
    named_tools: bool = False  # every answer calls a named tool (tools.TOOLS), which takes time
    tool_time_scale: float = 1.0  # of the tools' durations (a benchmark's compression)

    def __post_init__(self) -> None:
        for name in ("num_sessions", "num_steps", "initial_context_tokens", "max_output_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.growth_tokens_per_step < 0:
            raise ValueError(
                f"growth_tokens_per_step must be >= 0, got {self.growth_tokens_per_step}"
            )
        if self.think_time_s < 0:
            raise ValueError(f"think_time_s must be >= 0, got {self.think_time_s}")
        if self.tool_time_scale <= 0:
            raise ValueError(f"tool_time_scale must be > 0, got {self.tool_time_scale}")

    @property
    def num_requests(self) -> int:
        return self.num_sessions * self.num_steps

    @property
    def max_context_tokens(self) -> int:
        """The last step's prompt and answer, approximately: the context a server must hold."""
        per_step = self.growth_tokens_per_step + self.max_output_tokens
        return (
            self.initial_context_tokens + (self.num_steps - 1) * per_step + self.max_output_tokens
        )

    def session(self, index: int) -> AgentSession:
        if not 0 <= index < self.num_sessions:
            raise ValueError(f"session index {index} is outside 0..{self.num_sessions - 1}")
        system_tokens = max(1, round(self.initial_context_tokens * SYSTEM_SHARE))
        owner = "shared" if self.shared_system_prompt else str(index)
        system = texts.system_prompt(self._rng("system", owner), system_tokens)
        task_tokens = max(1, self.initial_context_tokens - system_tokens)
        task = texts.first_task(self._rng("task", index), task_tokens)
        calls = ()
        if self.named_tools:
            calls = tools.plan_calls(self._rng("calls", index), self.num_steps)
            results = tuple(
                tools.BY_NAME[calls[step].tool].result(
                    self._rng("tool", index, step), self.growth_tokens_per_step
                )
                for step in range(self.num_steps - 1)
            )
        else:
            results = tuple(
                texts.tool_result(self._rng("tool", index, step), self.growth_tokens_per_step)
                for step in range(self.num_steps - 1)
            )
        stamps = ()
        if self.volatile_system:
            rng = self._rng("stamp", index)
            stamps = tuple(f"{rng.getrandbits(64):016x}" for _ in range(self.num_steps))
        return AgentSession(index, system, task, results, stamps, calls, self.tool_time_scale)

    def sessions(self) -> list[AgentSession]:
        return [self.session(i) for i in range(self.num_sessions)]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def _rng(self, *key: object) -> random.Random:
        # A string seed is hashed with SHA-512 by `random`: stable across runs and machines,
        # unlike hash() of a tuple.
        return random.Random(":".join(map(str, (self.seed, *key))))
