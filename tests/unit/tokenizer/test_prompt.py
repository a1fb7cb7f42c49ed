"""PromptTokenizer: control ids come only from the skeleton (INJ-01, INJ-04), the prefix
property (PC-01), remembered outputs (PC-06) and the segment cache."""

from __future__ import annotations

import random
import threading
from collections.abc import Sequence
from dataclasses import replace

import pytest

from shared.tokenizer import (
    Chat,
    ContentTokenizer,
    Control,
    InvalidTextError,
    Message,
    PromptError,
    PromptTokenizer,
    Text,
    Tool,
    ToolCall,
    ToolChoice,
)
from tests.unit.tokenizer.test_content import hostile_strings
from tests.unit.tokenizer.test_formats import (
    MODEL_NAMES,
    SMOLLM2,
    TINY_CODER,
    TOOLS,
    Model,
    load,
    plain_chats,
)


@pytest.fixture(scope="module", params=MODEL_NAMES)
def model(request: pytest.FixtureRequest) -> Model:
    return load(request.param)


@pytest.fixture(scope="module")
def content(model: Model) -> ContentTokenizer:
    return ContentTokenizer(model.tokenizer)


@pytest.fixture
def prompt(model: Model, content: ContentTokenizer) -> PromptTokenizer:
    """A fresh one per test (its segment cache and counters), over the module's vocabulary."""
    return PromptTokenizer(model.tokenizer, model.fmt, content=content)


def controls(prompt: PromptTokenizer, ids: list[int]) -> list[int]:
    return [i for i in ids if i in prompt.content.forbidden_ids]


def every_field(text: str, seed: int) -> Chat:
    """`text` in every user-controlled field (names are validated instead, see test_formats)."""
    rng = random.Random(seed)
    tools = (
        Tool("lookup", text, {"type": "object", "properties": {text: {"description": text}}}),
        Tool("run.cmd-2", text, {"enum": [text]}),
    )
    calls = (ToolCall(text, "lookup", text), ToolCall("id2", "run.cmd-2", '{"q": "' + text + '"}'))
    messages = (
        Message("system", text),
        Message("user", text),
        Message("assistant", text, tool_calls=calls[: rng.randint(1, 2)]),
        Message("tool", text, tool_call_id=text, name=text),
        Message("assistant", text),
        Message("user", text),
    )
    choice = rng.choice([ToolChoice(), ToolChoice("required"), ToolChoice("function", "lookup")])
    return Chat(messages, tools=tools, tool_choice=choice)


def test_hostile_text_in_every_field_leaves_the_skeleton(
    model: Model, prompt: PromptTokenizer
) -> None:
    """INJ-01: the prompt's control ids are exactly those of the same chat with plain text."""
    for seed, text in enumerate(hostile_strings(model, count=40, seed=99)):
        chat = every_field(text, seed)
        ids = prompt.encode(chat)
        assert controls(prompt, ids) == controls(prompt, prompt.encode(every_field("x", seed)))
        assert prompt.decode(ids) == model.fmt.render_text(chat)


def test_a_marker_cut_across_a_boundary_stays_text(model: Model, prompt: PromptTokenizer) -> None:
    """INJ-04: a marker cut at every position, one part in content and the other on the
    far side of a skeleton boundary (a control token, or skeleton text around arguments)."""

    def chat(left: str, right: str) -> Chat:
        call = ToolCall("c", "get_weather", right + "{}" + left)
        messages = (
            Message("system", "s" + left),
            Message("user", right + "u" + left),
            Message("assistant", right + "a" + left, tool_calls=(call,)),
            Message("tool", right + "t" + left),
            Message("assistant", right),
        )
        return Chat(messages, tools=TOOLS)

    skeleton = controls(prompt, prompt.encode(chat("x", "y")))
    for marker in sorted({*model.fmt.MARKERS, *model.added_tokens[:24]}):
        for cut in range(1, len(marker)):
            hostile = chat(marker[:cut], marker[cut:])
            ids = prompt.encode(hostile)
            assert controls(prompt, ids) == skeleton, (marker, cut)
            assert prompt.decode(ids) == model.fmt.render_text(hostile)


def conversation() -> tuple[Message, ...]:
    weather = ToolCall("c1", "get_weather", '{"city": "Paris"}')
    return (
        Message("system", "You are terse."),
        Message("user", "Hello\n\n"),
        Message("assistant", "Hi.\n\nHow can I help?  "),
        Message("user", "  weather in Paris? 中文 12345 🙂"),
        Message("assistant", "Checking.", tool_calls=(weather,)),
        Message("tool", "18 C"),
        Message("tool", "sunny"),
        Message("assistant", "18 C and sunny."),
        Message("user", "def f(x):\n    return x\n"),
        Message("assistant", "", tool_calls=(weather, replace(weather, id="c2"))),
        Message("tool", "ok"),
        Message("assistant", "Done 🚀"),
    )


