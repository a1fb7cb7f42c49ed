"""OpenAI Responses: `POST /v1/responses`, `GET /v1/responses/{id}` (docs/design.md, 'HTTP
APIs').

One `_Output` builder turns the generation's events into output items and, for a stream, the
typed events with gap-free `sequence_number`s (OR-S-01..07): `response.created` first, items
added, filled and closed one at a time (a message item for text, a function_call item per
call), `response.completed` (or `response.incomplete` at max_output_tokens) holding the whole
response. The non-streaming answer is the same builder's final object, so the two agree.

Stored responses (`store`, default true) live in a JetStream key-value bucket with a TTL
(ResponseStore), so any ingress replica continues a conversation by `previous_response_id`:
the stored context (earlier input and output) comes first, then the new input. `instructions`
are not carried over (as the API documents).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import AsyncIterator, Iterator
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
from services.ingress.protocol import text_of, tool_choice_of
from shared.bus import Bus
from shared.tokenizer.chat import Chat, Message, Tool, ToolCall


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class FunctionTool(_Open):
    type: Literal["function"] = "function"
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesRequest(_Open):
    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    metadata: dict[str, str] | None = None
    # kvfabric's (as vLLM's): a namespace of its own inside the account's cache, where
    # this request's prefix hits only requests with the same salt (docs/security.md)
    cache_salt: str | None = Field(default=None, pattern=r"^[\x21-\x7e]{1,128}$")


# -- the stored context -------------------------------------------------------------------
def _message_json(m: Message) -> dict[str, Any]:
    return {
        "role": m.role,
        "content": m.content,
        "tool_call_id": m.tool_call_id,
        "name": m.name,
        "tool_calls": [[c.id, c.name, c.arguments] for c in m.tool_calls],
    }


def _message_of(d: dict[str, Any]) -> Message:
    calls = tuple(ToolCall(*c) for c in d.get("tool_calls", ()))
    return Message(
        d["role"], d.get("content", ""), calls, d.get("tool_call_id", ""), d.get("name", "")
    )


RESPONSE_ID = re.compile(r"resp_[0-9a-f]{1,64}")


class ResponseStore:
    def __init__(self, bus: Bus, ttl_s: float) -> None:
        self.bus, self.ttl_s = bus, ttl_s
        self.bucket = bus.subjects.responses_bucket

    async def start(self) -> None:
        await self.bus.js.ensure_kv(self.bucket, ttl_s=self.ttl_s)

    async def put(self, response: dict[str, Any], context: list[Message], account: str) -> None:
        record = {
            "response": response,
            "context": [_message_json(m) for m in context],
            "account": account,
        }
        await self.bus.js.kv_put(self.bucket, response["id"], json.dumps(record).encode())

    async def get(
        self, response_id: str, account: str
    ) -> tuple[dict[str, Any], list[Message]] | None:
        """The response and its context, if stored by `account`: another account's is as
        absent as one never stored."""
        if not RESPONSE_ID.fullmatch(response_id):  # not one of ours (nor a valid KV key)
            return None
        raw = await self.bus.js.kv_get(self.bucket, response_id)
        if raw is None:
            return None
        record = json.loads(raw)
        if record.get("account") != account:
            return None
        return record["response"], [_message_of(d) for d in record["context"]]


# -- request -> completion ----------------------------------------------------------------
def input_messages(items: str | list[dict[str, Any]]) -> list[Message]:
    if isinstance(items, str):
        return [Message("user", items)]
    messages: list[Message] = []
    names: dict[str, str] = {}
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise invalid(
                    f"{where}: role {role!r} is not one of user, assistant, system, developer",
                    f"{where}.role",
                )
            text = text_of(item.get("content"), where)
            messages.append(Message("system" if role == "developer" else role, text))
        elif kind == "function_call":
            call_id, name = item.get("call_id"), item.get("name")
            if not call_id or not name or not isinstance(item.get("arguments"), str):
                raise invalid(f"{where}: function_call needs call_id, name and arguments", where)
            names[call_id] = name
            call = ToolCall(call_id, name, item["arguments"])
            if messages and messages[-1].role == "assistant":  # parallel calls: one turn
                last = messages.pop()
                messages.append(Message("assistant", last.content, (*last.tool_calls, call)))
            else:
                messages.append(Message("assistant", "", (call,)))
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not call_id:
                raise invalid(f"{where}: function_call_output needs call_id", where)
            text = output if isinstance(output, str) else text_of(output, where)
            messages.append(
                Message("tool", text, tool_call_id=call_id, name=names.get(call_id, ""))
            )
        elif kind == "reasoning":
            continue  # earlier reasoning is not rendered back
        else:
            raise invalid(f"{where}: items of type {kind!r} are not supported", f"{where}.type")
    return messages


def to_completion(body: ResponsesRequest, prompt: list[Message], api_key_id: str) -> Completion:
    """`prompt`: the stored context (previous_response_id) and this request's input."""
    messages = list(prompt)
    if body.instructions:
        messages.insert(0, Message("system", body.instructions))
    tools = tuple(Tool(t.name, t.description or "", t.parameters or {}) for t in body.tools or ())
    choice = body.tool_choice
    chat = Chat(
        tuple(messages),
        tools,
        tool_choice_of(choice, tools),
        parallel_tool_calls=body.parallel_tool_calls is not False,
    )
    return Completion(
        model=body.model,
        chat=chat,
        max_tokens=body.max_output_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=body.top_p or 1.0,
        api_key_id=api_key_id,
    )


