"""Agent sessions whose every step is a call of a named tool, through the official `openai`
SDK: the step forces the call the workload planned (`Workload(named_tools=True)`: a named
`tool_choice`), the agent waits the tool's (scaled) duration, then sends the next step with
the model's call and the tool's result appended, as an agent harness does.

    turns = await ToolAgents(client, model, "run-a").run(workload.sessions())

A turn records what the client saw (the whole answer's time, usage, finish reason) and the
response's `x-trace-id`, so a benchmark can add the server's own timings from the trace: a
forced call's first chunk (its opening) is the server's, sent at once, and the model's first
tokens are held until the arguments parse, so the client cannot time the first token.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import openai

from loadtest.agent.tools import TOOLS
from loadtest.agent.workload import AgentSession


@dataclass(frozen=True)
class Turn:
    """One step of one session."""

    session: int
    step: int
    after_tool: str | None  # the tool whose result it carries (None: the first step)
    sent_s: float  # since the run began
    trace_id: str = ""
    call_s: float | None = None  # the whole answer, as the client waited for it
    prompt_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None
    # From the server's trace, when a benchmark adds them: its TTFT, and its cached prefix's
    # load into the prefill worker's pool (None: nothing cached) and where its blocks were.
    ttft_ms: float | None = None
    load_ms: float | None = None
    num_pool_blocks: int = 0
    num_host_blocks: int = 0
    num_store_blocks: int = 0


@dataclass
class ToolAgents:
    client: openai.AsyncOpenAI
    model: str
    name: str  # of the run: in session ids and the cache salt, so runs cache apart
    max_tokens: int = 64
    stop: tuple[str, ...] = ()  # where the model's call ends, for one that runs on past it
    spread_s: float = 0.0  # sessions start evenly over this
    # Requests in flight at most (0: no limit); a turn waits for its slot before it is sent.
    concurrency: int = 0
    say: Callable[[str], None] | None = None  # progress, every 10 s
    turns: list[Turn] = field(default_factory=list)  # as they end
    started: float = 0.0
    _slots: asyncio.Semaphore = field(default_factory=asyncio.Semaphore, repr=False)

    async def run(self, sessions: list[AgentSession]) -> list[Turn]:
        self.started = time.perf_counter()
        self._slots = asyncio.Semaphore(self.concurrency or sum(s.num_steps for s in sessions))
        spacing = self.spread_s / max(len(sessions), 1)

        async def one(session: AgentSession) -> None:
            await asyncio.sleep(session.index * spacing)
            await self.session(session)

        async def progress(say: Callable[[str], None]) -> None:
            total = sum(s.num_steps for s in sessions)
            while True:
                await asyncio.sleep(10)
                elapsed_s = time.perf_counter() - self.started
                say(f"{self.name}: {len(self.turns)}/{total} turns, {elapsed_s:.0f} s")

        reporter = asyncio.create_task(progress(self.say)) if self.say else None
        try:
            await asyncio.gather(*(one(s) for s in sessions))
        finally:
            if reporter is not None:
                reporter.cancel()
        return sorted(self.turns, key=lambda t: (t.session, t.step))

    async def session(self, session: AgentSession) -> None:
        if not session.calls:
            raise ValueError("sessions without named tools (Workload(named_tools=True))")
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": session.system},
            {"role": "user", "content": session.task},
        ]
        for step in range(session.num_steps):
            after = session.calls[step - 1].tool if step else None
            if step:
                await asyncio.sleep(session.wait_s(step - 1))
            async with self._slots:
                turn, answer = await self.turn(session, step, after, messages)
            self.turns.append(turn)
            # An agent cannot go on without the answer; the last call's result never comes.
            if answer is None or step + 1 == session.num_steps:
                return
            messages.append(answer)
            for index, call in enumerate(answer.get("tool_calls", ())):
                result = session.tool_results[step] if index == 0 else "(no output)"
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})

    async def turn(
        self, session: AgentSession, step: int, after: str | None, messages: list[dict[str, Any]]
    ) -> tuple[Turn, dict[str, Any] | None]:
        """One request: the turn, and the assistant message to send back (None: it failed)."""
        sent = time.perf_counter()
        content, calls, reason, usage = "", {}, None, None
        try:
            raw = await self.client.chat.completions.with_raw_response.create(
                model=self.model,
                messages=messages,
                tools=[t.schema() for t in TOOLS],
                tool_choice={"type": "function", "function": {"name": session.calls[step].tool}},
                max_tokens=self.max_tokens,
                temperature=0,
                stop=list(self.stop) if self.stop else openai.NOT_GIVEN,
                stream=True,
                stream_options={"include_usage": True},
                extra_headers={"x-session-id": f"{self.name}-{session.index}"},
                extra_body={"cache_salt": self.name},
            )
            async for chunk in raw.parse():
                usage = chunk.usage or usage
                if not chunk.choices:
                    continue
                choice = chunk.choices[0]
                reason = choice.finish_reason or reason
                content += choice.delta.content or ""
                for part in choice.delta.tool_calls or []:
                    call = calls.setdefault(part.index, {"id": "", "name": "", "arguments": ""})
                    call["id"] = part.id or call["id"]
                    if part.function is not None:
                        call["name"] += part.function.name or ""
                        call["arguments"] += part.function.arguments or ""
        except openai.APIError as exc:
            error = f"{type(exc).__name__}: {exc}"[:300]
            return Turn(session.index, step, after, sent - self.started, error=error), None
        details = usage.prompt_tokens_details if usage else None
        turn = Turn(
            session.index,
            step,
            after,
            sent - self.started,
            trace_id=raw.headers.get("x-trace-id", ""),
            call_s=time.perf_counter() - sent,
            prompt_tokens=usage.prompt_tokens if usage else 0,
            cached_tokens=(details.cached_tokens or 0) if details else 0,
            finish_reason=reason,
        )
        answer: dict[str, Any] = {"role": "assistant", "content": content or None}
        if calls:
            answer["tool_calls"] = [
                {
                    "id": c["id"],
                    "type": "function",
                    "function": {"name": c["name"], "arguments": c["arguments"]},
                }
                for _, c in sorted(calls.items())
            ]
        return turn, answer