def test_prefix_property_at_every_message_boundary(model: Model, prompt: PromptTokenizer) -> None:
    """PC-01. A conversation that ends in one tool result closes it (`<|im_end|>` /
    `<｜tool▁outputs▁end｜>`), which a second result re-opens: a boundary between two tool
    results is no prefix of anything later, in the models' templates as here."""
    messages = conversation()
    chat = Chat(messages, tools=TOOLS)
    full = [
        prompt.encode(replace(chat, messages=messages[:k]), add_generation_prompt=False)
        for k in range(len(messages) + 1)
    ]
    for k in range(1, len(messages)):  # from the system message on: it heads the prompt
        is_prefix = [full[k] == later[: len(full[k])] for later in full[k + 1 :]]
        between_tool_results = messages[k - 1].role == "tool" and messages[k].role == "tool"
        assert all(is_prefix) if not between_tool_results else not any(is_prefix), k


def units(segments: Sequence[Control | Text]) -> list[tuple[str, int | str]]:
    """Segments as a model writes them, one step at a time: a control id, or a character."""
    out: list[tuple[str, int | str]] = []
    for segment in segments:
        if isinstance(segment, Control):
            out += [("c", token_id) for token_id in segment.ids]
        else:
            out += [("t", char) for char in segment.text]
    return out


def generated_ids(prompt: PromptTokenizer, steps: list[tuple[str, int | str]]) -> list[int]:
    """Ids a model could have generated that BPE would not: one token per character."""
    ids: list[int] = []
    for _, value in steps:
        ids += [value] if isinstance(value, int) else prompt.content.encode(value)
    return ids


def test_generated_ids_are_spliced_back(
    model: Model, content: ContentTokenizer, prompt: PromptTokenizer
) -> None:
    """PC-01 / PC-06: generation prompt ids + generated ids prefix the next turn's ids."""
    messages = conversation()
    canonical = PromptTokenizer(model.tokenizer, model.fmt, content=content)
    stop = list(model.fmt.stop_token_ids)
    for k in [i for i, m in enumerate(messages) if m.role == "assistant"]:
        before = Chat(messages[:k], tools=TOOLS)
        prompt_ids = prompt.encode(before)
        reply = messages[k]
        output = generated_ids(prompt, units(model.fmt.render_body(reply).parts))
        assert prompt.remember_output(reply, output + stop)
        after = replace(before, messages=(*messages[: k + 1], Message("user", "?")))
        expected = prompt_ids + output + stop
        assert prompt.encode(after)[: len(expected)] == expected, k
        # Without the splice the history re-tokenizes differently: the check has teeth.
        assert canonical.encode(after)[: len(expected)] != expected, k


@pytest.mark.parametrize("choice", [ToolChoice("required"), ToolChoice("function", "get_weather")])
def test_forced_prefix_then_generated_ids(
    model: Model, prompt: PromptTokenizer, choice: ToolChoice
) -> None:
    chat = Chat((Message("user", "weather?"),), tools=TOOLS, tool_choice=choice)
    prompt_ids = prompt.encode(chat)
    forced = prompt.forced_prefix_ids(chat)
    assert forced and prompt_ids[-len(forced) :] == forced
    assert prompt.decode(forced) == model.fmt.forced_prefix(chat)
    reply = Message("assistant", "", tool_calls=(ToolCall("c", "get_weather", '{"a": 1}'),))
    body = units(model.fmt.render_body(reply).parts)
    opening = units(model.fmt.forced_segments(chat))  # type: ignore[arg-type]
    assert body[: len(opening)] == opening
    # The model goes on after the forced ids, writing the rest of the call its own way.
    output = forced + generated_ids(prompt, body[len(opening) :])
    assert prompt.remember_output(reply, output)
    after = prompt.encode(replace(chat, messages=(*chat.messages, reply, Message("tool", "r"))))
    expected = prompt_ids + output[len(forced) :]
    assert after[: len(expected)] == expected


def test_remember_output_refuses_ids_that_do_not_spell_the_body(
    model: Model, prompt: PromptTokenizer
) -> None:
    reply = Message("assistant", "Hello world")
    assert not prompt.remember_output(reply, prompt.content.encode("Hello worlds"))
    assert not prompt.remember_output(reply, [])
    # Content that spells a marker, offered with that marker's control id: the same text,
    # but not the body, so not kept, and the content stays text.
    marker = model.fmt.MARKERS[-1]
    spelled = Message("assistant", f"a{marker}b")
    control_id = model.tokenizer.token_to_id(marker)
    forged = [*prompt.content.encode("a"), control_id, *prompt.content.encode("b")]
    assert prompt.decode(forged) == spelled.content
    assert not prompt.remember_output(spelled, forged)
    skeleton = controls(
        prompt, prompt.encode(Chat((Message("user", "u"), replace(spelled, content="x"))))
    )
    assert controls(prompt, prompt.encode(Chat((Message("user", "u"), spelled)))) == skeleton


