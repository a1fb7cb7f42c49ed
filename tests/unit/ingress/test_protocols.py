"""The protocol adapters without a cluster: each request shape becomes the one neutral
Completion, errors render in each protocol's shape, and the stream builders turn a fixed
event sequence into frames the SDKs' own types accept, in the order they require."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

import anthropic
import pytest
from openai.types.responses import Response as OpenAIResponse
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter

from services.ingress import anthropic_messages as am
from services.ingress import openai_chat as oc
from services.ingress import openai_responses as rs
from services.ingress.errors import ApiError, from_service_error
from services.ingress.pipeline import (
    Finished,
    TextDelta,
    ToolCallBegin,
    ToolCallDelta,
    ToolCallEnd,
    Usage,
)
from shared.schema import NotFound, Overloaded
from shared.tokenizer.chat import Message, ToolCall, ToolChoice

TOOLS_CHAT = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


def test_chat_request_becomes_the_neutral_chat() -> None:
    body = oc.ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "max_tokens": 9,
            "max_completion_tokens": 7,
            "stop": "END",
            "tools": TOOLS_CHAT,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            "messages": [
                {"role": "developer", "content": "be brief"},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "cold"},
            ],
        }
    )
    completion = oc.to_completion(body, "key_1")
    chat = completion.chat
    assert completion.max_tokens == 7 and completion.stop == ("END",)  # max_completion_tokens wins
    assert [m.role for m in chat.messages] == ["system", "user", "assistant", "tool"]
    assert chat.messages[1].content == "ab"
    assert chat.messages[2].tool_calls == (ToolCall("c1", "get_weather", '{"city": "Oslo"}'),)
    assert chat.messages[3] == Message("tool", "cold", tool_call_id="c1", name="get_weather")
    assert chat.tool_choice == ToolChoice("function", "get_weather")
    assert completion.api_key_id == "key_1"


@pytest.mark.parametrize(
    ("messages", "tool_choice", "needle"),
    [
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}],
            None,
            "image_url",
        ),
        ([{"role": "tool", "content": "x"}], None, "tool_call_id"),
        (
            [{"role": "user", "content": "x"}],
            {"type": "function", "function": {"name": "nope"}},
            "nope",
        ),
    ],
)
def test_chat_request_errors_name_the_field(messages, tool_choice, needle) -> None:  # noqa: ANN001
    body = oc.ChatCompletionRequest.model_validate(
        {"model": "m", "messages": messages, "tools": TOOLS_CHAT, "tool_choice": tool_choice}
    )
    with pytest.raises(ApiError) as raised:
        oc.to_completion(body, "")
    assert raised.value.kind == "invalid_request" and needle in raised.value.message


def test_anthropic_request_becomes_the_neutral_chat() -> None:
    body = am.MessagesRequest.model_validate(
        {
            "model": "m",
            "max_tokens": 5,
            "system": [{"type": "text", "text": "sys"}],
            "tool_choice": {"type": "any"},
            "tools": [{"name": "get_weather", "input_schema": {"type": "object"}}],
            "messages": [
                {"role": "user", "content": "hi"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "text", "text": "checking"},
                        {
                            "type": "tool_use",
                            "id": "toolu_1",
                            "name": "get_weather",
                            "input": {"city": "Rome"},
                        },
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "toolu_1",
                            "content": [{"type": "text", "text": "sunny"}],
                        },
                        {"type": "text", "text": "thanks"},
                    ],
                },
            ],
        }
    )
    chat = am.to_chat(body)
    assert [m.role for m in chat.messages] == ["system", "user", "assistant", "tool", "user"]
    assert chat.messages[2].tool_calls[0].arguments == '{"city": "Rome"}'  # canonical_json
    assert chat.messages[3].name == "get_weather" and chat.messages[3].content == "sunny"
    assert chat.tool_choice == ToolChoice("required")


def test_responses_input_items_become_messages() -> None:
    messages = rs.input_messages(
        [
            {"role": "user", "content": [{"type": "input_text", "text": "q"}]},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call", "call_id": "c2", "name": "f", "arguments": '{"a": 1}'},
            {"type": "function_call_output", "call_id": "c1", "output": "r1"},
            {"type": "reasoning", "id": "rs_1", "summary": []},
        ]
    )
    assert [m.role for m in messages] == ["user", "assistant", "tool"]
    assert [c.id for c in messages[1].tool_calls] == ["c1", "c2"]  # parallel calls: one turn
    with pytest.raises(ApiError):
        rs.input_messages([{"type": "item_reference", "id": "x"}])


def test_error_shapes_and_retry_headers() -> None:
    error = from_service_error(Overloaded("busy", retry_after_s=2.4))
    assert (error.status("openai"), error.status("anthropic")) == (429, 529)
    # Retry-After rounds up: a client told 2.4 s must not come back after 2.
    assert error.headers() == {"x-should-retry": "true", "retry-after": "3"}
    assert error.anthropic_body("r1") == {
        "type": "error",
        "error": {"type": "overloaded_error", "message": "busy"},
        "request_id": "r1",
    }
    missing = from_service_error(NotFound("model 'x' is not served"))
    assert missing.openai_body()["error"]["code"] == "model_not_found"
    assert missing.headers()["x-should-retry"] == "false"


USAGE = Usage(prompt_tokens=100, cached_tokens=64, output_tokens=7)
TOOL_EVENTS = [
    TextDelta("Let me check. "),
    ToolCallBegin(0, "call_0", "get_weather"),
    ToolCallDelta(0, '{"city": '),
    ToolCallDelta(0, '"Paris"}'),
    ToolCallEnd(0, '{"city": "Paris"}'),
    ToolCallBegin(1, "call_1", "get_weather"),
    ToolCallEnd(1, '{"city": "Rome"}'),  # no delta: the builder sends one (OR-S-06)
    Finished("tool_calls", USAGE),
]


def test_responses_stream_events_validate_and_number_gap_free() -> None:
    body = rs.ResponsesRequest.model_validate({"model": "m", "input": "q"})
    output = rs.Output(body, "abc", [])
    frames = [*output.start()] + [f for e in TOOL_EVENTS for f in output.take(e)]
    adapter = TypeAdapter(ResponseStreamEvent)
    events = []
    for frame in frames:
        name, data = frame.decode().removesuffix("\n\n").split("\n")
        event = adapter.validate_json(data.removeprefix("data: "))
        assert name == f"event: {event.type}"
        events.append(event)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    added = [e.output_index for e in events if e.type == "response.output_item.added"]
    assert added == [0, 1, 2]
    final = OpenAIResponse.model_validate(events[-1].response.model_dump())
    assert [i.type for i in final.output] == ["message", "function_call", "function_call"]
    assert final.output[2].arguments == '{"city": "Rome"}'
    assert final.usage.input_tokens_details.cached_tokens == 64
    deltas = [e for e in events if e.type == "response.function_call_arguments.delta"]
    assert [d.output_index for d in deltas] == [1, 1, 2]


def test_responses_length_is_incomplete() -> None:
    body = rs.ResponsesRequest.model_validate({"model": "m", "input": "q"})
    output = rs.Output(body, "abc", [])
    frames = [
        *output.start(),
        *output.take(TextDelta("x")),
        *output.take(Finished("length", USAGE)),
    ]
    last = json.loads(frames[-1].decode().split("data: ", 1)[1])
    assert last["type"] == "response.incomplete"
    assert last["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


@dataclass
class _Prepared:
    num_prompt_tokens: int = 100


class _FixedGeneration:
    """A generation whose events are fixed: what the stream builders read."""

    def __init__(self, events: list) -> None:  # noqa: ANN001
        self._events = list(events)
        self.prepared = _Prepared()
        self.num_cached_estimate = 48

    async def next(self):  # noqa: ANN201
        return self._events.pop(0) if self._events else None


def collect(stream) -> list[bytes]:  # noqa: ANN001
    async def run() -> list[bytes]:
        return [frame async for frame in stream]

    return asyncio.run(run())


def test_anthropic_stream_blocks_open_and_close_in_order() -> None:
    body = am.MessagesRequest.model_validate(
        {"model": "m", "max_tokens": 9, "messages": [{"role": "user", "content": "q"}]}
    )
    frames = collect(am.stream(body, _FixedGeneration(TOOL_EVENTS), "abc"))
    adapter = TypeAdapter(anthropic.types.RawMessageStreamEvent)
    parsed = []
    for frame in frames:
        name, data = frame.decode().removesuffix("\n\n").split("\n")
        payload = json.loads(data.removeprefix("data: "))
        assert name == f"event: {payload['type']}"  # AN-S-01
        if payload["type"] != "ping":
            adapter.validate_json(data.removeprefix("data: "))
        parsed.append(payload)
    kinds = [p["type"] for p in parsed if p["type"] != "ping"]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    starts = [p for p in parsed if p["type"] == "content_block_start"]
    assert [s["index"] for s in starts] == [0, 1, 2]
    assert [s["content_block"]["type"] for s in starts] == ["text", "tool_use", "tool_use"]
    open_index = None  # every delta goes to the block open now; each block closed once
    for p in parsed:
        if p["type"] == "content_block_start":
            assert open_index is None
            open_index = p["index"]
        elif p["type"] == "content_block_delta":
            assert p["index"] == open_index
        elif p["type"] == "content_block_stop":
            assert p["index"] == open_index
            open_index = None
    start_usage = parsed[0]["message"]["usage"]
    assert (start_usage["input_tokens"], start_usage["cache_read_input_tokens"]) == (52, 48)
    delta = next(p for p in parsed if p["type"] == "message_delta")
    assert delta["delta"]["stop_reason"] == "tool_use"
    assert (delta["usage"]["input_tokens"], delta["usage"]["cache_read_input_tokens"]) == (36, 64)


def test_chat_stream_sends_id_and_name_once() -> None:
    body = oc.ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "q"}],
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )
    frames = collect(oc.stream(body, [_FixedGeneration(TOOL_EVENTS)], "abc"))
    assert frames[-1] == b"data: [DONE]\n\n"
    chunks = [json.loads(f.decode()[6:]) for f in frames[:-1]]
    calls = [
        tc for c in chunks if c["choices"] for tc in c["choices"][0]["delta"].get("tool_calls", ())
    ]
    named = [tc for tc in calls if "id" in tc]
    assert [(tc["index"], tc["function"]["name"]) for tc in named] == [
        (0, "get_weather"),
        (1, "get_weather"),
    ]
    args = {0: "", 1: ""}
    for tc in calls:
        args[tc["index"]] += tc["function"]["arguments"]
    assert args == {0: '{"city": "Paris"}', 1: '{"city": "Rome"}'}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens_details"] == {
        "cached_tokens": 64,
        "cache_write_tokens": 0,
    }
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-2]["choices"][0] == {
        "index": 0,
        "delta": {},
        "logprobs": None,
        "finish_reason": "tool_calls",
    }


class _FailingGeneration(_FixedGeneration):
    """Some text, then the cluster fails mid-stream."""

    async def next(self):  # noqa: ANN201
        if self._events:
            return self._events.pop(0)
        raise ApiError("unavailable", "decode worker decode-0 stopped responding")


def test_mid_stream_failures_are_each_protocols_error_event() -> None:
    events = [TextDelta("partial")]
    chat_body = oc.ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "q"}], "stream": True}
    )
    chat = collect(oc.stream(chat_body, [_FailingGeneration(events)], "abc"))
    assert b"[DONE]" not in chat[-1]  # the OpenAI SDK raises APIError on a truthy "error"
    error = json.loads(chat[-1].decode()[6:])["error"]
    assert error["type"] == "server_error" and "decode-0" in error["message"]

    ant_body = am.MessagesRequest.model_validate(
        {"model": "m", "max_tokens": 9, "messages": [{"role": "user", "content": "q"}]}
    )
    ant = collect(am.stream(ant_body, _FailingGeneration(events), "abc"))
    name, data = ant[-1].decode().removesuffix("\n\n").split("\n")
    assert name == "event: error"  # the Anthropic SDK raises APIStatusError on it
    assert json.loads(data[6:])["error"]["type"] == "api_error"

    rs_body = rs.ResponsesRequest.model_validate({"model": "m", "input": "q"})
    output = rs.Output(rs_body, "abc", [])
    frames = collect(rs.stream(output, _FailingGeneration(events)))
    last = TypeAdapter(ResponseStreamEvent).validate_json(frames[-1].decode().split("data: ")[1])
    assert last.type == "error" and last.sequence_number == len(frames) - 1
    assert output.status == "failed"


# -- pins: cache_control breakpoints ----------------------------------------------------------
def test_anthropic_breakpoints_pin_through_the_message_that_holds_them() -> None:
    body = am.MessagesRequest.model_validate(
        {
            "model": "m",
            "max_tokens": 4,
            "system": [
                {"type": "text", "text": "S", "cache_control": {"type": "ephemeral", "ttl": "1h"}}
            ],
            "messages": [
                {"role": "user", "content": "q1"},
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "t1", "content": "r"},
                        {"type": "text", "text": "go", "cache_control": {"type": "ephemeral"}},
                    ],
                },
            ],
        }
    )
    completion = am.to_completion(body, "k")
    # system (0), q1 (1), the call (2), the tool's result (3), "go" (4): pinned through 4.
    assert completion.breakpoints == ((0, 3600), (4, 300))
    assert [m.role for m in completion.chat.messages] == [
        "system",
        "user",
        "assistant",
        "tool",
        "user",
    ]


@pytest.mark.parametrize(
    ("control", "message"),
    [
        ({"type": "ephemeral", "ttl": "10m"}, 'must be "5m" or "1h"'),
        ({"type": "persistent"}, "must be"),
        ({"type": "ephemeral", "scope": "global"}, "unknown field 'scope'"),
        ("yes", "must be"),
    ],
)
def test_a_bad_cache_control_is_a_400_naming_it(control: object, message: str) -> None:
    for build in (
        lambda: am.to_completion(
            am.MessagesRequest.model_validate(
                {
                    "model": "m",
                    "max_tokens": 4,
                    "messages": [
                        {
                            "role": "user",
                            "content": [{"type": "text", "text": "q", "cache_control": control}],
                        }
                    ],
                }
            ),
            "k",
        ),
        lambda: oc.to_completion(
            oc.ChatCompletionRequest.model_validate(
                {
                    "model": "m",
                    "messages": [{"role": "user", "content": "q", "cache_control": control}],
                }
            ),
            "k",
        ),
    ):
        with pytest.raises(ApiError, match=message) as raised:
            build()
        assert raised.value.status("openai") == raised.value.status("anthropic") == 400
        assert "cache_control" in (raised.value.param or "")


def test_breakpoints_at_most_four_and_longer_ttls_first() -> None:
    def chat(*controls: dict) -> oc.ChatCompletionRequest:
        messages = [{"role": "user", "content": "q", "cache_control": c} for c in controls]
        return oc.ChatCompletionRequest.model_validate({"model": "m", "messages": messages})

    one_hour, five = {"type": "ephemeral", "ttl": "1h"}, {"type": "ephemeral", "ttl": "5m"}
    assert oc.to_completion(chat(one_hour, five), "k").breakpoints == ((0, 3600), (1, 300))
    with pytest.raises(ApiError, match="longer ttls must come first"):
        oc.to_completion(chat(five, one_hour), "k")
    with pytest.raises(ApiError, match="at most 4"):
        oc.to_completion(chat(*[five] * 5), "k")
