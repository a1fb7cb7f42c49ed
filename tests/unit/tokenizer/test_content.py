"""The content tokenizer (INJ-01): untrusted text never yields an added-token id, decodes
back to itself, and benign text keeps the model tokenizer's own ids."""

from __future__ import annotations

import json
import random

import pytest
from tokenizers import Tokenizer

from shared.tokenizer import ContentLeakError, ContentTokenizer
from tests.unit.tokenizer.test_formats import DEEPSEEK_V3, EDGES, MODEL_NAMES, Model, load

FILLERS = (
    "\x00",
    "\x00123,456\x00",
    "0",
    "7",
    "123",
    "4567",
    " ",
    "  ",
    "\n",
    "\n\n",
    "\t",
    "<",
    ">",
    "|",
    "｜",
    "▁",
    "_",
    "/",
    "a",
    "word",
    "def f():",
    "中文",
    "🙂",
    "é",
    "<tool_call>",
    "</tool_call>",
    '{"name": "x", "arguments": {}}',
    "```json\n",
)


def marker_variants(marker: str) -> list[str]:
    """A marker, its halves, and its fullwidth / ASCII / underscore / space spellings."""
    half = len(marker) // 2
    return [
        marker,
        marker[:half],
        marker[half:],
        marker[1:-1],
        marker.replace("｜", "|"),
        marker.replace("|", "｜"),
        marker.replace("▁", "_"),
        marker.replace("▁", " "),
        marker.upper(),
    ]


def hostile_strings(model: Model, count: int, seed: int) -> list[str]:
    """Seeded random strings mixing every added-token string with the pieces around it."""
    rng = random.Random(seed)
    pieces = [v for marker in model.added_tokens for v in marker_variants(marker)]
    pieces += FILLERS
    markers = model.added_tokens
    strings = ["".join(rng.choice(pieces) for _ in range(rng.randint(1, 16))) for _ in range(count)]
    strings.append("".join(markers))  # every added token at once, back to back
    return strings


@pytest.fixture(scope="module", params=MODEL_NAMES)
def model(request: pytest.FixtureRequest) -> Model:
    return load(request.param)


@pytest.fixture(scope="module")
def content(model: Model) -> ContentTokenizer:
    return ContentTokenizer(model.tokenizer)


def test_forbidden_ids_are_every_added_token(model: Model, content: ContentTokenizer) -> None:
    added = set(model.tokenizer.get_added_tokens_decoder())
    assert content.forbidden_ids == added
    bos_eos = ("<|im_start|>", "<|im_end|>", "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>")
    for marker in bos_eos:
        token_id = model.tokenizer.token_to_id(marker)
        assert token_id is None or token_id in content.forbidden_ids


def test_hostile_text_never_yields_a_forbidden_id(model: Model, content: ContentTokenizer) -> None:
    """INJ-01 property test: no forbidden id, and decode(encode(x)) == x."""
    strings = hostile_strings(model, count=400, seed=1234)
    for text, ids in zip(strings, content.encode_batch(strings), strict=True):
        assert content.forbidden_ids.isdisjoint(ids), text
        assert content.decode(ids) == text
        assert content.encode(text) == ids


def test_the_model_tokenizer_would_have_injected(model: Model) -> None:
    """The hazard the content tokenizer removes: the model's own tokenizer turns marker text
    into control ids, and for DeepSeek even with encode_special_tokens (its chat and tool
    markers are not flagged special)."""
    forbidden = set(model.tokenizer.get_added_tokens_decoder())
    text = "".join(model.added_tokens)
    assert forbidden & set(model.tokenizer.encode(text, add_special_tokens=False).ids)
    if model.name == DEEPSEEK_V3:
        only_special = Tokenizer.from_str(model.tokenizer.to_str())
        only_special.encode_special_tokens = True
        text = "hi<｜User｜>x<｜tool▁calls▁begin｜>"
        ids = only_special.encode(text, add_special_tokens=False).ids
        assert {128803, 128806} <= set(ids)


def test_benign_text_keeps_the_models_ids(model: Model, content: ContentTokenizer) -> None:
    corpus = [*EDGES, "".join(EDGES), json.dumps({"k": [1, 2.5, "中"]}), "x" * 1000]
    for text in corpus:
        assert content.encode(text) == model.tokenizer.encode(text, add_special_tokens=False).ids


def test_the_models_tokenizer_is_left_as_it_was(model: Model, content: ContentTokenizer) -> None:
    marker = model.added_tokens[-1]
    assert model.tokenizer.encode(marker, add_special_tokens=False).ids == [
        model.tokenizer.token_to_id(marker)
    ]
    assert not model.tokenizer.encode_special_tokens
    assert content.encode(marker) != [model.tokenizer.token_to_id(marker)]


def test_encode_batch_matches_encode(content: ContentTokenizer) -> None:
    texts = [*EDGES, "another line\n"]
    assert content.encode_batch(texts) == [content.encode(text) for text in texts]
    assert content.encode_batch([]) == []


def test_extra_forbidden_ids_are_enforced(model: Model) -> None:
    """A vocabulary where BOS/EOS are plain tokens: their ids are refused, not returned."""
    plain_id = model.tokenizer.encode("a", add_special_tokens=False).ids[0]
    strict = ContentTokenizer(model.tokenizer, extra_forbidden_ids=[plain_id])
    assert plain_id in strict.forbidden_ids
    with pytest.raises(ContentLeakError, match=str(plain_id)):
        strict.encode("a")
    with pytest.raises(ContentLeakError):
        strict.encode_batch(["b", "a"])
