"""OpenAI Chat Completions: `POST /v1/chat/completions` (docs/design.md, 'HTTP APIs').

The request becomes a protocol-neutral `Completion`; the events of its generations become
either one `chat.completion` or a stream of `chat.completion.chunk`s in the order the SDK's
stream helper expects: the role first, text and tool-call deltas (id, type and name only in
a call's first delta, OC-S-04), the finish reason in a chunk of its own, an optional usage
chunk, `[DONE]`. `n` > 1 runs that many generations side by side (choice indices 0..n-1).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from services.ingress import sse
from services.ingress.errors import ApiError, invalid
from services.ingress.pipeline import (
    KEEPALIVE,
    Completion,
    Finished,
    Generation,
    TextDelta,
    ToolCallBegin,
    ToolCallDelta,
    ToolCallEnd,
    Usage,
)
from services.ingress.protocol import (
    cache_control_of,
    checked_breakpoints,
    pin_ttl_s,
    text_of,
    tool_choice_of,
)
from shared.tokenizer.chat import Chat, Message, Tool, ToolCall

FINISH = {
    "stop": "stop",
    "stop_sequence": "stop",
    "length": "length",
    "tool_calls": "tool_calls",
    "cancelled": "stop",
}
FINGERPRINT = "fp_kvfabric"


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


# What the handlers accept, declared in the OpenAPI document (json_schema_extra) while the
# handlers keep their own, clearer, error messages for the rest.
TEXT_ONLY = {"enum": ["text"]}  # the served models read text only
TOOL_NAME = {"pattern": "^[a-zA-Z0-9_.-]{1,64}$"}


class ContentPart(_Open):
    type: str = Field(json_schema_extra=TEXT_ONLY)
    text: str | None = None


class FunctionSpec(_Open):
    name: str = Field(json_schema_extra=TOOL_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(_Open):
    type: Literal["function"] = "function"
    function: FunctionSpec


class FunctionCall(_Open):
    name: str
    arguments: str


class ChatToolCall(_Open):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Open):
    # A tool message names the call it answers.
    model_config = ConfigDict(
        extra="allow",
        json_schema_extra={
            "if": {"properties": {"role": {"const": "tool"}}},
            "then": {
                "required": ["tool_call_id"],
                "properties": {"tool_call_id": {"type": "string"}},
            },
        },
    )

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[ChatToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class NamedFunction(_Open):
    name: str


class NamedToolChoice(_Open):
    type: Literal["function"] = "function"
    function: NamedFunction


class StreamOptions(_Open):
    include_usage: bool = False


class ChatCompletionRequest(_Open):
    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    max_completion_tokens: int | None = Field(default=None, ge=1)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=8)
    seed: int | None = Field(default=None, ge=-(2**63), le=2**64 - 1)  # what MessagePack carries
    user: str | None = None
    # kvfabric's (as vLLM's): a namespace of its own inside the account's cache, where
    # this request's prefix hits only requests with the same salt (docs/security.md)
    cache_salt: str | None = Field(default=None, pattern=r"^[\x21-\x7e]{1,128}$")


def to_completion(body: ChatCompletionRequest, api_key_id: str) -> Completion:
    messages, names = [], {}
    found: list[tuple[int, int, str]] = []
    for i, m in enumerate(body.messages):
        where = f"messages[{i}]"
        # A breakpoint (cache_control, as Anthropic's) on the message or one of its parts.
        parts = m.content if isinstance(m.content, list) else []
        for place, item in [
            (where, m),
            *((f"{where}.content[{j}]", p) for j, p in enumerate(parts)),
        ]:
            if (control := cache_control_of(item)) is not None:
                found.append((i, pin_ttl_s(control, f"{place}.cache_control"), place))
        if m.role in ("system", "developer"):
            messages.append(Message("system", text_of(m.content, where)))
        elif m.role == "user":
            messages.append(Message("user", text_of(m.content, where)))
        elif m.role == "assistant":
            calls = tuple(
                ToolCall(c.id, c.function.name, c.function.arguments) for c in m.tool_calls or ()
            )
            names.update({c.id: c.name for c in calls})
            messages.append(Message("assistant", text_of(m.content, where), calls))
        else:
            if not m.tool_call_id:
                raise invalid(
                    f"{where}: a tool message needs tool_call_id", f"{where}.tool_call_id"
                )
            name = m.name or names.get(m.tool_call_id, "")
            messages.append(
                Message("tool", text_of(m.content, where), tool_call_id=m.tool_call_id, name=name)
            )
    tools = tuple(
        Tool(t.function.name, t.function.description or "", t.function.parameters or {})
        for t in body.tools or ()
    )
    choice = body.tool_choice
    if isinstance(choice, NamedToolChoice):
        choice = {"type": "function", "name": choice.function.name}
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    if len(stop) > 4:
        raise invalid("at most 4 stop sequences", "stop")
    chat = Chat(
        tuple(messages),
        tools,
        tool_choice_of(choice, tools),
        parallel_tool_calls=body.parallel_tool_calls is not False,
    )
    return Completion(
        model=body.model,
        chat=chat,
        max_tokens=body.max_completion_tokens or body.max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=body.top_p or 1.0,
        seed=body.seed,
        stop=tuple(s for s in stop if s),
        api_key_id=api_key_id,
        breakpoints=checked_breakpoints(found),
    )


def usage_json(usage: Usage, num_output: int | None = None) -> dict[str, Any]:
    output = usage.output_tokens if num_output is None else num_output
    body: dict[str, Any] = {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": output,
        "total_tokens": usage.prompt_tokens + output,
        "prompt_tokens_details": {
            "cached_tokens": usage.cached_tokens,
            "cache_write_tokens": usage.cache_write_tokens,
        },
        "completion_tokens_details": {"reasoning_tokens": 0},
        # DeepSeek's split of the prompt: read from the cache, computed.
        "prompt_cache_hit_tokens": usage.cached_tokens,
        "prompt_cache_miss_tokens": usage.miss_tokens,
    }
    if usage.cache is not None:  # why the prompt missed past the cached tokens
        body["kvfabric_cache"] = usage.cache.as_json()
    return body


def combined_usage(finals: list[Finished]) -> Usage:
    """n choices share one prompt: counted once, outputs summed."""
    first = finals[0].usage
    return Usage(
        first.prompt_tokens,
        first.cached_tokens,
        sum(f.usage.output_tokens for f in finals),
        first.cache,
        first.cache_write_tokens,
    )


def response(
    body: ChatCompletionRequest, results: list[tuple[list[Any], Finished]], request_id: str
) -> dict[str, Any]:
    choices = []
    for index, (events, finished) in enumerate(results):
        text = "".join(e.text for e in events if isinstance(e, TextDelta))
        begins = {e.index: e for e in events if isinstance(e, ToolCallBegin)}
        calls = [
            {
                "id": begins[e.index].id,
                "type": "function",
                "function": {"name": begins[e.index].name, "arguments": e.arguments},
            }
            for e in events
            if isinstance(e, ToolCallEnd)
        ]
        message: dict[str, Any] = {
            "role": "assistant",
            "content": text or (None if calls else ""),
            "refusal": None,
        }
        if calls:
            message["tool_calls"] = calls
        choices.append(
            {
                "index": index,
                "message": message,
                "logprobs": None,
                "finish_reason": FINISH[finished.reason],
            }
        )
    return {
        "id": f"chatcmpl-{request_id}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": body.model,
        "system_fingerprint": FINGERPRINT,
        "choices": choices,
        "usage": usage_json(combined_usage([f for _, f in results])),
    }


async def stream(
    body: ChatCompletionRequest, generations: list[Generation], request_id: str
) -> AsyncIterator[bytes]:
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    base = {
        "id": f"chatcmpl-{request_id}",
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": body.model,
        "system_fingerprint": FINGERPRINT,
    }
    extra = {"usage": None} if include_usage else {}

    def chunk(index: int, delta: dict[str, Any], finish: str | None = None) -> bytes:
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
        return sse.data({**base, "choices": [choice], **extra})

    for index in range(len(generations)):  # OC-S-02, OC-S-11: roles first, in order
        yield chunk(index, {"role": "assistant", "content": ""})
    finals: list[Finished] = []
    sent: dict[tuple[int, int], int] = {}  # (choice, call) -> argument chars sent
    try:
        async for index, event in _merged(generations):
            if event is KEEPALIVE:
                yield sse.KEEPALIVE_COMMENT
            elif isinstance(event, TextDelta):
                if event.text:
                    yield chunk(index, {"content": event.text})
            elif isinstance(event, ToolCallBegin):
                sent[index, event.index] = 0
                yield chunk(
                    index,
                    {
                        "tool_calls": [
                            {
                                "index": event.index,
                                "id": event.id,
                                "type": "function",
                                "function": {"name": event.name, "arguments": ""},
                            }
                        ]
                    },
                )
            elif isinstance(event, ToolCallDelta | ToolCallEnd):
                done = sent.get((index, event.index), 0)
                fragment = (
                    event.arguments if isinstance(event, ToolCallDelta) else event.arguments[done:]
                )
                if fragment:
                    sent[index, event.index] = done + len(fragment)
                    call = {"index": event.index, "function": {"arguments": fragment}}
                    yield chunk(index, {"tool_calls": [call]})
            elif isinstance(event, Finished):
                finals.append(event)
                yield chunk(index, {}, FINISH[event.reason])  # OC-S-07
    except ApiError as exc:  # C-06: in band, then close
        yield sse.data(exc.openai_body())
        return
    if include_usage:  # OC-S-08
        yield sse.data({**base, "choices": [], "usage": usage_json(combined_usage(finals))})
    yield sse.DONE


async def _merged(generations: list[Generation]) -> AsyncIterator[tuple[int, Any]]:
    """(choice index, event) from every generation as they come; one generation alone is
    read directly. Keep-alives pass through; an error in any choice ends the stream."""
    if len(generations) == 1:
        while (event := await generations[0].next()) is not None:
            yield 0, event
        return
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

    async def pump(index: int, generation: Generation) -> None:
        try:
            while (event := await generation.next()) is not None:
                if event is not KEEPALIVE:
                    await queue.put((index, event))
        except ApiError as exc:
            await queue.put((index, exc))
        await queue.put((index, None))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(generations)]
    try:
        running = len(tasks)
        while running:
            try:
                index, event = await asyncio.wait_for(
                    queue.get(), generations[0].pipeline.keepalive_s
                )
            except TimeoutError:
                yield 0, KEEPALIVE
                continue
            if event is None:
                running -= 1
            elif isinstance(event, ApiError):
                raise event
            else:
                yield index, event
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
