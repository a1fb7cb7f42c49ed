"""Prompt tokenization: a protocol-neutral Chat to injection-safe, cached prompt ids."""

from shared.tokenizer.chat import Chat, Message, Tool, ToolCall, ToolChoice, canonical_json
from shared.tokenizer.content import ContentLeakError, ContentTokenizer
from shared.tokenizer.formats import (
    Body,
    ChatFormat,
    ChatFormatError,
    ChatML,
    Control,
    DeepSeekV3,
    InvalidTextError,
    InvalidToolNameError,
    PromptError,
    Segment,
    Text,
    ToolChoiceError,
    UnknownChatFormatError,
    format_for,
)
from shared.tokenizer.prompt import PromptTokenizer

__all__ = [
    "Body",
    "Chat",
    "ChatFormat",
    "ChatFormatError",
    "ChatML",
    "ContentLeakError",
    "ContentTokenizer",
    "Control",
    "DeepSeekV3",
    "InvalidTextError",
    "InvalidToolNameError",
    "Message",
    "PromptError",
    "PromptTokenizer",
    "Segment",
    "Text",
    "Tool",
    "ToolCall",
    "ToolChoice",
    "ToolChoiceError",
    "UnknownChatFormatError",
    "canonical_json",
    "format_for",
]