def usage_json(usage: Usage) -> dict[str, Any]:
    body: dict[str, Any] = {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {
            "cached_tokens": usage.cached_tokens,
            "cache_write_tokens": usage.cache_write_tokens,
        },
        "output_tokens": usage.output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.prompt_tokens + usage.output_tokens,
        "prompt_cache_hit_tokens": usage.cached_tokens,
        "prompt_cache_miss_tokens": usage.miss_tokens,
    }
    if usage.cache is not None:  # why the prompt missed past the cached tokens
        body["kvfabric_cache"] = usage.cache.as_json()
    return body


# -- events -> items ----------------------------------------------------------------------
class Output:
    """Builds the response object and its stream events from the generation's events."""

    def __init__(self, body: ResponsesRequest, request_id: str, context: list[Message]) -> None:
        self.body = body
        self.id = f"resp_{request_id}"
        self.request_id = request_id
        self.items: list[dict[str, Any]] = []
        self.sequence_number = 0
        self.created_at = int(time.time())
        self.usage: Usage | None = None
        self.status = "in_progress"
        self.incomplete_reason: str | None = None
        self._open: dict[str, Any] | None = None  # the item being written
        self._calls: dict[int, dict[str, Any]] = {}  # call index -> its item
        self._num_items = 0

    def response(self) -> dict[str, Any]:
        b = self.body
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": self.status,
            "model": b.model,
            "output": list(self.items),
            "parallel_tool_calls": b.parallel_tool_calls is not False,
            "tool_choice": b.tool_choice or "auto",
            "tools": [t.model_dump(exclude_none=True) for t in b.tools or ()],
            "error": None,
            "incomplete_details": (
                {"reason": self.incomplete_reason} if self.incomplete_reason else None
            ),
            "instructions": b.instructions,
            "metadata": b.metadata or {},
            "temperature": b.temperature,
            "top_p": b.top_p,
            "max_output_tokens": b.max_output_tokens,
            "previous_response_id": b.previous_response_id,
            "store": b.store,
            "text": {"format": {"type": "text"}},
            "reasoning": {"effort": None, "summary": None},
            "truncation": "disabled",
            "usage": usage_json(self.usage) if self.usage else None,
        }

    def _event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return sse.event(kind, payload)

    def start(self) -> Iterator[bytes]:
        yield self._event("response.created", response=self.response())
        yield self._event("response.in_progress", response=self.response())

    def take(self, event: Any) -> Iterator[bytes]:
        if isinstance(event, TextDelta) and event.text:
            if self._open is None or self._open["type"] != "message":
                yield from self._close()
                item = {
                    "type": "message",
                    "id": f"msg_{self.request_id}_{self._num_items}",
                    "role": "assistant",
                    "status": "in_progress",
                    "content": [],
                }
                yield from self._add(item)
                part = {"type": "output_text", "text": "", "annotations": []}
                yield self._event(
                    "response.content_part.added",
                    item_id=item["id"],
                    output_index=self._index,
                    content_index=0,
                    part=part,
                )
                item["content"].append(dict(part))
            item = self._open
            item["content"][0]["text"] += event.text
            yield self._event(
                "response.output_text.delta",
                item_id=item["id"],
                output_index=self._index,
                content_index=0,
                delta=event.text,
                logprobs=[],
            )
        elif isinstance(event, ToolCallBegin):
            yield from self._close()
            item = {
                "type": "function_call",
                "id": f"fc_{event.id}",
                "call_id": event.id,
                "name": event.name,
                "arguments": "",
                "status": "in_progress",
            }
            self._calls[event.index] = item
            yield from self._add(item)
        elif isinstance(event, ToolCallDelta) and event.arguments:
            item = self._calls[event.index]
            item["arguments"] += event.arguments
            yield self._event(
                "response.function_call_arguments.delta",
                item_id=item["id"],
                output_index=self._index,
                delta=event.arguments,
            )
        elif isinstance(event, ToolCallEnd):
            item = self._calls[event.index]
            if not item["arguments"] and event.arguments:  # OR-S-06: at least one delta
                item["arguments"] = event.arguments
                yield self._event(
                    "response.function_call_arguments.delta",
                    item_id=item["id"],
                    output_index=self._index,
                    delta=event.arguments,
                )
            item["arguments"] = event.arguments
            yield from self._close()
        elif isinstance(event, Finished):
            yield from self._close()
            self.usage = event.usage
            if event.reason == "length":
                self.status, self.incomplete_reason = "incomplete", "max_output_tokens"
                yield self._event("response.incomplete", response=self.response())
            else:
                self.status = "completed"
                yield self._event("response.completed", response=self.response())

    @property
    def _index(self) -> int:
        return len(self.items) - 1

    def _add(self, item: dict[str, Any]) -> Iterator[bytes]:
        self.items.append(item)
        self._open = item
        self._num_items += 1
        yield self._event("response.output_item.added", output_index=self._index, item=dict(item))

    def _close(self) -> Iterator[bytes]:
        item, self._open = self._open, None
        if item is None:
            return
        index = self.items.index(item)
        if item["type"] == "message":
            part = item["content"][0]
            yield self._event(
                "response.output_text.done",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                text=part["text"],
                logprobs=[],
            )
            yield self._event(
                "response.content_part.done",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                part=part,
            )
        else:
            yield self._event(
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=index,
                name=item["name"],
                arguments=item["arguments"],
            )
        item["status"] = "completed"
        yield self._event("response.output_item.done", output_index=index, item=item)

    def context(self, prompt: list[Message]) -> list[Message]:
        """What a later `previous_response_id` continues from: this request's messages
        (without its instructions) and its output as one assistant turn."""
        text = "".join(i["content"][0]["text"] for i in self.items if i["type"] == "message")
        calls = tuple(
            ToolCall(i["call_id"], i["name"], i["arguments"])
            for i in self.items
            if i["type"] == "function_call"
        )
        return [*prompt, Message("assistant", text, calls)]


async def stream(output: Output, generation: Generation) -> AsyncIterator[bytes]:
    for frame in output.start():
        yield frame
    try:
        while (event := await generation.next()) is not None:
            if event is KEEPALIVE:
                yield sse.KEEPALIVE_COMMENT
                continue
            for frame in output.take(event):
                yield frame
    except ApiError as exc:
        output.status = "failed"
        yield output._event(
            "error", code=exc.code or exc.kind, message=exc.message, param=exc.param
        )
