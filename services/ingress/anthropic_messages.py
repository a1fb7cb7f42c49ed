"""Anthropic Messages: `POST /v1/messages` and `POST /v1/messages/count_tokens`
(docs/design.md, 'HTTP APIs').

Streams follow AN-S-01..10: every frame has its `event:` line; one `message_start` first,
carrying the input accounting known then (the router's estimate of the cached tokens); blocks
opened, filled with deltas of their own type and closed in order, indices 0, 1, 2...;
`partial_json` fragments that always form a valid JSON prefix (the tool parser guarantees
it); one `message_delta` with the stop reason and the final usage, which repeats the input
fields with decode's real count (the SDK overwrites its snapshot with them); `message_stop`.

Usage splits the prompt into disjoint parts (AN-U-01): `input_tokens` = computed and not
pinned, `cache_read_input_tokens` = read from the KV store, `cache_creation_input_tokens` =
computed and written under a `cache_control` pin (the prefix cache is automatic: without a
breakpoint it is 0, and what is written is not billed apart).
"""

from __future__ import annotations

import json
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
from shared.tokenizer.chat import Chat, Message, Tool, ToolCall, canonical_json

STOP_REASON = {
    "stop": "end_turn",
    "stop_sequence": "stop_sequence",
    "length": "max_tokens",
    "tool_calls": "tool_use",
    "cancelled": "end_turn",
}


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class Block(_Open):
    # Declared in the OpenAPI document; the handlers say which role may send which.
    type: str = Field(json_schema_extra={"enum": ["text", "tool_use", "tool_result"]})
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None
    content: str | list[dict[str, Any]] | None = None
    is_error: bool | None = None


class SystemBlock(_Open):
    type: str = Field(json_schema_extra={"enum": ["text"]})
    text: str | None = None


class AnthropicMessage(_Open):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class AnthropicTool(_Open):
    name: str = Field(json_schema_extra={"pattern": "^[a-zA-Z0-9_.-]{1,64}$"})
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=dict)


class AnthropicToolChoice(_Open):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class CountTokensRequest(_Open):
    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[SystemBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=1, le=2**31 - 1)
    stream: bool = False
    metadata: dict[str, Any] | None = None
    # kvfabric's (as vLLM's): a namespace of its own inside the account's cache, where
    # this request's prefix hits only requests with the same salt (docs/security.md)
    cache_salt: str | None = Field(default=None, pattern=r"^[\x21-\x7e]{1,128}$")


def to_chat(body: CountTokensRequest) -> Chat:
    return chat_and_breakpoints(body)[0]


def chat_and_breakpoints(body: CountTokensRequest) -> tuple[Chat, tuple[tuple[int, int], ...]]:
    """The chat, and its `cache_control` breakpoints as (chat message index, ttl_s): a
    breakpoint on a tool or the system prompt pins through the chat's first message (the
    system prompt, where the templates render the tools), on a message's block through the
    last chat message that message became."""
    messages: list[Message] = []
    found: list[tuple[int, int, str]] = []
    for i, tool in enumerate(body.tools or ()):
        if (control := cache_control_of(tool)) is not None:
            found.append((0, pin_ttl_s(control, f"tools[{i}].cache_control"), f"tools[{i}]"))
    if isinstance(body.system, list):
        for i, block in enumerate(body.system):
            if (control := cache_control_of(block)) is not None:
                where = f"system[{i}].cache_control"
                found.append((0, pin_ttl_s(control, where), where))
    if body.system:
        system = (
            body.system
            if isinstance(body.system, str)
            else text_of([b.model_dump() for b in body.system], "system")
        )
        messages.append(Message("system", system))
    names: dict[str, str] = {}
    for i, m in enumerate(body.messages):
        where = f"messages[{i}]"
        if isinstance(m.content, str):
            messages.append(Message(m.role, m.content))
            continue
        texts, calls = [], []
        controls = []
        for j, block in enumerate(m.content):
            if (control := cache_control_of(block)) is not None:
                where_control = f"{where}.content[{j}].cache_control"
                controls.append((pin_ttl_s(control, where_control), where_control))
            if block.type == "text":
                texts.append(block.text or "")
            elif block.type == "tool_use" and m.role == "assistant":
                if not block.id or not block.name:
                    raise invalid(f"{where}.content[{j}]: tool_use needs id and name", where)
                names[block.id] = block.name
                calls.append(ToolCall(block.id, block.name, canonical_json(block.input or {})))
            elif block.type == "tool_result" and m.role == "user":
                if not block.tool_use_id:
                    raise invalid(f"{where}.content[{j}]: tool_result needs tool_use_id", where)
                result = (
                    block.content
                    if isinstance(block.content, str)
                    else text_of(block.content, f"{where}.content[{j}]")
                )
                messages.append(
                    Message(
                        "tool",
                        result,
                        tool_call_id=block.tool_use_id,
                        name=names.get(block.tool_use_id, ""),
                    )
                )
            elif block.type in ("thinking", "redacted_thinking"):
                continue  # earlier reasoning is not rendered back (the templates drop it)
            else:
                raise invalid(
                    f"{where}.content[{j}]: blocks of type {block.type!r} are not "
                    f"supported in {m.role} messages",
                    where,
                )
        if texts or calls:
            messages.append(Message(m.role, "".join(texts), tuple(calls)))
        if messages:  # a breakpoint pins through what this message became
            found += [(len(messages) - 1, ttl, where_control) for ttl, where_control in controls]
    tools = tuple(Tool(t.name, t.description or "", t.input_schema) for t in body.tools or ())
    choice, parallel = None, True
    if body.tool_choice is not None:
        kind = body.tool_choice.type
        choice = {"any": "required", "tool": {"name": body.tool_choice.name or ""}}.get(kind, kind)
        parallel = not body.tool_choice.disable_parallel_tool_use
    chat = Chat(tuple(messages), tools, tool_choice_of(choice, tools), parallel)
    return chat, checked_breakpoints(found)


