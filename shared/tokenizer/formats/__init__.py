"""Chat formats: one Python renderer per template family, producing segments."""

from shared.tokenizer.formats.base import (
    Body,
    ChatFormat,
    ChatFormatError,
    Control,
    InvalidTextError,
    InvalidToolNameError,
    PromptError,
    Segment,
    Text,
    ToolChoiceError,
    UnknownChatFormatError,
    segments_text,
)
from shared.tokenizer.formats.chatml import ChatML
from shared.tokenizer.formats.deepseek_v3 import DeepSeekV3
from shared.tokenizer.formats.detect import format_family, format_for

__all__ = [
    "Body",
    "ChatFormat",
    "ChatFormatError",
    "ChatML",
    "Control",
    "DeepSeekV3",
    "InvalidTextError",
    "InvalidToolNameError",
    "PromptError",
    "Segment",
    "Text",
    "ToolChoiceError",
    "UnknownChatFormatError",
    "format_family",
    "format_for",
    "segments_text",
]
