"""A `tokenizers.Tokenizer` built from a GGUF file's vocabulary (the `tokenizer.ggml.*` keys).

Byte-level BPE (`tokenizer.ggml.model` = "gpt2") only: the vocabulary and merges are the file's,
the tokens llama.cpp marks CONTROL become special added tokens (so `<|im_start|>` is one id and
`decode(..., skip_special_tokens=True)` drops it), USER_DEFINED ones plain added tokens, as
transformers 5.24's GGUF converter (integrations/gguf/gguf_tokenizer_mapping.py) does.

The pre-tokenizer follows `tokenizer.ggml.pre`, llama.cpp's name for the split a vocabulary was
trained with. "smollm" is llama.cpp's two passes, every number character split off (`\\p{N}`)
and then GPT-2's regex: the split of SmolLM's HF tokenizer (Digits(individual_digits=True),
then ByteLevel) that llama.cpp's converter recognised it by. transformers has no entry for
"smollm" and falls back to GPT-2's regex alone; the two differ only where 2+ whitespace
characters precede a digit, as in indented code: "\\n    1" is ["\\n    ", "1"] here (and in
llama.cpp), ["\\n   ", " ", "1"] in transformers, so other ids.

Building it for SmolLM2 (49,152 tokens, 48,900 merges) takes 0.25 s after the 0.11 s metadata
read on a 2-core box; transformers' AutoTokenizer takes 5.9 s there for the same file.
"""

from __future__ import annotations

from functools import cache

from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers, processors
from tokenizers.models import BPE

from worker.engine.errors import CheckpointError, UnsupportedModelError
from worker.engine.gguf import GGUFFile

CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types

# The regexes transformers' converter uses for these `tokenizer.ggml.pre` values (qwen2 also
# covers qwen3 files); "gpt2" is ByteLevel's built-in GPT-2 regex.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_REGEX_SPLITS = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}
SUPPORTED_PRE_TOKENIZERS = ("gpt2", "smollm", *_REGEX_SPLITS)


@cache
def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map, the spelling of byte-level vocabularies."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    extra = (b for b in range(256) if b not in printable)
    return {
        **{b: chr(b) for b in printable},
        **{b: chr(256 + i) for i, b in enumerate(extra)},
    }


def pre_tokenizer(name: str, source: str) -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer llama.cpp means by `tokenizer.ggml.pre` = `name`."""
    if name == "gpt2":
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if name == "smollm":
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    if name in _REGEX_SPLITS:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_REGEX_SPLITS[name]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    raise UnsupportedModelError(
        f"{source}: field 'tokenizer.ggml.pre' = {name!r} is not supported "
        f"(supported: {', '.join(SUPPORTED_PRE_TOKENIZERS)})"
    )


def tokenizer_from_gguf(gguf: GGUFFile) -> Tokenizer:
    """The file's tokenizer: same ids as llama.cpp, and as transformers but for "smollm"."""
    src = str(gguf.path)
    model = gguf.require("tokenizer.ggml.model")
    if model != "gpt2":
        raise UnsupportedModelError(
            f"{src}: field 'tokenizer.ggml.model' = {model!r} is not supported (gpt2 only)"
        )
    pre = pre_tokenizer(gguf.metadata.get("tokenizer.ggml.pre", "gpt2"), src)
    tokens: list[str] = gguf.require("tokenizer.ggml.tokens")
    types: list[int] = gguf.metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(types) != len(tokens):
        raise CheckpointError(
            f"{src}: field 'tokenizer.ggml.token_type' has {len(types)} entries for "
            f"{len(tokens)} tokens"
        )
    spelling = byte_alphabet()
    alphabet = set(spelling.values())
    # A token written in real characters instead of the byte alphabet is respelled, as
    # transformers does; the merges are in the byte alphabet already.
    vocab = {
        tok if set(tok) <= alphabet else "".join(spelling[b] for b in tok.encode()): i
        for i, tok in enumerate(tokens)
    }
    if len(vocab) != len(tokens):
        raise CheckpointError(f"{src}: field 'tokenizer.ggml.tokens' has duplicate tokens")
    merges = [tuple(merge.split(" ", 1)) for merge in gguf.require("tokenizer.ggml.merges")]
    tokenizer = Tokenizer(
        BPE(vocab=vocab, merges=merges, continuing_subword_prefix="", end_of_word_suffix="")
    )
    tokenizer.pre_tokenizer = pre
    tokenizer.decoder = decoders.ByteLevel()
    # A CONTROL token outside the byte alphabet is a llama.cpp mislabel; transformers skips it
    # too, since adding it would grow the vocabulary past the embedding.
    tokenizer.add_special_tokens(
        [
            AddedToken(tok, special=True, normalized=False)
            for tok, kind in zip(tokens, types, strict=True)
            if kind == CONTROL and set(tok) <= alphabet
        ]
    )
    tokenizer.add_tokens(
        [
            AddedToken(tok, special=False, normalized=False)
            for tok, kind in zip(tokens, types, strict=True)
            if kind == USER_DEFINED and tok in vocab
        ]
    )
    tokenizer.post_processor = _post_processor(gguf)
    return tokenizer


def special_token(gguf: GGUFFile, key: str) -> str:
    """The text of the token `tokenizer.ggml.<key>` names ("" when the file names none)."""
    tokens = gguf.metadata.get("tokenizer.ggml.tokens", [])
    token_id = gguf.metadata.get(f"tokenizer.ggml.{key}")
    if token_id is None:
        return ""
    if not 0 <= token_id < len(tokens):
        raise CheckpointError(
            f"{gguf.path}: field 'tokenizer.ggml.{key}' = {token_id} is not a token id "
            f"(the vocabulary has {len(tokens)})"
        )
    return tokens[token_id]


def _post_processor(gguf: GGUFFile) -> processors.TemplateProcessing:
    # add_bos_token / add_eos_token: what encode(..., add_special_tokens=True) wraps a text in.
    meta = gguf.metadata
    template, special = ["$A"], []
    for flag, key in (("add_bos_token", "bos_token_id"), ("add_eos_token", "eos_token_id")):
        if meta.get(f"tokenizer.ggml.{flag}") and f"tokenizer.ggml.{key}" in meta:
            text = special_token(gguf, key)
            template.insert(0 if key == "bos_token_id" else len(template), text)
            special.append((text, meta[f"tokenizer.ggml.{key}"]))
    return processors.TemplateProcessing(single=template, special_tokens=special)
