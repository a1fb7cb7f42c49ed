"""Synthetic but realistic-looking text for agent sessions: Python listings, pytest output,
grep hits, diffs, an agent's system prompt and a first task.

Every generator takes a `random.Random` and a size in approximate tokens and appends whole
lines until the text is that long, so the same generator state gives the same text. Length
is estimated as characters / characters-a-token of the kind of text, as tiny-coder's and
SmolLM2's tokenizers split it (measured on 20 samples of each; the two agree within 5%):
prose 3.9, code 3.2, pytest output 3.45, grep hits 2.55, diffs 2.6. From 200 tokens up, both
tokenizers' counts land within 15% of the size asked for (below that a header line weighs
more). A server with another tokenizer counts differently; the runner reports its counts.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

PROSE, CODE, TESTS, GREP, DIFF = 3.9, 3.2, 3.45, 2.55, 2.6  # characters a token

VERBS = (
    "load",
    "parse",
    "merge",
    "resolve",
    "render",
    "collect",
    "encode",
    "validate",
    "flush",
    "schedule",
    "split",
    "normalize",
    "fetch",
    "index",
    "retry",
    "compact",
)
NOUNS = (
    "config",
    "blocks",
    "tokens",
    "request",
    "session",
    "payload",
    "entries",
    "records",
    "segments",
    "headers",
    "window",
    "snapshot",
    "batch",
    "ledger",
    "route",
    "cache",
)
ATTRS = ("size", "offset", "name", "count", "deadline", "status", "weight", "key", "level")
TYPES = ("int", "str", "bool", "float", "list[str]", "dict[str, int]", "bytes", "None")
PACKAGES = ("core", "io", "net", "store", "sched", "api", "util", "cli")
ERRORS = ("KeyError", "ValueError", "IndexError", "TypeError", "AssertionError")
PHRASES = (
    "before the deadline",
    "in arrival order",
    "without copying",
    "once per batch",
    "under the lock",
    "from the newest first",
    "when the cache is cold",
)


def fill(
    num_tokens: int, chars_per_token: float, next_lines: Callable[[], list[str]], head: str = ""
) -> str:
    """`head`, then groups of lines from `next_lines` until the text is about `num_tokens`
    tokens long: a line that would overshoot by more than it would fall short is left out."""
    lines = [head] if head else []
    size = len(head)
    budget = num_tokens * chars_per_token
    while True:
        for line in next_lines():
            if budget - size < (len(line) + 1) / 2:
                return "\n".join(lines)
            lines.append(line)
            size += len(line) + 1


def estimate(text: str, chars_per_token: float = PROSE) -> int:
    return math.ceil(len(text) / chars_per_token)


def ident(rng: random.Random) -> str:
    return f"{rng.choice(VERBS)}_{rng.choice(NOUNS)}"


def module_path(rng: random.Random) -> str:
    return f"src/{rng.choice(PACKAGES)}/{rng.choice(NOUNS)}.py"


def function_lines(rng: random.Random) -> list[str]:
    """One Python function with a docstring, a loop, a branch and a return."""
    name, noun, attr = ident(rng), rng.choice(NOUNS), rng.choice(ATTRS)
    item, out = noun.rstrip("s") or "item", f"{rng.choice(VERBS)}ed"
    limit = rng.randint(1, 512)
    return [
        f"def {name}({noun}: list, limit: int = {limit}) -> {rng.choice(TYPES)}:",
        f'    """{name.split("_")[0].capitalize()} the {noun} {rng.choice(PHRASES)}."""',
        f"    {out} = []",
        f"    for {item} in {noun}:",
        f"        if {item}.{attr} {rng.choice(('>', '<', '==', '>='))} limit:",
        f"            {out}.append({item}.{rng.choice(ATTRS)})",
        f"        elif not {item}.{attr}:",
        f'            raise {rng.choice(ERRORS)}(f"bad {attr}: {{{item}.{attr}!r}}")',
        f"    return {out}",
        "",
    ]


def code_listing(rng: random.Random, num_tokens: int, path: str) -> str:
    """`cat -n` of a Python module: an import block, then functions."""
    head = [
        f'"""{rng.choice(NOUNS).capitalize()} handling for {path}."""',
        "",
        "from __future__ import annotations",
        "",
        "import logging",
        "",
    ]
    numbered: list[str] = []

    def next_lines() -> list[str]:
        source = head if not numbered else function_lines(rng)
        start = len(numbered) + 1
        numbered.extend(source)
        return [f"{start + i:6d}\t{line}" for i, line in enumerate(source)]

    return fill(num_tokens, CODE, next_lines, f"$ cat -n {path}")


def test_output(rng: random.Random, num_tokens: int) -> str:
    """A pytest run with failures: a traceback per failure, then the summary."""
    num_tests = rng.randint(20, 400)
    header = (
        "============================= test session starts ==============================\n"
        "platform linux -- Python 3.11.9, pytest-8.3.2, pluggy-1.5.0\n"
        f"collected {num_tests} items\n"
    )

    def failure() -> list[str]:
        test, attr = f"test_{ident(rng)}", rng.choice(ATTRS)
        path, line = module_path(rng), rng.randint(10, 900)
        got, want = rng.randint(0, 99), rng.randint(100, 999)
        return [
            f"____________________________ {test} ____________________________",
            "",
            f"    def {test}():",
            f"        result = {ident(rng)}(make_{rng.choice(NOUNS)}({rng.randint(1, 64)}))",
            f">       assert result.{attr} == {want}",
            f"E       AssertionError: assert {got} == {want}",
            f"E        +  where {got} = <Result {attr}={got}>.{attr}",
            "",
            f"{path.replace('src/', 'tests/test_')}:{line}: AssertionError",
        ]

    return fill(num_tokens, TESTS, failure, header)


def grep_output(rng: random.Random, num_tokens: int) -> str:
    """`grep -rn` of a name across the tree."""
    name = ident(rng)

    def hit() -> list[str]:
        context = rng.choice(
            (f"def {name}(", f"return {name}(", f"    {name}(", f"from . import {name}")
        )
        return [f"{module_path(rng)}:{rng.randint(1, 900)}:{context}{rng.choice(NOUNS)})"]

    return fill(num_tokens, GREP, hit, f"$ grep -rn {name} src/ tests/")


def diff_output(rng: random.Random, num_tokens: int) -> str:
    """`git diff` of edits: hunks replacing a line of a function."""

    def hunk() -> list[str]:
        path, start = module_path(rng), rng.randint(1, 800)
        old, new = function_lines(rng), function_lines(rng)
        return [
            f"diff --git a/{path} b/{path}",
            f"--- a/{path}",
            f"+++ b/{path}",
            f"@@ -{start},4 +{start},4 @@",
            f" {old[0]}",
            f"-{old[4]}",
            f"+{new[4]}",
            f" {old[5]}",
        ]

    return fill(num_tokens, DIFF, hunk, "$ git diff")


def tool_result(rng: random.Random, num_tokens: int) -> str:
    """What one tool call returned: a file, a test run, a search or a diff."""
    kind = rng.choice(("read_file", "run_tests", "grep", "git_diff"))
    head = f"[tool result: {kind}]"
    size = max(1, num_tokens - estimate(head))
    if kind == "read_file":
        body = code_listing(rng, size, module_path(rng))
    elif kind == "run_tests":
        body = test_output(rng, size)
    elif kind == "grep":
        body = grep_output(rng, size)
    else:
        body = diff_output(rng, size)
    return f"{head}\n{body}"


def system_prompt(rng: random.Random, num_tokens: int) -> str:
    """An agent's instructions: rules, then the tools it may call."""
    head = (
        "You are a coding agent working in a Python repository. Read before you edit, "
        "run the tests after every change and answer with the next tool call."
    )
    count = 0

    def rule() -> list[str]:
        nonlocal count
        count += 1
        verb, noun = rng.choice(VERBS), rng.choice(NOUNS)
        return [
            f"{count}. When you {verb} {noun}, do it {rng.choice(PHRASES)}; "
            f"check the {rng.choice(ATTRS)} of every one and say what changed."
        ]

    return fill(num_tokens, PROSE, rule, head)


def first_task(rng: random.Random, num_tokens: int) -> str:
    """The user's request and the file it is about."""
    path, name = module_path(rng), ident(rng)
    ask = (
        f"{name} in {path} raises {rng.choice(ERRORS)} {rng.choice(PHRASES)}. "
        "Find the cause, fix it and make the tests pass. The file:"
    )
    return f"{ask}\n{code_listing(rng, max(1, num_tokens - estimate(ask)), path)}"
