"""IncrementalDetokenizer with tiny-coder's real byte-level BPE tokenizer."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer

from shared.models import BUNDLED_MODEL_DIR
from worker.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(BUNDLED_MODEL_DIR / "tokenizer.json"))


def stream(detok: IncrementalDetokenizer, ids: list[int], step: int = 1) -> list[str]:
    deltas = [detok.push(ids[i : i + step]) for i in range(0, len(ids), step)]
    return [*deltas, detok.flush()]


@pytest.mark.parametrize("seed", range(8))
def test_random_ids_concatenate_to_the_full_decode(tokenizer: Tokenizer, seed: int) -> None:
    # Random ids over the whole vocabulary: byte tokens (0x80-0xFF) make invalid UTF-8 and
    # split characters, special and added tokens appear too.
    rng = random.Random(seed)
    ids = [rng.randrange(tokenizer.get_vocab_size()) for _ in range(300)]
    step = rng.choice([1, 1, 2, 5])
    detok = IncrementalDetokenizer(tokenizer)
    deltas = stream(detok, ids, step)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)
    # Mid-stream deltas may carry the replacement character of genuinely invalid bytes, but
    # never end in one: that could still be a character whose next bytes are on the way.
    assert not any(d.endswith(REPLACEMENT_CHAR) for d in deltas[:-1])


def test_special_tokens_can_be_kept(tokenizer: Tokenizer) -> None:
    ids = [0, *tokenizer.encode("x = 1").ids, 1]
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
    assert "".join(stream(detok, ids)) == tokenizer.decode(ids, skip_special_tokens=False)
    skipped = IncrementalDetokenizer(tokenizer)
    assert "".join(stream(skipped, ids)) == "x = 1"


def test_multi_byte_characters_are_never_split(tokenizer: Tokenizer) -> None:
    text = "héllo 世界 🎉"
    ids = tokenizer.encode(text).ids
    assert len(ids) > len(text.split())  # the characters really are split across tokens
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.push([i]) for i in ids]
    assert all(REPLACEMENT_CHAR not in d for d in deltas)
    assert "".join(deltas) == text
    assert detok.flush() == ""


def test_an_incomplete_last_character_is_released_by_flush(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("a🎉").ids[:-1]  # cut inside the emoji's bytes
    detok = IncrementalDetokenizer(tokenizer)
    assert "".join(detok.push([i]) for i in ids) == "a"
    rest = detok.flush()
    assert rest == tokenizer.decode(ids)[1:]
    assert rest.startswith(REPLACEMENT_CHAR)
    assert detok.flush() == ""


def test_stop_string_split_across_pushes(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("def f():\n    return 1\n\ndef g():").ids
    detok = IncrementalDetokenizer(tokenizer, stop=["\n\ndef"])
    deltas = [detok.push([i]) for i in ids]
    assert detok.stopped
    assert "".join(deltas) == "def f():\n    return 1"
    assert detok.push(tokenizer.encode(" more").ids) == ""
    assert detok.flush() == ""


def test_stop_string_inside_one_token_cuts_the_delta(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("return self.name").ids
    detok = IncrementalDetokenizer(tokenizer, stop=["elf"])
    assert "".join(stream(detok, ids, step=len(ids))) == "return s"
    assert detok.stopped


def test_stop_string_at_the_very_start(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("STOP and more text").ids
    detok = IncrementalDetokenizer(tokenizer, stop=["STOP"])
    deltas = [detok.push([i]) for i in ids]
    assert detok.stopped
    assert deltas == [""] * len(ids)
    assert detok.flush() == ""


def test_a_possible_stop_start_is_held_until_decided(tokenizer: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tokenizer, stop=["<END>"])
    assert detok.push(tokenizer.encode("x <E").ids) == "x "
    assert detok.num_held_chars == 2
    assert detok.push(tokenizer.encode("ND>").ids) == ""  # "<END>" completed: nothing more
    assert detok.stopped
    other = IncrementalDetokenizer(tokenizer, stop=["<END>"])
    assert other.push(tokenizer.encode("x <E").ids) == "x "
    assert other.push(tokenizer.encode("lse").ids) == "<Else"  # decided: not a stop
    assert not other.stopped


def test_earliest_of_several_stop_strings_wins(tokenizer: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tokenizer, stop=["world", "lo w", ""])
    assert "".join(stream(detok, tokenizer.encode("hello world").ids)) == "hel"


def test_no_stop_flush_completes_the_text(tokenizer: Tokenizer) -> None:
    text = "for i in range(10):\n    print(i)  # <EN"
    ids = tokenizer.encode(text).ids
    detok = IncrementalDetokenizer(tokenizer, stop=["<END>"])
    deltas = [detok.push([i]) for i in ids]
    assert "".join(deltas) == text[: -len("<EN")]
    assert detok.flush() == "<EN"
    assert not detok.stopped
    assert detok.flush() == ""
