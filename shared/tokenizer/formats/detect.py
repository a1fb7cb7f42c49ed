"""`format_for`: which renderer a model's chat template belongs to, read from its markers.

The family is recognised, not the exact template: a template that writes DeepSeek's
`<｜User｜>` / `<｜Assistant｜>` markers is rendered by DeepSeekV3, one that writes
`<|im_start|>` by ChatML (with the default system prompt the template inserts, if any). A
template with neither is refused with a typed error rather than guessed at; the renderers'
own tests pin them to the served models' templates byte for byte.
"""

from __future__ import annotations

import re
from typing import Protocol

from tokenizers import Tokenizer

from shared.tokenizer.formats.base import ChatFormat, ChatFormatError, UnknownChatFormatError
from shared.tokenizer.formats.chatml import IM_START, ChatML
from shared.tokenizer.formats.deepseek_v3 import ASSISTANT, USER, DeepSeekV3

# A ChatML template's default system prompt: the literal system turn it writes (Jinja string
# literals hold a real newline or the escape `\n`; a quote or `{` ends the literal).
_DEFAULT_SYSTEM = re.compile(r"<\|im_start\|>system(?:\n|\\n)([^'\"{}<]+)<\|im_end\|>")


class _Template(Protocol):
    template: str


class _Checkpoint(Protocol):
    def tokenizer(self) -> Tokenizer: ...
    def chat_template(self) -> _Template: ...


def format_family(template: str) -> type[ChatFormat]:
    if USER in template and ASSISTANT in template:
        return DeepSeekV3
    if IM_START in template:
        return ChatML
    raise UnknownChatFormatError(
        "chat template matches no known family (chatml: <|im_start|>; "
        "deepseek-v3: <｜User｜> and <｜Assistant｜>)"
    )


def format_for(
    checkpoint_or_template_text: _Checkpoint | _Template | str,
    tokenizer: Tokenizer | None = None,
) -> ChatFormat:
    """The renderer for a Checkpoint (its template and tokenizer), a ChatTemplate or the
    template text; the last two need the model's tokenizer, for the control-token ids."""
    source = checkpoint_or_template_text
    if isinstance(source, str):
        template = source
    elif hasattr(source, "chat_template") and hasattr(source, "tokenizer"):
        template = source.chat_template().template
        tokenizer = tokenizer if tokenizer is not None else source.tokenizer()
    else:
        template = source.template
    family = format_family(template)
    if tokenizer is None:
        raise ChatFormatError(f"{family.name}: a template alone needs tokenizer= for its ids")
    if family is ChatML:
        match = _DEFAULT_SYSTEM.search(template)
        return ChatML(tokenizer, default_system_prompt=match.group(1) if match else "")
    return family(tokenizer)