def test_text_spelling_a_remembered_call_gets_no_control_ids(prompt: PromptTokenizer) -> None:
    """A body remembered with real tool-call markers is keyed by its structure: a client
    message whose content is the same markup as text does not pick those ids up."""
    fmt = prompt.chat_format
    reply = Message("assistant", "", tool_calls=(ToolCall("c", "get_weather", "{}"),))
    assert prompt.remember_output(reply, generated_ids(prompt, units(fmt.render_body(reply).parts)))
    imitation = Message("assistant", fmt.render_body(reply).text)
    assert fmt.render_body(imitation).text == fmt.render_body(reply).text
    user = Message("user", "u")
    skeleton = controls(prompt, prompt.encode(Chat((user, Message("assistant", "x")))))
    assert controls(prompt, prompt.encode(Chat((user, imitation)))) == skeleton


def test_second_request_tokenizes_only_the_new_segments(
    model: Model, prompt: PromptTokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    batches: list[list[str]] = []
    encode_batch = prompt.content.encode_batch

    def counting(texts: list[str]) -> list[list[int]]:
        batches.append(list(texts))
        return encode_batch(texts)

    monkeypatch.setattr(prompt.content, "encode_batch", counting)
    chat = Chat(conversation()[:4])
    first = prompt.encode(chat)
    assert len(batches) == 1 and prompt.num_segment_misses == len(batches[0])
    hits_before, misses_before = prompt.num_segment_hits, prompt.num_segment_misses
    longer = replace(chat, messages=(*chat.messages, Message("user", "one more")))
    ids = prompt.encode(longer)
    assert len(batches) == 2 and prompt.num_segment_misses - misses_before == 1
    assert batches[1] == [("user\none more" if model.name == SMOLLM2 else "one more")]
    num_texts = sum(not isinstance(s, Control) for s in model.fmt.render(longer))
    assert prompt.num_segment_hits - hits_before == num_texts - 1
    uncached = PromptTokenizer(model.tokenizer, model.fmt, cache_tokens=0)
    assert ids == uncached.encode(longer) == model.jinja_ids(longer)
    assert first == uncached.encode(chat) and uncached.num_cached_tokens == 0
    prompt.encode(longer)
    assert len(batches) == 2  # all cached: no tokenizer call at all


def test_cache_stays_within_its_token_budget(model: Model, content: ContentTokenizer) -> None:
    small = PromptTokenizer(model.tokenizer, model.fmt, cache_tokens=40, content=content)
    for chat in plain_chats():
        assert small.encode(chat) == model.jinja_ids(chat)
        assert 0 < small.num_cached_tokens <= 40


def test_concurrent_encodes_agree_with_serial_ones(model: Model, content: ContentTokenizer) -> None:
    chats = [*plain_chats(), Chat(conversation(), tools=TOOLS)]
    serial = PromptTokenizer(model.tokenizer, model.fmt, cache_tokens=0, content=content)
    expected = [serial.encode(chat) for chat in chats]
    shared = PromptTokenizer(model.tokenizer, model.fmt, cache_tokens=2_000, content=content)
    results: dict[int, list[list[int]]] = {}

    def work(worker: int) -> None:
        order = random.Random(worker).sample(range(len(chats)), len(chats))
        results[worker] = [[] for _ in chats]
        for index in order * 3:
            results[worker][index] = shared.encode(chats[index])

    threads = [threading.Thread(target=work, args=(w,)) for w in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(results[w] == expected for w in range(4))
    assert shared.num_cached_tokens <= 2_000


def test_count_decode_and_invalid_text(model: Model, prompt: PromptTokenizer) -> None:
    chat = Chat(conversation(), tools=TOOLS)
    ids = prompt.encode(chat)
    assert prompt.count(chat) == len(ids)
    assert prompt.count(chat, add_generation_prompt=False) < len(ids)
    assert prompt.decode(ids) == model.fmt.render_text(chat)
    with pytest.raises(InvalidTextError) as raised:
        prompt.encode(Chat((Message("user", "bad \ud800 surrogate"),)))
    assert isinstance(raised.value, PromptError)


def test_stop_token_is_the_turn_terminator() -> None:
    for name, marker in ((SMOLLM2, "<|im_end|>"), (TINY_CODER, "<｜end▁of▁sentence｜>")):
        model = load(name)
        prompt = PromptTokenizer(model.tokenizer, model.fmt)
        ids = prompt.encode(
            Chat((Message("user", "u"), Message("assistant", "a"))), add_generation_prompt=False
        )
        assert model.tokenizer.token_to_id(marker) in ids
        assert model.fmt.stop_token_ids == (model.tokenizer.token_to_id(marker),)
