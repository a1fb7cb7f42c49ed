"""Agent sessions against an HTTP server through the official SDKs, as agents drive one.

    report = await run_agents(Target(base_url, api_key, model, "openai"), Workload(), 8, True)

`concurrency` sessions run at once; a session's steps run one after another (its think time
between them), each step streaming through `AsyncOpenAI.chat.completions` (`stream=True`,
usage in the last chunk) or `AsyncAnthropic.messages.stream`. Per request: time to first
token (the first non-empty text), time per output token after it, end-to-end latency, and
the server's usage: prompt, cached and output tokens. The SDKs do not retry (a retry would
hide in the latency): a failed request is recorded by class (`HTTP 429`, `APITimeoutError`)
and ends its session, whose later steps are counted as skipped.

Works against any server that speaks either protocol: `base_url` is the server's root
(`http://127.0.0.1:8000`; a trailing `/v1` is accepted), the OpenAI client gets `<root>/v1`
and the Anthropic client the root, as each SDK expects.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Literal

import anthropic
import openai

from loadtest.agent.progress import LiveProgress
from loadtest.agent.report import AgentReport, RequestRecord
from loadtest.agent.workload import AgentSession, Message, Workload

Protocol = Literal["openai", "anthropic"]
PROTOCOLS: tuple[Protocol, ...] = ("openai", "anthropic")


@dataclass(frozen=True)
class Target:
    base_url: str
    api_key: str
    model: str
    protocol: Protocol = "openai"
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.protocol not in PROTOCOLS:
            raise ValueError(
                f"protocol must be one of {', '.join(PROTOCOLS)}, got {self.protocol!r}"
            )
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must be an http(s) URL, got {self.base_url!r}")

    @property
    def root_url(self) -> str:
        root = self.base_url.rstrip("/")
        return root.removesuffix("/v1")

    def describe(self) -> dict[str, str]:
        """What a report names the target by (never the API key)."""
        return {"base_url": self.root_url, "model": self.model, "protocol": self.protocol}


@dataclass
class _Reply:
    """What one streamed request returned, in the runner's clock."""

    text: str = ""
    first_token_at: float | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    output_tokens: int | None = None
    cache_cause: str | None = None  # usage's kvfabric_cache.cause (kvfabric servers)

    def saw_text(self, delta: str | None) -> None:
        if delta:
            if self.first_token_at is None:
                self.first_token_at = time.perf_counter()
            self.text += delta


# (system prompt, messages, session id)
StepFn = Callable[[str, list[Message], str], Awaitable[_Reply]]


def error_class(exc: BaseException) -> str:
    """`HTTP <status>` for an error answer; `stream error <type>` for an error event once the
    stream had begun (the SDKs raise those with the stream's own 200 response); else the
    exception's type (`APIConnectionError`, `APITimeoutError`, ...)."""
    if isinstance(exc, openai.APIStatusError | anthropic.APIStatusError) and exc.status_code >= 400:
        return f"HTTP {exc.status_code}"
    if isinstance(exc, openai.APIConnectionError | anthropic.APIConnectionError):
        return type(exc).__name__
    if isinstance(exc, openai.APIError | anthropic.APIError):
        body = exc.body
        inner = body.get("error", body) if isinstance(body, dict) else None
        kind = inner.get("type") if isinstance(inner, dict) else None
        return f"stream error {kind if isinstance(kind, str) else 'of no type'}"
    return type(exc).__name__


class TargetUnreachable(RuntimeError):
    """The first request failed: the message says to where and the server's answer."""


