"""Streaming tool-call parsers: model output text in, text and tool-call events out.

    parser = parser_for("deepseek-v3", ["get_weather"])
    for delta in text_deltas:
        events = parser.feed(delta)    # TextDelta / ToolCallBegin / ToolCallDelta / ToolCallEnd
    events = parser.finish()           # held text released, a truncated call closed

One parser per response (per choice). See base.py for the guarantees (split invariance,
marker hold-back, the text route), json_prefix.py for the argument fragments.
"""

from shared.tokenizer.tool_parsers.base import ToolCallParser
from shared.tokenizer.tool_parsers.chatml import ChatMLParser
from shared.tokenizer.tool_parsers.deepseek_v3 import DeepSeekV3Parser
from shared.tokenizer.tool_parsers.events import (
    ParseEvent,
    ParserFinishedError,
    TextDelta,
    ToolCallBegin,
    ToolCallDelta,
    ToolCallEnd,
    UnknownFormatError,
)
from shared.tokenizer.tool_parsers.registry import FORMAT_NAMES, parse_all, parser_for

__all__ = [
    "FORMAT_NAMES",
    "ChatMLParser",
    "DeepSeekV3Parser",
    "ParseEvent",
    "ParserFinishedError",
    "TextDelta",
    "ToolCallBegin",
    "ToolCallDelta",
    "ToolCallEnd",
    "ToolCallParser",
    "UnknownFormatError",
    "parse_all",
    "parser_for",
]