def to_completion(body: MessagesRequest, api_key_id: str) -> Completion:
    chat, breakpoints = chat_and_breakpoints(body)
    return Completion(
        model=body.model,
        chat=chat,
        breakpoints=breakpoints,
        max_tokens=body.max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=body.top_p or 1.0,
        top_k=body.top_k,
        stop=tuple(s for s in body.stop_sequences or () if s),
        api_key_id=api_key_id,
        tool_id_prefix="toolu_",
    )


def usage_json(usage: Usage) -> dict[str, Any]:
    body: dict[str, Any] = {
        "input_tokens": usage.miss_tokens - usage.cache_write_tokens,
        "cache_creation_input_tokens": usage.cache_write_tokens,
        "cache_read_input_tokens": usage.cached_tokens,
        "output_tokens": usage.output_tokens,
        "prompt_cache_hit_tokens": usage.cached_tokens,
        "prompt_cache_miss_tokens": usage.miss_tokens,
    }
    if usage.cache is not None:  # why the prompt missed past the cached tokens
        body["kvfabric_cache"] = usage.cache.as_json()
    return body


def _tool_input(arguments: str) -> dict[str, Any] | None:
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def response(
    body: MessagesRequest, events: list[Any], finished: Finished, request_id: str
) -> dict[str, Any]:
    content: list[dict[str, Any]] = []
    begins: dict[int, ToolCallBegin] = {}
    for e in events:
        if isinstance(e, TextDelta) and e.text:
            if content and content[-1]["type"] == "text":
                content[-1]["text"] += e.text
            else:
                content.append({"type": "text", "text": e.text})
        elif isinstance(e, ToolCallBegin):
            begins[e.index] = e
        elif isinstance(e, ToolCallEnd):
            begin = begins[e.index]
            value = _tool_input(e.arguments)
            if value is None:  # not a JSON object: what the model wrote goes out as text
                content.append({"type": "text", "text": e.arguments})
            else:
                content.append(
                    {"type": "tool_use", "id": begin.id, "name": begin.name, "input": value}
                )
    return {
        "id": f"msg_{request_id}",
        "type": "message",
        "role": "assistant",
        "model": body.model,
        "content": content,
        "stop_reason": STOP_REASON[finished.reason],
        "stop_sequence": finished.stop_sequence,
        "usage": usage_json(finished.usage),
    }


async def stream(
    body: MessagesRequest, generation: Generation, request_id: str
) -> AsyncIterator[bytes]:
    prompt = generation.prepared.num_prompt_tokens
    estimate = min(generation.num_cached_estimate, prompt)
    yield sse.event(
        "message_start",
        {
            "type": "message_start",
            "message": {
                "id": f"msg_{request_id}",
                "type": "message",
                "role": "assistant",
                "model": body.model,
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": usage_json(Usage(prompt, estimate, 0)),
            },
        },
    )
    yield sse.event("ping", {"type": "ping"})
    index, open_kind = -1, None  # the block being written: "text" / "tool_use" / None
    sent: dict[int, int] = {}  # call index -> argument chars sent

    def start(kind: str, block: dict[str, Any]) -> bytes:
        nonlocal index, open_kind
        index, open_kind = index + 1, kind
        return sse.event(
            "content_block_start",
            {"type": "content_block_start", "index": index, "content_block": block},
        )

    def stop() -> bytes:
        nonlocal open_kind
        open_kind = None
        return sse.event("content_block_stop", {"type": "content_block_stop", "index": index})

    def delta(payload: dict[str, Any]) -> bytes:
        return sse.event(
            "content_block_delta", {"type": "content_block_delta", "index": index, "delta": payload}
        )

    try:
        while (event := await generation.next()) is not None:
            if event is KEEPALIVE:
                yield sse.event("ping", {"type": "ping"})
            elif isinstance(event, TextDelta) and event.text:
                if open_kind != "text":
                    if open_kind is not None:
                        yield stop()
                    yield start("text", {"type": "text", "text": ""})
                yield delta({"type": "text_delta", "text": event.text})
            elif isinstance(event, ToolCallBegin):
                if open_kind is not None:
                    yield stop()
                sent[event.index] = 0
                yield start(
                    "tool_use",
                    {"type": "tool_use", "id": event.id, "name": event.name, "input": {}},
                )
            elif isinstance(event, ToolCallDelta) and event.arguments:
                sent[event.index] = sent.get(event.index, 0) + len(event.arguments)
                yield delta({"type": "input_json_delta", "partial_json": event.arguments})
            elif isinstance(event, ToolCallEnd):
                # Past the last valid JSON prefix nothing more is sent (AN-S-05).
                if open_kind is not None:
                    yield stop()
            elif isinstance(event, Finished):
                if open_kind is not None:
                    yield stop()
                yield sse.event(
                    "message_delta",
                    {
                        "type": "message_delta",
                        "delta": {
                            "stop_reason": STOP_REASON[event.reason],
                            "stop_sequence": event.stop_sequence,
                        },
                        "usage": usage_json(event.usage),
                    },
                )
                yield sse.event("message_stop", {"type": "message_stop"})
    except ApiError as exc:
        yield sse.event("error", exc.anthropic_body(request_id))
