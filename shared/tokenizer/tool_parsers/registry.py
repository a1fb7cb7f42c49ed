"""Choosing a parser by chat format, and the one-shot parse of a whole output.

The format names are the chat formats' own (shared/tokenizer/formats.py names tiny-coder's
"deepseek-v3" and SmolLM2's "chatml"); "deepseek_v3" is accepted as the same format.
"""

from __future__ import annotations

from collections.abc import Collection

from shared.tokenizer.chat import ToolCall
from shared.tokenizer.tool_parsers.base import ToolCallParser
from shared.tokenizer.tool_parsers.chatml import ChatMLParser
from shared.tokenizer.tool_parsers.deepseek_v3 import DeepSeekV3Parser
from shared.tokenizer.tool_parsers.events import (
    TextDelta,
    ToolCallBegin,
    ToolCallEnd,
    UnknownFormatError,
)

_PARSERS: dict[str, type[ToolCallParser]] = {
    "deepseek-v3": DeepSeekV3Parser,
    "deepseek_v3": DeepSeekV3Parser,
    "chatml": ChatMLParser,
}
FORMAT_NAMES = tuple(_PARSERS)


def parser_for(
    format_name: str,
    tool_names: Collection[str],
    *,
    id_prefix: str = "call_",
    id_token: str | None = None,
) -> ToolCallParser:
    """A fresh parser for one response. Raises UnknownFormatError (a ValueError) for a format
    without tool calls, and ValueError for id parts outside [A-Za-z0-9_-]."""
    try:
        cls = _PARSERS[format_name]
    except KeyError:
        raise UnknownFormatError(f"no tool-call parser for chat format {format_name!r}") from None
    return cls(tool_names, id_prefix=id_prefix, id_token=id_token)


def parse_all(parser: ToolCallParser, text: str) -> tuple[str, list[ToolCall]]:
    """Feed a whole output to a fresh parser and finish it: (content text, calls in order)."""
    content: list[str] = []
    names: dict[int, tuple[str, str]] = {}
    calls: list[ToolCall] = []
    for event in parser.feed(text) + parser.finish():
        if isinstance(event, TextDelta):
            content.append(event.text)
        elif isinstance(event, ToolCallBegin):
            names[event.index] = (event.id, event.name)
        elif isinstance(event, ToolCallEnd):
            call_id, name = names[event.index]
            calls.append(ToolCall(call_id, name, event.arguments))
    return "".join(content), calls
