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


# Pins: Anthropic's `cache_control` breakpoints ({"type": "ephemeral", "ttl": "5m" | "1h"}),
# taken on the OpenAI-style APIs too (on a message or a content part): the prompt through
# the message holding one stays in the store for its ttl (docs/ingress.md, 'Pins').
PIN_TTLS = {"5m": 300, "1h": 3600}
MAX_BREAKPOINTS = 4


def cache_control_of(item: Any) -> Any:
    """The `cache_control` an item (a pydantic model with extra fields, or a dict) carries."""
    if isinstance(item, dict):
        return item.get("cache_control")
    return (getattr(item, "model_extra", None) or {}).get("cache_control")


def pin_ttl_s(value: Any, where: str) -> int:
    """A `cache_control`'s time to live in seconds; a 400 naming `where` for anything else."""
    if not isinstance(value, dict) or value.get("type") != "ephemeral":
        raise invalid(
            f'{where}: cache_control must be {{"type": "ephemeral"}}, with an optional '
            '"ttl" of "5m" or "1h"',
            where,
        )
    unknown = sorted(set(value) - {"type", "ttl"})
    if unknown:
        raise invalid(f"{where}: cache_control has unknown field {unknown[0]!r}", where)
    ttl = value.get("ttl", "5m")
    if ttl not in PIN_TTLS:
        raise invalid(f'{where}.ttl: must be "5m" or "1h", got {ttl!r}', f"{where}.ttl")
    return PIN_TTLS[ttl]


def checked_breakpoints(found: Sequence[tuple[int, int, str]]) -> tuple[tuple[int, int], ...]:
    """(chat message index, ttl_s) of each breakpoint, from (index, ttl_s, where) in prompt
    order: at most four, and none with a longer ttl after one with a shorter (a 1h prefix
    inside a 5m one would end first), as Anthropic's API requires."""
    if len(found) > MAX_BREAKPOINTS:
        raise invalid(
            f"at most {MAX_BREAKPOINTS} blocks may carry cache_control, got {len(found)}",
            found[MAX_BREAKPOINTS][2],
        )
    for (_, before, _), (_, after, where) in zip(found, found[1:], strict=False):
        if after > before:
            raise invalid(
                f"{where}: a cache_control ttl of {after} s follows one of {before} s; "
                "longer ttls must come first",
                where,
            )
    return tuple((index, ttl) for index, ttl, _ in found)
