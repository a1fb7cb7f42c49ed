"""An incremental recogniser of JSON prefixes, and the argument stream built on it.

Anthropic's SDK parses the joined `input_json_delta` fragments with a partial-mode JSON parser
(jiter) after every delta, and OpenAI clients do the same to show arguments as they arrive, so
every fragment a parser sends must leave the joined text a prefix of some valid JSON object.
`JsonPrefix` checks that one character at a time (no backtracking, no re-parse), which is also
what tells the chatml parser where an arguments value ends.

Arguments must be a JSON object (both OpenAI and Anthropic require one; jiter's partial mode
also rejects unfinished top-level scalars such as `tr` or `-`). When the model writes something
else, the stream stops growing at the last valid prefix and the call's `ToolCallEnd` carries
the raw text (each format says how it cuts it out): the client still sees what the model
wrote, and the fragments it has stay parseable.
"""

from __future__ import annotations

WS = " \t\n\r"  # JSON whitespace

# Modes of JsonPrefix. NUM_* are the states of the number grammar (RFC 8259 section 6).
(
    START,
    VALUE,
    ARR_FIRST,
    OBJ_FIRST,
    OBJ_KEY,
    COLON,
    AFTER,
    STR,
    ESC,
    HEX,
    LIT,
    DONE,
    BAD,
    NUM_SIGN,
    NUM_ZERO,
    NUM_INT,
    NUM_DOT,
    NUM_FRAC,
    NUM_E,
    NUM_ESIGN,
    NUM_EXP,
) = range(21)
_NUM_END_OK = (NUM_ZERO, NUM_INT, NUM_FRAC, NUM_EXP)  # a number may stop here
_DIGITS = "0123456789"
_HEX = "0123456789abcdefABCDEF"
_ESCAPES = '"\\/bfnrt'
_LITERALS = {"t": "rue", "f": "alse", "n": "ull"}


class JsonPrefix:
    """Accepts characters while the text so far can still be completed to valid JSON.

    `num_valid` counts the accepted characters (once a character is rejected the recogniser
    stays BAD); `num_valid_nonws` is the length of the accepted text without its trailing
    whitespace, which is where a fragment may end (no whitespace-only fragments).
    """

    __slots__ = (
        "_in_key",
        "_lit",
        "_mode",
        "_num_hex",
        "_objects_only",
        "_stack",
        "first_nonws",
        "num_valid",
        "num_valid_nonws",
    )

    def __init__(self, *, objects_only: bool = True) -> None:
        self._objects_only = objects_only
        self._mode = START
        self._stack: list[str] = []  # "{" or "["
        self._in_key = False
        self._lit = ""
        self._num_hex = 0
        self.num_valid = 0
        self.num_valid_nonws = 0
        self.first_nonws: int | None = None

    @property
    def complete(self) -> bool:
        return self._mode == DONE

    @property
    def valid(self) -> bool:
        return self._mode != BAD

    def advance(self, text: str, start: int, stop: int, *, stop_when_complete: bool) -> int:
        """Consume text[start:stop]; return where it stopped: `stop`, the first rejected
        character, or (with stop_when_complete) just after the value's end."""
        i = start
        while i < stop:
            if self._mode == BAD or (stop_when_complete and self._mode == DONE):
                return i
            c = text[i]
            if not self._accept(c):
                if self._mode == BAD:
                    return i
                if self._mode == DONE and stop_when_complete:
                    return i  # a top-level number ended at c, which belongs to the caller
                if not self._accept(c):  # the number ended; c starts what follows it
                    return i
            self.num_valid += 1
            if c not in WS:
                if self.first_nonws is None:
                    self.first_nonws = self.num_valid - 1
                self.num_valid_nonws = self.num_valid
            i += 1
        return i

    def _close_value(self) -> None:
        self._mode = AFTER if self._stack else DONE

    def _accept(self, c: str) -> bool:
        """One character; False when it does not continue the text (the mode is then BAD),
        or when it ends a number: then the mode has moved past the number and c must be
        offered again, as the start of what follows."""
        mode = self._mode
        if mode == BAD:
            return False
        if mode == STR:
            if c == '"':
                if self._in_key:
                    self._mode = COLON
                else:
                    self._close_value()
            elif c == "\\":
                self._mode = ESC
            elif c < " ":
                self._mode = BAD
            return self._mode != BAD
        if mode >= NUM_SIGN:
            return self._number(mode, c)
        if mode == ESC:
            if c == "u":
                self._mode, self._num_hex = HEX, 4
            elif c in _ESCAPES:
                self._mode = STR
            else:
                self._mode = BAD
        elif mode == HEX:
            if c not in _HEX:
                self._mode = BAD
            else:
                self._num_hex -= 1
                if self._num_hex == 0:
                    self._mode = STR
        elif mode == LIT:
            if c != self._lit[0]:
                self._mode = BAD
            else:
                self._lit = self._lit[1:]
                if not self._lit:
                    self._close_value()
        elif c in WS:
            pass  # between tokens, whatever the structural mode
        elif mode == AFTER:
            top = self._stack[-1]
            if c == ",":
                self._mode = OBJ_KEY if top == "{" else VALUE
            elif (c == "}" and top == "{") or (c == "]" and top == "["):
                self._stack.pop()
                self._close_value()
            else:
                self._mode = BAD
        elif mode in (OBJ_FIRST, OBJ_KEY):
            if c == '"':
                self._mode, self._in_key = STR, True
            elif c == "}" and mode == OBJ_FIRST:
                self._stack.pop()
                self._close_value()
            else:
                self._mode = BAD
        elif mode == COLON:
            self._mode = VALUE if c == ":" else BAD
        elif mode == ARR_FIRST and c == "]":
            self._stack.pop()
            self._close_value()
        elif mode in (VALUE, ARR_FIRST) or (mode == START and (c == "{" or not self._objects_only)):
            self._value(c)
        else:  # START with a non-object, or anything after DONE
            self._mode = BAD
        return self._mode != BAD

    def _value(self, c: str) -> None:
        if c == "{" or c == "[":
            self._stack.append(c)
            self._mode = OBJ_FIRST if c == "{" else ARR_FIRST
        elif c == '"':
            self._mode, self._in_key = STR, False
        elif c == "-":
            self._mode = NUM_SIGN
        elif c in _DIGITS:
            self._mode = NUM_ZERO if c == "0" else NUM_INT
        elif c in _LITERALS:
            self._mode, self._lit = LIT, _LITERALS[c]
        else:
            self._mode = BAD

    def _number(self, mode: int, c: str) -> bool:
        digit = c in _DIGITS
        if mode == NUM_SIGN and digit:
            self._mode = NUM_ZERO if c == "0" else NUM_INT
        elif (mode == NUM_INT and digit) or (mode in (NUM_DOT, NUM_FRAC) and digit):
            self._mode = NUM_INT if mode == NUM_INT else NUM_FRAC
        elif mode in (NUM_E, NUM_ESIGN, NUM_EXP) and digit:
            self._mode = NUM_EXP
        elif mode in (NUM_ZERO, NUM_INT) and c == ".":
            self._mode = NUM_DOT
        elif mode in (NUM_ZERO, NUM_INT, NUM_FRAC) and c in "eE":
            self._mode = NUM_E
        elif mode == NUM_E and c in "+-":
            self._mode = NUM_ESIGN
        elif mode in _NUM_END_OK and not digit:
            self._close_value()  # the number ended before c; c is offered again
            return False
        else:
            self._mode = BAD
        return self._mode != BAD


