"""A conversation as ingress hands it to the tokenizer: protocol-neutral, the same whether it
arrived as OpenAI Chat Completions, OpenAI Responses or Anthropic Messages.

Everything in here except the roles is user-controlled text: the renderers never write any of
it through a path that could become a control token (shared/tokenizer/content.py).

Tool-call arguments stay the JSON text the client sent (OpenAI and Responses send a string,
and it is rendered verbatim); an Anthropic `tool_use.input` object is serialized once, by
`canonical_json`, so the same object always renders to the same bytes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

Role = Literal["system", "user", "assistant", "tool"]


def canonical_json(value: Any) -> str:
    """The one serialization of a JSON value the renderers use (key order as given, no ASCII
    escaping, compact separators with a space after `:` and `,` as models write JSON)."""
    return json.dumps(value, ensure_ascii=False, separators=(", ", ": "))


@dataclass(frozen=True)
class ToolCall:
    """A call the assistant made: `arguments` is JSON text, passed through verbatim."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class Message:
    role: Role
    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()  # role == "assistant"
    tool_call_id: str = ""  # role == "tool": the call this message answers
    name: str = ""  # role == "tool": the tool's name, where the protocol says it


@dataclass(frozen=True)
class Tool:
    """A function the model may call. `parameters` is its JSON schema (an object)."""

    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=dict)


ToolChoiceMode = Literal["auto", "none", "required", "function"]


@dataclass(frozen=True)
class ToolChoice:
    mode: ToolChoiceMode = "auto"
    name: str = ""  # mode == "function"


@dataclass(frozen=True)
class Chat:
    messages: tuple[Message, ...]
    tools: tuple[Tool, ...] = ()
    tool_choice: ToolChoice = ToolChoice()
    parallel_tool_calls: bool = True
