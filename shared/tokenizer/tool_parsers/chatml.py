"""Hermes / Qwen2.5-style tool calls in chatml output (SmolLM2), streamed:

    TEXT <tool_call>\\n{"name": "NAME", "arguments": {...}}\\n</tool_call> [ws <tool_call>...]

`<tool_call>` is plain text for SmolLM2 (not a token), so this reads the wrapper object with
its own small state machine: keys in any order (`"parameters"` is taken for `"arguments"`,
other keys are skipped), any whitespace, no newline needed. With the name first, the call
begins when the name's closing quote arrives and the arguments stream as they come; with the
arguments first they are held and sent, whole, the moment the name arrives.

Fallbacks (TP-06): until the call has begun, everything from `<tool_call>` on is held. A
wrapper that cannot be a call (not an object, a name that is no known tool, a closing brace
or `</tool_call>` before any name) is released as text, as written, at its first impossible
character; the rest of the block reads as text too, until a later `<tool_call>`. Once begun,
a call is closed, never taken back: by the wrapper's `}`, by `</tool_call>` (a missing `}` is
tolerated), by a character that breaks the wrapper (it and what follows read as text), or by
finish(). `</tool_call>` ends a call wherever it appears, even inside a JSON string (TP-05).
Invalid arguments run to `</tool_call>`; their ToolCallEnd carries the raw text less the
wrapper's `}`, or, when they are a JSON string holding an object (OpenAI's wire form), that
object.
"""

from __future__ import annotations

import json
from collections.abc import Collection

from shared.tokenizer.tool_parsers.base import MORE, ToolCallParser, holdback, match_marker
from shared.tokenizer.tool_parsers.json_prefix import WS, ArgsStream, JsonPrefix, is_json_object

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"
_ARG_KEYS = ("arguments", "parameters")

(TEXT, OPEN, KEY_START, KEY, COLON, NAME_VALUE, NAME_STR, ARGS, SKIP, AFTER_VALUE, BETWEEN) = range(
    11
)