async def run_agents(
    target: Target, workload: Workload, concurrency: int, progress: bool = False
) -> AgentReport:
    """Every session of `workload` against `target`, `concurrency` at once.

    One short request goes first, untimed: the SDKs build their response models on first
    use (a few hundred ms of CPU that would land on whichever requests came first), and a
    wrong URL, key or model fails here with the server's answer instead of as N errors."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    step, close = _client(target, workload)
    try:
        await _warm_up(step, target)
        return await _sessions(step, target, workload, concurrency, progress)
    finally:
        await close()


async def _warm_up(step: StepFn, target: Target) -> None:
    try:
        await step("You are terse.", [Message("user", "Say hi.")], "warm-up")
    except Exception as exc:
        raise TargetUnreachable(
            f"the first request to {target.root_url} ({target.protocol}, model {target.model}) "
            f"failed: {error_class(exc)}: {exc}"
        ) from exc


async def _sessions(
    step: StepFn, target: Target, workload: Workload, concurrency: int, progress: bool
) -> AgentReport:
    records: list[RequestRecord] = []
    num_skipped = 0
    slots = asyncio.Semaphore(concurrency)
    live = LiveProgress(workload.num_requests, enabled=progress)
    started = time.perf_counter()

    async def one_session(session: AgentSession) -> None:
        nonlocal num_skipped
        async with slots:
            answers: list[str] = []
            for index in range(session.num_steps):
                if index:
                    await asyncio.sleep(workload.think_time_s)
                record, text = await _timed(step, session, answers, started, workload.seed)
                records.append(record)
                live.add(record)
                if record.error is not None:  # an agent cannot go on without the answer
                    num_skipped += session.num_steps - index - 1
                    live.skip(session.num_steps - index - 1)
                    return
                answers.append(text)

    with live:
        await asyncio.gather(*(one_session(s) for s in workload.sessions()))
    return AgentReport(
        target=target.describe(),
        workload=workload.to_dict(),
        concurrency=concurrency,
        wall_s=time.perf_counter() - started,
        records=sorted(records, key=lambda r: (r.session, r.step)),
        num_skipped=num_skipped,
    )


async def _timed(
    step: StepFn, session: AgentSession, answers: list[str], started: float, seed: int
) -> tuple[RequestRecord, str]:
    sent = time.perf_counter()
    index = len(answers)
    session_id = f"agent-{seed}-{session.index}"
    try:
        reply = await step(session.system_for(index), session.messages(answers), session_id)
    except Exception as exc:  # recorded by class; the report counts them
        e2e = time.perf_counter() - sent
        return RequestRecord(session.index, index, sent - started, e2e, error=error_class(exc)), ""
    done = time.perf_counter()
    ttft = None if reply.first_token_at is None else reply.first_token_at - sent
    tpot = None
    if reply.first_token_at is not None and (reply.output_tokens or 0) > 1:
        tpot = (done - reply.first_token_at) / (reply.output_tokens - 1)
    record = RequestRecord(
        session=session.index,
        step=index,
        started_s=sent - started,
        e2e_s=done - sent,
        ttft_s=ttft,
        tpot_s=tpot,
        prompt_tokens=reply.prompt_tokens,
        cached_tokens=reply.cached_tokens,
        output_tokens=reply.output_tokens,
        cache_cause=reply.cache_cause,
    )
    return record, reply.text


def _client(target: Target, workload: Workload) -> tuple[StepFn, Callable[[], Awaitable[None]]]:
    """The step function of `target`'s protocol and the coroutine function that closes it."""
    if target.protocol == "openai":
        oai = openai.AsyncOpenAI(
            base_url=f"{target.root_url}/v1",
            api_key=target.api_key,
            max_retries=0,
            timeout=target.timeout_s,
        )

        async def openai_step(system: str, messages: list[Message], session: str) -> _Reply:
            reply = _Reply()
            stream = await oai.chat.completions.create(
                model=target.model,
                messages=[{"role": "system", "content": system}]
                + [{"role": m.role, "content": m.content} for m in messages],
                max_tokens=workload.max_output_tokens,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_headers={"x-session-id": session},
            )
            async for chunk in stream:
                if chunk.choices:
                    reply.saw_text(chunk.choices[0].delta.content)
                if chunk.usage is not None:
                    details = chunk.usage.prompt_tokens_details
                    reply.prompt_tokens = chunk.usage.prompt_tokens
                    reply.cached_tokens = details.cached_tokens if details else None
                    reply.output_tokens = chunk.usage.completion_tokens
                    reply.cache_cause = _cause(chunk.usage.model_extra or {})
            return reply

        return openai_step, oai.close

    ant = anthropic.AsyncAnthropic(
        base_url=target.root_url, api_key=target.api_key, max_retries=0, timeout=target.timeout_s
    )

    async def anthropic_step(system: str, messages: list[Message], session: str) -> _Reply:
        reply = _Reply()
        async with ant.messages.stream(
            model=target.model,
            system=system,
            metadata={"user_id": session},
            messages=[{"role": m.role, "content": m.content} for m in messages],
            max_tokens=workload.max_output_tokens,
            extra_body={"temperature": 0},  # this SDK's signature no longer names it
        ) as stream:
            async for event in stream:
                if event.type == "text":
                    reply.saw_text(event.text)
            usage = (await stream.get_final_message()).usage
        # Anthropic's input fields are disjoint: uncached, read from the cache, written to it.
        read = usage.cache_read_input_tokens or 0
        reply.prompt_tokens = usage.input_tokens + read + (usage.cache_creation_input_tokens or 0)
        reply.cached_tokens = usage.cache_read_input_tokens
        reply.output_tokens = usage.output_tokens
        reply.cache_cause = _cause(usage.model_extra or {})
        return reply

    return anthropic_step, ant.close


def _cause(extra: dict) -> str | None:
    """The cache-miss cause a kvfabric server adds to the usage (`kvfabric_cache`)."""
    cache = extra.get("kvfabric_cache")
    return cache.get("cause") if isinstance(cache, dict) else None
