"""DeepSeek-V3 tool calls (tiny-coder), streamed:

    TEXT <｜tool▁calls▁begin｜>
    <｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\nARGS\\n```<｜tool▁call▁end｜>
    [\\n<｜tool▁call▁begin｜>...<｜tool▁call▁end｜>]*
    <｜tool▁calls▁end｜> TEXT            (all on one line; no newlines but the ones shown)

Tolerated, because a small model drifts: a missing `<｜tool▁calls▁begin｜>`, whitespace around
the name, a missing newline or language after the fence, a missing closing fence, a missing
`<｜tool▁call▁end｜>` (the next call's begin or the block's end closes the call), and the V3.1
form `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>`.

Fallbacks (TP-06): a head that cannot become `function<｜tool▁sep｜>KNOWN_NAME` is released as
text as soon as that is certain (an unknown tool's name at its first impossible character),
and the rest of that block reads as text. Once a call has begun it is never taken back: its
arguments run to the next tool marker, whatever they contain; at finish() a truncated call is
closed with the arguments received.
"""

from __future__ import annotations

from collections.abc import Collection

from shared.tokenizer.tool_parsers.base import MORE, ToolCallParser, holdback, match_marker
from shared.tokenizer.tool_parsers.json_prefix import WS, ArgsStream

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"
FENCE = "```"
_TYPE = "function"
_TEXT_MARKERS = (CALLS_BEGIN, CALL_BEGIN)
_BLOCK_MARKERS = (CALL_BEGIN, CALLS_END)
_ARGS_ENDS = (CALL_END, CALLS_END, CALL_BEGIN)
_NAME_ENDS = "\n`<"
_NAME_PAD = " \t\r"

TEXT, BLOCK, HEAD, NAME, OPEN_FENCE, LANG, ARGS = range(7)


class DeepSeekV3Parser(ToolCallParser):
    def __init__(
        self, tool_names: Collection[str], *, id_prefix: str = "call_", id_token: str | None = None
    ) -> None:
        super().__init__(tool_names, id_prefix=id_prefix, id_token=id_token)
        self._state = TEXT
        self._head = ""  # between call begin and sep: "function", or a name (V3.1)
        self._name = ""
        self._name_padded = False  # whitespace after the name: only its end may follow
        self._steps = {
            TEXT: self._on_text,
            BLOCK: self._on_block,
            HEAD: self._on_head,
            NAME: self._on_name,
            OPEN_FENCE: self._on_fence,
            LANG: self._on_lang,
            ARGS: self._on_args,
        }

    def _step(self, final: bool) -> bool:
        return self._steps[self._state](final)

    def _final_arguments(self) -> str:
        raw = self._args.raw.strip(WS) if self._args is not None else ""
        return raw[: -len(FENCE)].rstrip(WS) if raw.endswith(FENCE) else raw

    def _fail(self) -> bool:
        """Not a call: the held text is text, and scanning goes on at this character."""
        self._release()
        self._state = TEXT
        return True

    def _start_call(self) -> None:
        self._head, self._name, self._name_padded = "", "", False
        self._state = HEAD

    def _on_text(self, final: bool) -> bool:
        marker = self._scan_text(_TEXT_MARKERS, final)
        if marker is None:
            return False
        self._start_holding()
        self._take(len(marker))
        if marker == CALLS_BEGIN:
            self._state = BLOCK
        else:
            self._start_call()  # no calls-begin: tolerated
        return True

    def _on_block(self, final: bool) -> bool:
        self._skip_ws()
        if self._pos == len(self._buf):
            return False
        marker = match_marker(self._buf, self._pos, _BLOCK_MARKERS, final)
        if marker == MORE:
            return False
        if marker is None:
            return self._fail()
        self._take(len(marker))
        if marker == CALL_BEGIN:
            self._start_call()
        else:
            if self._held.startswith(CALLS_BEGIN):  # no call in the block: it was text
                self._release()
            self._holding, self._held = False, ""  # whitespace between calls was markup
            self._state = TEXT
        return True

    def _on_head(self, final: bool) -> bool:
        c = self._buf[self._pos]
        if c == "<":
            marker = match_marker(self._buf, self._pos, (SEP,), final)
            if marker == MORE:
                return False
            if marker is None:
                return self._fail()
            self._take(len(SEP))
            if self._head == _TYPE:
                self._state = NAME
            elif self._is_tool(self._head):  # V3.1: the name, then the arguments
                self._begin(self._head)
                self._args, self._state = ArgsStream(), ARGS
            else:
                return self._fail()
            return True
        head = self._head + c
        if not (_TYPE.startswith(head) or self._is_tool_prefix(head)):
            return self._fail()
        self._head = head
        self._take(1)
        return True

    def _on_name(self, final: bool) -> bool:
        c = self._buf[self._pos]
        if c in _NAME_ENDS:
            if not self._is_tool(self._name):
                return self._fail()
            if c == "\n":
                self._take(1)
            self._begin(self._name)
            self._args, self._state = ArgsStream(), OPEN_FENCE
        elif c in _NAME_PAD:
            self._take(1)
            self._name_padded = bool(self._name)
        elif self._name_padded or not self._is_tool_prefix(self._name + c):
            return self._fail()
        else:
            self._name += c
            self._take(1)
        return True

    def _on_fence(self, final: bool) -> bool:
        self._skip_ws()
        rest = self._buf[self._pos : self._pos + len(FENCE)]
        if rest == FENCE:
            self._take(len(FENCE))
            self._state = LANG
        elif FENCE.startswith(rest) and not final:
            return False
        else:
            self._state = ARGS  # no fence: tolerated
        return True

    def _on_lang(self, final: bool) -> bool:
        buf, i = self._buf, self._pos
        while i < len(buf) and buf[i].isascii() and buf[i].isalnum():
            i += 1
        self._take(i - self._pos)
        if i == len(buf):
            return False
        self._state = ARGS
        return True

    def _on_args(self, final: bool) -> bool:
        buf, pos = self._buf, self._pos
        end, marker = len(buf), None
        for m in _ARGS_ENDS:
            i = buf.find(m, pos, end + len(m))
            if i != -1 and i < end:
                end, marker = i, m
        if marker is None and not final:
            end -= holdback(buf, pos, _ARGS_ENDS)
        assert self._args is not None
        self._pos = self._args.push(buf, pos, end, stop_when_complete=False)
        self._flush_args()
        if marker is None:
            return False
        self._end_call(self._final_arguments())
        if marker == CALLS_END:
            self._take(len(marker))
            self._state = TEXT
        else:  # a call end, or (end missing) the next call's begin, read in the block
            if marker == CALL_END:
                self._take(len(marker))
            self._start_holding()
            self._state = BLOCK
        return True