class ChatMLParser(ToolCallParser):
    def __init__(
        self, tool_names: Collection[str], *, id_prefix: str = "call_", id_token: str | None = None
    ) -> None:
        super().__init__(tool_names, id_prefix=id_prefix, id_token=id_token)
        self._state = TEXT
        self._str = ""  # the key or name being read, as written (escapes included)
        self._esc = False  # the last character of _str was an escaping backslash
        self._key = ""
        self._skip = JsonPrefix(objects_only=False)  # the value of a key we do not use
        self._tag_seen = False  # BETWEEN: the call's `</tool_call>` was read
        self._steps = {
            TEXT: self._on_text,
            OPEN: self._on_open,
            KEY_START: self._on_key_start,
            KEY: self._on_string,
            COLON: self._on_colon,
            NAME_VALUE: self._on_name_value,
            NAME_STR: self._on_string,
            ARGS: self._on_args,
            SKIP: self._on_skip,
            AFTER_VALUE: self._on_after_value,
            BETWEEN: self._on_between,
        }

    def _step(self, final: bool) -> bool:
        return self._steps[self._state](final)

    def _final_arguments(self) -> str:
        if self._args is None:
            return ""
        raw = self._args.raw.strip(WS)
        if self._args.valid:
            return raw
        if raw.endswith("}"):
            raw = raw[:-1].rstrip(WS)  # the wrapper's brace, read as arguments
        try:
            inner = json.loads(raw)
        except ValueError:
            return raw
        return inner if isinstance(inner, str) and is_json_object(inner) else raw

    # -- transitions ---------------------------------------------------------------------
    def _abandon(self) -> bool:
        """Not (or no longer) a call: close a begun one, release what was held, and read on
        from this character as text."""
        if self._open is not None:
            self._end_call(self._final_arguments())
        self._release()
        self._state = TEXT
        return True

    def _unexpected(self, final: bool) -> bool:
        """A character the wrapper does not allow here: `</tool_call>` closes a begun call
        (missing braces tolerated); anything else abandons."""
        if self._open is not None and self._buf[self._pos] == "<":
            marker = match_marker(self._buf, self._pos, (CLOSE_TAG,), final)
            if marker == MORE:
                return False
            if marker == CLOSE_TAG:
                self._take(len(CLOSE_TAG))
                self._end_call(self._final_arguments())
                self._to_between(tag_seen=True)
                return True
        return self._abandon()

    def _to_between(self, *, tag_seen: bool) -> None:
        self._start_holding()  # whitespace after a call is text unless another call follows
        self._tag_seen = tag_seen
        self._state = BETWEEN

    def _close_wrapper(self) -> bool:
        if self._open is None:
            return self._abandon()  # no name: not a call
        self._end_call(self._final_arguments())
        self._to_between(tag_seen=False)
        return True

    def _start_block(self) -> None:
        self._start_holding()
        self._take(len(OPEN_TAG))
        self._args = None
        self._state = OPEN

    # -- states --------------------------------------------------------------------------
    def _on_text(self, final: bool) -> bool:
        if self._scan_text((OPEN_TAG,), final) is None:
            return False
        self._start_block()
        return True

    def _on_open(self, final: bool) -> bool:
        self._skip_ws()
        if self._pos == len(self._buf):
            return False
        if self._buf[self._pos] != "{":
            return self._abandon()
        self._take(1)
        self._state = KEY_START
        return True

    def _on_key_start(self, final: bool) -> bool:
        self._skip_ws()
        if self._pos == len(self._buf):
            return False
        c = self._buf[self._pos]
        if c == "}":
            self._take(1)
            return self._close_wrapper()
        if c != '"':
            return self._unexpected(final)
        self._take(1)
        self._str, self._esc, self._state = "", False, KEY
        return True

    def _on_string(self, final: bool) -> bool:
        """A key (KEY) or the name (NAME_STR); a name is given up at its first character
        that no known tool name has there."""
        buf = self._buf
        while self._pos < len(buf):
            c = buf[self._pos]
            if c == '"' and not self._esc:
                self._take(1)
                return self._string_done()
            text = self._str + c
            if self._state == NAME_STR and "\\" not in text and not self._is_tool_prefix(text):
                return self._abandon()
            self._str, self._esc = text, c == "\\" and not self._esc
            self._take(1)
        return False

    def _string_done(self) -> bool:
        if self._state == KEY:
            self._key, self._state = self._str, COLON
            return True
        try:
            name = json.loads(f'"{self._str}"')
        except ValueError:
            return self._abandon()
        if not self._is_tool(name):
            return self._abandon()
        self._begin(name)  # sends arguments that came first, if any
        self._state = AFTER_VALUE
        return True

    def _on_colon(self, final: bool) -> bool:
        self._skip_ws()
        if self._pos == len(self._buf):
            return False
        if self._buf[self._pos] != ":":
            return self._unexpected(final)
        self._take(1)
        if self._key == "name" and self._open is None:
            self._state = NAME_VALUE
        elif self._key in _ARG_KEYS and self._args is None:
            self._args, self._state = ArgsStream(), ARGS
        else:
            self._skip, self._state = JsonPrefix(objects_only=False), SKIP
        return True

    def _on_name_value(self, final: bool) -> bool:
        self._skip_ws()
        if self._pos == len(self._buf):
            return False
        if self._buf[self._pos] != '"':
            return self._unexpected(final)
        self._take(1)
        self._str, self._esc, self._state = "", False, NAME_STR
        return True

    def _on_args(self, final: bool) -> bool:
        buf, pos = self._buf, self._pos
        tag = buf.find(CLOSE_TAG, pos)
        stop = tag if tag != -1 else len(buf) - (0 if final else holdback(buf, pos, (CLOSE_TAG,)))
        assert self._args is not None
        self._take(self._args.push(buf, pos, stop, stop_when_complete=True) - pos)
        self._flush_args()
        if self._args.complete:
            self._state = AFTER_VALUE
            return True
        if tag == -1:
            return False
        if self._open is None:  # `</tool_call>` inside arguments that came before any name
            return self._abandon()
        self._take(len(CLOSE_TAG))
        self._end_call(self._final_arguments())
        self._to_between(tag_seen=True)
        return True

    def _on_skip(self, final: bool) -> bool:
        buf, pos = self._buf, self._pos
        self._take(self._skip.advance(buf, pos, len(buf), stop_when_complete=True) - pos)
        if self._skip.complete:
            self._state = AFTER_VALUE
            return True
        return False if self._skip.valid else self._unexpected(final)

    def _on_after_value(self, final: bool) -> bool:
        self._skip_ws()
        if self._pos == len(self._buf):
            return False
        c = self._buf[self._pos]
        if c not in ",}":
            return self._unexpected(final)
        self._take(1)
        if c == "}":
            return self._close_wrapper()
        self._state = KEY_START
        return True

    def _on_between(self, final: bool) -> bool:
        self._skip_ws()
        if self._pos == len(self._buf):
            return False
        markers = (OPEN_TAG,) if self._tag_seen else (CLOSE_TAG, OPEN_TAG)
        marker = match_marker(self._buf, self._pos, markers, final)
        if marker == MORE:
            return False
        if marker is None:
            self._release()
            self._state = TEXT
        elif marker == OPEN_TAG:
            self._start_block()  # the whitespace between two calls is markup
        else:
            self._take(len(CLOSE_TAG))
            self._held, self._tag_seen = "", True
        return True
