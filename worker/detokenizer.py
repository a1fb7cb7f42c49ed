"""Incremental detokenization: token ids in, text deltas out, with stop strings.

Decoding every token alone breaks text: byte-level BPE splits a multi-byte character across
tokens (tiny-coder encodes "世" as three tokens, each decoding to U+FFFD alone), and
SentencePiece-style decoders drop a token's leading space without its left neighbour.
Decoding the whole sequence at every step is correct but O(n) per token. The standard fix
(vLLM's, from HF text-generation-inference) keeps two offsets into the ids:

- `prefix_offset`: where the decode window starts (a little context to the left);
- `read_offset`: where the text already emitted ends.

Each push decodes `ids[prefix_offset:]` and emits what lies past `decode(ids[prefix_offset:
read_offset])`, unless the window's text ends in U+FFFD (an incomplete UTF-8 sequence: wait
for the next token). Both offsets only ever sit where the decoded text ended cleanly, so the
window is a few tokens and the deltas concatenate to exactly the full decode, replacement
characters of genuinely invalid bytes included (`flush` releases a trailing one).

Special tokens (tiny-coder: bos, eos, pad) are skipped by default: the caller streams what a
user reads. Added tokens that are not special (`<think>`, the chat and tool markers) stay.

Stop strings: text that could be the start of a stop string is held back until decided; once
the text contains one, the delta ends right before it and `stopped` turns True. Only held-back
text can contain the start of a match (released text never ends in a stop string's prefix),
so each push searches only the new and held-back text.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from tokenizers import Tokenizer

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """One sequence's detokenizer: `push(ids)` returns the new text, `flush()` the rest."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stop = tuple(s for s in stop if s)  # an empty stop string would match everywhere
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._prefix_text = ""
        self._held = ""  # decoded text withheld because it may start a stop string
        self.stopped = False
        self.matched_stop: str | None = None  # the stop string that ended the text
        self.num_tokens = 0  # ids pushed (prompt context excluded)
        self._owed = ""  # text a resumed stream still owes its reader (see `resume`)
        self._num_skip_chars = 0  # text the reader already has that a push would repeat

    # -- the token -> text window --------------------------------------------------------
    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=self._skip_special_tokens)

    def _advance(self, *, final: bool) -> str:
        """Text of the ids pushed since the last clean point; '' while it ends mid-character
        (unless `final`: then the trailing replacement characters are the text)."""
        window_text = self._decode(self._ids[self._prefix_offset :])
        if len(window_text) <= len(self._prefix_text):
            return ""
        if window_text.endswith(REPLACEMENT_CHAR) and not final:
            return ""
        delta = window_text[len(self._prefix_text) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        return delta

    # -- the text -> released text filter (stop strings) ------------------------------------
    def _release(self, text: str, *, final: bool) -> str:
        if not self._stop:
            return text
        pending = self._held + text
        found = [(i, stop) for stop in self._stop if (i := pending.find(stop)) >= 0]
        if found:
            cut, self.matched_stop = min(found, key=lambda f: f[0])
            self.stopped = True
            self._held = ""
            return pending[:cut]
        num_held = 0 if final else self._num_stop_prefix_chars(pending)
        self._held = pending[len(pending) - num_held :] if num_held else ""
        return pending[: len(pending) - num_held]

    def _num_stop_prefix_chars(self, text: str) -> int:
        """Length of the longest end of `text` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self._stop:
            for length in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:length]):
                    longest = length
                    break
        return longest

    # -- public ------------------------------------------------------------------------------
    def resume(self, token_ids: Sequence[int], num_chars_delivered: int) -> None:
        """Continue another worker's stream (a failover): `token_ids` are the output it
        streamed and `num_chars_delivered` the text its reader got. Replayed one id at a
        time, as that worker pushed them, to reach its offsets and held-back text; the
        deltas from here on start exactly where the reader's text ends."""
        released = "".join(self.push([token_id]) for token_id in token_ids)
        if len(released) >= num_chars_delivered:
            self._owed = released[num_chars_delivered:]
        else:
            self._num_skip_chars = num_chars_delivered - len(released)

    def _settle(self, text: str) -> str:
        """A resumed stream's first deltas: what it owes first, what the reader has left out."""
        text, self._owed = self._owed + text, ""
        skip = min(self._num_skip_chars, len(text))
        self._num_skip_chars -= skip
        return text[skip:]

    def push(self, token_ids: Iterable[int]) -> str:
        """Add generated ids; return the text they complete (possibly ''). After a stop
        string matched, ids are ignored and the delta is always ''."""
        if self.stopped:
            return ""
        new_ids = [int(i) for i in token_ids]
        self._ids.extend(new_ids)
        self.num_tokens += len(new_ids)
        return self._settle(self._release(self._advance(final=False), final=False))

    def flush(self) -> str:
        """The end of the sequence: whatever was held back (a stop string's possible start,
        replacement characters of an incomplete final character). Safe to repeat."""
        if self.stopped:
            return ""
        return self._settle(self._release(self._advance(final=True), final=True))

    @property
    def num_held_chars(self) -> int:
        """Characters decided but held back because they may start a stop string."""
        return len(self._held)
