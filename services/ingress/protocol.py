"""What the three protocol adapters share: text out of content parts, tool choice."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from services.ingress.errors import invalid
from shared.tokenizer.chat import Tool, ToolChoice

TEXT_PART_TYPES = frozenset({"text", "input_text", "output_text"})


def text_of(content: str | Sequence[Any] | None, where: str) -> str:
    """A message's text: a string, or text parts joined. Anything else is a 400 naming the
    part (these models read text only)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else getattr(part, "type", None)
        text = part.get("text") if isinstance(part, dict) else getattr(part, "text", None)
        if kind not in TEXT_PART_TYPES or not isinstance(text, str):
            raise invalid(
                f"{where}.content[{i}]: parts of type {kind!r} are not supported "
                "(the served models read text only)",
                f"{where}.content",
            )
        texts.append(text)
    return "".join(texts)


def tool_choice_of(choice: str | dict[str, Any] | None, tools: Iterable[Tool]) -> ToolChoice:
    """ "auto" / "none" / "required" / {"type": "function", "name": N} (the Chat shape is
    flattened by its caller); a named function must be one of the tools."""
    names = {t.name for t in tools}
    if choice is None:
        return ToolChoice()
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise invalid(
                f"tool_choice {choice!r}: expected auto, none, required or a function",
                "tool_choice",
            )
        if choice == "required" and not names:
            raise invalid("tool_choice 'required' needs tools", "tool_choice")
        return ToolChoice(choice)  # type: ignore[arg-type]
    name = choice.get("name", "")
    if name not in names:
        raise invalid(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
    return ToolChoice("function", name)
