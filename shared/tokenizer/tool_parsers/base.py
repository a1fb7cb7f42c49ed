"""The machinery every streaming tool-call parser shares: a buffer, the partial-marker
hold-back, held (tentative) text, call ids and the event list.

Markers are recognised in TEXT, not by token id (TP-05). The parser sits in ingress after the
detokenizer, which streams text; for SmolLM2's chatml format `<tool_call>` is not even a token,
so ids could not help there, and one text route keeps both formats on the same, split-invariant
code (ids would also have to be aligned with text the detokenizer holds back mid-character).
The cost: marker text the model spells with ordinary tokens counts as markup, even inside a
JSON string. For tiny-coder's DeepSeek markers (U+FF5C and U+2581 inside) that is improbable.

Split invariance (TP-01) holds by construction: a subclass's `_step` looks at the buffer from
`_pos` and either acts on characters whose meaning no later text can change, or returns False
("need more"). So the state after any partition of a text is the state after the whole text,
and the events differ only in how text and argument fragments are grouped. `final` (from
finish()) turns every "need more" into "it is not a marker".

Tentative text (from a marker until the call's name is known and accepted) is held, not sent;
if it turns out not to be a call it is released as text, exactly as the model wrote it (TP-06).
What a call consumes (its markers, head, wrapper, whitespace between calls) is markup, not text.
"""

from __future__ import annotations

import re
import secrets
from abc import ABC, abstractmethod
from collections.abc import Collection, Sequence

from shared.tokenizer.tool_parsers.events import (
    ParseEvent,
    ParserFinishedError,
    TextDelta,
    ToolCallBegin,
    ToolCallDelta,
    ToolCallEnd,
)
from shared.tokenizer.tool_parsers.json_prefix import WS, ArgsStream, is_json_object

_ID_PART = re.compile(r"[A-Za-z0-9_-]*")
MORE = ""  # match_marker(): the text so far may still become the marker


def holdback(buf: str, pos: int, markers: Sequence[str]) -> int:
    """Length of the longest suffix of buf[pos:] that is a proper prefix of a marker (TP-04)."""
    longest = min(len(buf) - pos, max(len(m) for m in markers) - 1)
    for k in range(longest, 0, -1):
        tail = buf[len(buf) - k :]
        if any(m.startswith(tail) for m in markers):
            return k
    return 0


def match_marker(buf: str, pos: int, markers: Sequence[str], final: bool) -> str | None:
    """The marker buf[pos:] starts with; MORE if it is a proper prefix of one and more text
    may come; None otherwise."""
    rest = buf[pos:]
    for m in markers:
        if rest.startswith(m):
            return m
    if not final and any(m.startswith(rest) for m in markers):
        return MORE
    return None


