"""What a tool-call parser emits: the protocol-neutral events ingress turns into Chat
Completions chunks, Responses events or Anthropic content blocks.

For one response the events read, in order, like the output itself: text, then for each call
`ToolCallBegin` (id and name, before any argument), zero or more `ToolCallDelta` fragments
(concatenated: a valid JSON prefix after every one), `ToolCallEnd` (the whole arguments), and
text again. Indices count calls from 0 without gaps.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TextDelta:
    """User-visible text (content), never empty."""

    text: str


@dataclass(frozen=True)
class ToolCallBegin:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallDelta:
    """A fragment of call `index`'s arguments: a strict suffix of what was sent before."""

    index: int
    arguments: str


@dataclass(frozen=True)
class ToolCallEnd:
    """Call `index` is complete. `arguments` is the whole JSON text; it equals the fragments
    joined unless the model wrote invalid JSON (then it is the raw text, see json_prefix.py)."""

    index: int
    arguments: str


ParseEvent = TextDelta | ToolCallBegin | ToolCallDelta | ToolCallEnd


class ParserFinishedError(RuntimeError):
    """feed() after finish(): the response is over, a new one needs a new parser."""


class UnknownFormatError(ValueError):
    """parser_for() was asked for a chat format that has no tool-call parser."""
