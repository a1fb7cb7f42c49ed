"""What every chat format shares: the segment types, the typed errors, tool validation.

A renderer turns a `Chat` into segments instead of one string, so that control tokens come
only from the skeleton the server writes (INJ-02) and no in-band placeholder exists that
content could forge (INJ-03):

- `Control(ids)`: control-token ids, resolved once from the format's frozen marker list;
  never found by scanning text.
- `Text(text)`: skeleton text and untrusted content, encoded with the content tokenizer.
- `Body(parts)`: an assistant turn's body (what the model wrote after the generation prompt,
  before its terminator). A body is its own segment group, so a turn the cluster generated
  can be replaced by the exact ids it generated (PC-06).

Text is split only where a control token stands (and around bodies): tokenizing two pieces
of plain text apart can change BPE ids (`"Hello\\n" + "\\nworld"`, PC-02), while the model's
tokenizer itself splits at every added token, so segment ids equal whole-string ids.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

from tokenizers import Tokenizer

from shared.tokenizer.chat import Chat, Message, Tool, canonical_json

TOOL_NAME = re.compile(r"[a-zA-Z0-9_.-]{1,64}")


class PromptError(ValueError):
    """A conversation that cannot be rendered as given: ingress answers 400."""


class InvalidToolNameError(PromptError):
    """A tool or call name outside `^[a-zA-Z0-9_.-]{1,64}$` (INJ-05): templates splice names
    next to control tokens, so a name is never allowed to carry anything else."""


class ToolChoiceError(PromptError):
    """tool_choice asks for a call that the request's tools cannot satisfy."""


class InvalidTextError(PromptError):
    """Text that is not valid Unicode (a lone surrogate from JSON `\\ud800`)."""


class ChatFormatError(ValueError):
    """A template or tokenizer that no renderer here fits: a deployment error, not a 400."""


class UnknownChatFormatError(ChatFormatError):
    """A chat template whose markers name no known family."""


@dataclass(frozen=True, slots=True)
class Control:
    ids: tuple[int, ...]
    text: str = ""  # the markers' literal text, for render_text and output checks


@dataclass(frozen=True, slots=True)
class Text:
    text: str


@dataclass(frozen=True, slots=True)
class Body:
    parts: tuple[Control | Text, ...]

    @property
    def text(self) -> str:
        return "".join(part.text for part in self.parts)


Segment = Control | Text | Body


class SegmentBuilder:
    """Collects a rendering: adjacent text merges into one Text (one BPE run), adjacent
    controls into one Control, empty text vanishes; `split()` ends a text run on purpose."""

    def __init__(self) -> None:
        self._segments: list[Segment] = []
        self._text: list[str] = []

    def text(self, text: str) -> None:
        if text:
            self._text.append(text)

    def control(self, control: Control) -> None:
        self.split()
        last = self._segments[-1] if self._segments else None
        if isinstance(last, Control):
            self._segments[-1] = Control(last.ids + control.ids, last.text + control.text)
        else:
            self._segments.append(control)

    def body(self, body: Body) -> None:
        self.split()
        self._segments.append(body)

    def extend(self, segments: list[Segment]) -> None:
        for segment in segments:
            if isinstance(segment, Text):
                self.text(segment.text)
            elif isinstance(segment, Control):
                self.control(segment)
            else:
                self.body(segment)

    def split(self) -> None:
        if self._text:
            self._segments.append(Text("".join(self._text)))
            self._text = []

    def build(self) -> list[Segment]:
        self.split()
        return self._segments


def segments_text(segments: list[Segment]) -> str:
    return "".join(segment.text for segment in segments)


def check_tool_name(name: str) -> str:
    if not TOOL_NAME.fullmatch(name):
        raise InvalidToolNameError(
            f"tool name {name[:80]!r} is invalid: names must match ^[a-zA-Z0-9_.-]{{1,64}}$"
        )
    return name


def tool_json(tool: Tool) -> str:
    """One tool as the JSON line both families put inside `<tools></tools>`."""
    function = {"name": tool.name, "description": tool.description, "parameters": tool.parameters}
    return canonical_json({"type": "function", "function": function})


class ChatFormat(ABC):
    """One template family, written in Python. Subclasses list their control markers in
    `MARKERS`; every one must be an added token of the tokenizer, or the content tokenizer
    could not keep content from producing it."""

    name: ClassVar[str]
    MARKERS: ClassVar[tuple[str, ...]]
    STOP_MARKERS: ClassVar[tuple[str, ...]]

    def __init__(self, tokenizer: Tokenizer) -> None:
        decoder = tokenizer.get_added_tokens_decoder()
        added = {token.content: token_id for token_id, token in decoder.items()}
        missing = [marker for marker in self.MARKERS if marker not in added]
        if missing:
            raise ChatFormatError(f"{self.name}: not added tokens of this tokenizer: {missing}")
        self._controls: dict[tuple[str, ...], Control] = {
            (marker,): Control((added[marker],), marker) for marker in self.MARKERS
        }
        self.stop_token_ids: tuple[int, ...] = tuple(added[m] for m in self.STOP_MARKERS)

    def control(self, *markers: str) -> Control:
        # Memoized: a 100-message render asks for ~500 controls (a third of its time before).
        control = self._controls.get(markers)
        if control is None:
            ids = tuple(i for marker in markers for i in self._controls[(marker,)].ids)
            control = self._controls[markers] = Control(ids, "".join(markers))
        return control

    @abstractmethod
    def render(self, chat: Chat, *, add_generation_prompt: bool = True) -> list[Segment]:
        """The prompt as segments; with add_generation_prompt, the forced prefix ends it."""

    @abstractmethod
    def render_body(self, message: Message) -> Body:
        """An assistant message's body as the model would have written it."""

    @abstractmethod
    def forced_segments(self, chat: Chat) -> list[Segment]:
        """The opening of a call that tool_choice forces, after the generation prompt
        (the chat is validated already)."""

    def forced_prefix(self, chat: Chat) -> str:
        """That opening as text ("" for tool_choice auto / none)."""
        self.validate(chat)
        return segments_text(self.forced_segments(chat))

    def render_text(self, chat: Chat, *, add_generation_prompt: bool = True) -> str:
        """The prompt as text (markers spelled out): what the model's template would render."""
        return segments_text(self.render(chat, add_generation_prompt=add_generation_prompt))

    @staticmethod
    def validate(chat: Chat) -> None:
        """INJ-05 before anything renders: every tool and call name, the forced name."""
        for tool in chat.tools:
            check_tool_name(tool.name)
        for message in chat.messages:
            for call in message.tool_calls:
                check_tool_name(call.name)
        choice = chat.tool_choice
        if choice.mode == "function":
            check_tool_name(choice.name)
            if choice.name not in {tool.name for tool in chat.tools}:
                raise ToolChoiceError(f"tool_choice names {choice.name!r}, not among the tools")
        if choice.mode == "required" and not chat.tools:
            raise ToolChoiceError("tool_choice 'required' with no tools")

    @staticmethod
    def rendered_tools(chat: Chat) -> tuple[Tool, ...]:
        """tool_choice 'none' leaves the tools out of the prompt altogether."""
        return () if chat.tool_choice.mode == "none" else chat.tools
