"""The prefix guard (services/ingress/stability.py): what it rewrites, and that it changes
no token of the prompt outside the lines it moves or removes."""

from __future__ import annotations

import difflib
from functools import cache

import pytest

from services.ingress.stability import canonical, harness, kinds_in, masked
from shared.models import model_path
from shared.tokenizer import Chat, Message, PromptTokenizer, Tool, format_for
from worker.engine.checkpoint import Checkpoint

HEADER = "x-anthropic-billing-header: cc_version=2.0.14.d3f; cc_entrypoint=cli; cch=9f8e7d6c5b4a;"
SYSTEM = "\n".join(
    [
        HEADER,
        "You are Claude Code, a coding agent.",
        "Session 0c6f2a8e-3b1d-4c1a-9a6e-2f1d8c7b6a5e started.",
        "Keep answers short.",
        "Current time: 2026-12-07T16:41:05.123Z",
    ]
)
READ = Tool("read_file", "Read a file.", {"type": "object", "properties": {"path": {}}})


def agent_chat(system: str = SYSTEM) -> Chat:
    return Chat(
        (
            Message("system", system),
            Message("user", "Fix the failing test in tests/test_add.py."),
            Message("assistant", "Reading it first."),
            Message("user", "def test_add():\n    assert add(2, 2) == 4\n"),
        ),
        (READ,),
    )


@cache
def tokenizer(name: str) -> PromptTokenizer:
    checkpoint = Checkpoint(model_path(name))
    return PromptTokenizer(checkpoint.tokenizer(), format_for(checkpoint))


def test_known_lines_are_removed_or_moved_and_nothing_else_changes() -> None:
    original = agent_chat()
    rewritten, rewrite = canonical(original)
    assert rewrite is not None
    assert rewrite.kinds == ("billing_header", "uuid", "timestamp")
    assert rewrite.num_chars_stripped == len(HEADER) + 1
    assert rewritten.messages[0].content == (
        "You are Claude Code, a coding agent.\nKeep answers short."
    )
    moved = [line for line in SYSTEM.split("\n") if "Session" in line or "Current time" in line]
    assert rewritten.messages[-1] == Message("user", "\n".join(moved))
    assert rewrite.num_chars_moved == sum(len(line) + 1 for line in moved)
    assert rewritten.messages[1:-1] == original.messages[1:] and rewritten.tools == original.tools


@pytest.mark.parametrize("model", ["SmolLM2-135M-Instruct", "tiny-coder"])
def test_no_token_changes_outside_the_lines_rewritten(model: str) -> None:
    """The prompt's ids before and after, aligned: only deletions (the removed and moved
    lines, in the system prompt) and one insertion (the moved lines' own message, before the
    generation prompt); no id replaced, none of the rest moved."""
    prompt = tokenizer(model)
    original, (rewritten, _) = agent_chat(), canonical(agent_chat())
    before, after = prompt.encode(original), prompt.encode(rewritten)
    ops = difflib.SequenceMatcher(a=before, b=after, autojunk=False).get_opcodes()
    deleted = [prompt.decode(before[i1:i2]) for op, i1, i2, _, _ in ops if op == "delete"]
    inserted = [prompt.decode(after[j1:j2]) for op, _, _, j1, j2 in ops if op == "insert"]
    assert {op for op, *_ in ops} == {"equal", "delete", "insert"}  # nothing replaced
    assert "".join(deleted).replace("\n", "") == "".join(
        line for line in SYSTEM.split("\n") if line.startswith(("x-", "Session", "Current"))
    )
    assert len(inserted) == 1
    assert rewritten.messages[-1].content in inserted[0]
    kept = sum(i2 - i1 for op, i1, i2, _, _ in ops if op == "equal")
    assert kept == len(before) - sum(i2 - i1 for op, i1, i2, _, _ in ops if op == "delete")


def test_a_prompt_without_volatile_lines_is_returned_as_it_came() -> None:
    plain = agent_chat("You are a coding agent. Today is 2026-12-07.")  # a date is no time
    assert canonical(plain) == (plain, None)
    no_system = Chat(agent_chat().messages[1:])
    assert canonical(no_system) == (no_system, None)


def test_a_prefill_keeps_its_moving_lines_but_loses_the_billing_header() -> None:
    chat = agent_chat()
    prefill = Chat((*chat.messages, Message("assistant", "def add(a, b):")), chat.tools)
    rewritten, rewrite = canonical(prefill)
    assert rewrite is not None and rewrite.kinds == ("billing_header",)
    assert rewritten.messages[0].content == SYSTEM.split("\n", 1)[1]
    assert rewritten.messages[1:] == prefill.messages[1:]


def test_kinds_and_masks() -> None:
    assert kinds_in(SYSTEM) == ["billing_header", "timestamp", "uuid"]
    assert kinds_in("epoch 1765125665123 and nonce 5f3c9a0b1d2e4f60") == ["unix_time", "nonce"]
    assert kinds_in("deadbeefdeadbeefcafe is hex words; 12345678901234567 is a number") == []
    assert masked("at 2026-12-07T16:41:05Z") == masked("at 2027-01-01T00:00:00Z")


def test_harness_names_come_from_the_user_agent() -> None:
    assert harness("claude-cli/2.0.14 (external, cli)") == "claude-code"
    assert harness("OpenAI/Python 1.99.9") == "openai-sdk"
    assert harness("Anthropic/Python 0.60.0") == "anthropic-sdk"
    assert harness("my-own-agent/0.1") == harness("") == "other"