class ArgsStream:
    """One call's arguments as they arrive: the raw text, and the fragments to send.

    Fragments run from the first non-whitespace character to the end of the longest valid
    prefix without its trailing whitespace, so each is a strict suffix of what was sent, never
    whitespace only, and their join is a JSON prefix. For valid arguments the join is the
    whole value; for invalid ones it stops at the last valid prefix (see the module docstring).
    """

    __slots__ = ("_checker", "_num_sent", "raw")

    def __init__(self) -> None:
        self.raw = ""
        self._checker = JsonPrefix()
        self._num_sent = 0  # end of what take() returned, in `raw`; 0 before the first

    @property
    def sent(self) -> str:
        """Everything take() has returned, joined."""
        first = self._checker.first_nonws
        return "" if first is None or self._num_sent == 0 else self.raw[first : self._num_sent]

    @property
    def complete(self) -> bool:
        return self._checker.complete

    @property
    def valid(self) -> bool:
        return self._checker.valid

    def push(self, text: str, start: int, stop: int, *, stop_when_complete: bool) -> int:
        """Take text[start:stop] (up to the value's end with stop_when_complete); return the
        position after what was taken."""
        end = self._checker.advance(text, start, stop, stop_when_complete=stop_when_complete)
        if not (stop_when_complete and self._checker.complete):
            end = stop  # invalid or still open: everything up to `stop` is argument text
        self.raw += text[start:end]
        return end

    def take(self) -> str:
        """The fragment not sent yet ("" when there is none)."""
        first = self._checker.first_nonws
        if first is None:
            return ""
        begin = max(self._num_sent, first)
        end = self._checker.num_valid_nonws
        if end <= begin:
            return ""
        self._num_sent = end
        return self.raw[begin:end]


def is_json_object(text: str) -> bool:
    """Whether `text` is exactly one JSON object (strict RFC 8259: no NaN, no trailing text)."""
    checker = JsonPrefix()
    return checker.advance(text, 0, len(text), stop_when_complete=False) == len(text) and (
        checker.complete
    )