class ToolCallParser(ABC):
    """One response's (one choice's) parser: feed() text deltas, then finish() once.

    Ids are `id_prefix + f"{index}_{id_token}"`: unique per call through the index, unique per
    response through `id_token` (16 random hex digits unless given, which tests do to compare
    runs). Both parts must match `[A-Za-z0-9_-]*`, as Anthropic requires of tool_use ids.
    An empty `tool_names` means no call is accepted: all output is text.
    """

    def __init__(
        self, tool_names: Collection[str], *, id_prefix: str = "call_", id_token: str | None = None
    ) -> None:
        token = secrets.token_hex(8) if id_token is None else id_token
        for part in (id_prefix, token):
            if not _ID_PART.fullmatch(part):
                raise ValueError(f"tool-call id parts must match [A-Za-z0-9_-]*: {part!r}")
        self._tools = tuple(dict.fromkeys(tool_names))
        self._id_prefix = id_prefix
        self._id_token = token
        self._buf = ""
        self._pos = 0
        self._out: list[ParseEvent] = []
        self._held = ""  # consumed, not yet released; only while _holding
        self._holding = False
        self._num_calls = 0
        self._open: int | None = None  # index of the call being streamed
        self._args: ArgsStream | None = None  # its arguments (or, in chatml, before its name)
        self._finished = False

    @property
    def num_calls(self) -> int:
        """Calls begun so far (ToolCallBegin events sent)."""
        return self._num_calls

    def feed(self, text: str) -> list[ParseEvent]:
        if self._finished:
            raise ParserFinishedError("feed() after finish()")
        if text:
            self._buf = self._buf[self._pos :] + text
            self._pos = 0
            self._run(final=False)
        return self._drain()

    def finish(self) -> list[ParseEvent]:
        """End of output: release held text, close a truncated call. Safe to repeat."""
        if self._finished:
            return []
        self._finished = True
        self._run(final=True)
        if self._open is not None:
            self._end_call(self._final_arguments())
        self._release()
        return self._drain()

    # -- for subclasses ------------------------------------------------------------------
    @abstractmethod
    def _step(self, final: bool) -> bool:
        """Act on the buffer at _pos; False when nothing can be decided without more text."""

    @abstractmethod
    def _final_arguments(self) -> str:
        """The open call's whole arguments text, from its ArgsStream's raw text."""

    def _is_tool_prefix(self, text: str) -> bool:
        return any(t.startswith(text) for t in self._tools)

    def _is_tool(self, name: str) -> bool:
        return name in self._tools

    def _take(self, n: int) -> str:
        text = self._buf[self._pos : self._pos + n]
        self._pos += n
        if self._holding:
            self._held += text
        return text

    def _skip_ws(self) -> None:
        buf, i = self._buf, self._pos
        while i < len(buf) and buf[i] in WS:
            i += 1
        self._take(i - self._pos)

    def _scan_text(self, markers: Sequence[str], final: bool) -> str | None:
        """Release text up to the first marker and return that marker (not consumed), or
        release all but a possible partial marker and return None."""
        buf, pos = self._buf, self._pos
        best, found = len(buf), None
        for m in markers:
            i = buf.find(m, pos, best + len(m))
            if i != -1 and i < best:
                best, found = i, m
        if found is None:
            best = len(buf) - (0 if final else holdback(buf, pos, markers))
        self._text(buf[pos:best])
        self._pos = best
        return found

    def _start_holding(self) -> None:
        self._holding, self._held = True, ""

    def _release(self) -> None:
        """Send the held text as text: it was not markup after all."""
        self._text(self._held)
        self._holding, self._held = False, ""

    def _begin(self, name: str) -> None:
        index = self._num_calls
        self._num_calls += 1
        self._open = index
        self._holding, self._held = False, ""  # the markup is consumed
        self._emit(ToolCallBegin(index, f"{self._id_prefix}{index}_{self._id_token}", name))
        self._flush_args()

    def _flush_args(self) -> None:
        if self._open is not None and self._args is not None and (fragment := self._args.take()):
            self._emit(ToolCallDelta(self._open, fragment))

    def _end_call(self, arguments: str) -> None:
        """Close the open call. Empty arguments become `{}`. A valid object the fragments did
        not reach (`{}`, unwrapped string arguments) is sent as the last fragment, so the
        fragments join to the arguments whenever they are valid JSON."""
        if self._open is None:
            return
        self._flush_args()
        sent = self._args.sent if self._args is not None else ""
        arguments = arguments or "{}"
        if len(arguments) > len(sent) and arguments.startswith(sent) and is_json_object(arguments):
            self._emit(ToolCallDelta(self._open, arguments[len(sent) :]))
        self._emit(ToolCallEnd(self._open, arguments))
        self._open, self._args = None, None

    def _text(self, text: str) -> None:
        if text:
            self._emit(TextDelta(text))

    # -- internals -----------------------------------------------------------------------
    def _run(self, final: bool) -> None:
        while self._pos < len(self._buf) and self._step(final):
            pass

    def _emit(self, event: ParseEvent) -> None:
        """Append, merging with the previous event of the same kind (one delta per feed)."""
        last = self._out[-1] if self._out else None
        if isinstance(event, TextDelta) and isinstance(last, TextDelta):
            self._out[-1] = TextDelta(last.text + event.text)
        elif (
            isinstance(event, ToolCallDelta)
            and isinstance(last, ToolCallDelta)
            and last.index == event.index
        ):
            self._out[-1] = ToolCallDelta(event.index, last.arguments + event.arguments)
        else:
            self._out.append(event)

    def _drain(self) -> list[ParseEvent]:
        out, self._out = self._out, []
        return out
