"""Prefix stability: the spans of a prompt that change on every request of a session while
the rest stays, which turn each request into a cache miss from that span on.

Detection (every request with a session): the system prompt is also hashed with every span
of a known kind masked (`masked`), and the tools in name order (`tools_in_order`). A turn
whose system prompt differs from the previous turn's but not once masked changed only in
those spans: its diagnosis is `volatile_span` naming the kinds found (`span=timestamp`); a
turn whose tools differ only in their order names `tool_order`. Ingress counts them per
harness (the caller's user agent, by product name) in
`kvfabric_ingress_volatile_spans_total{harness, span}`.

The guard (an account opts in: `kvfabric accounts set NAME --prefix-guard`) rewrites the
system prompt before tokenization, one line at a time and nothing else:
  - a billing header line (`x-anthropic-billing-header: ...`, a harness's per-request
    nonce for its own billing, not meant for the model) is removed;
  - a line holding a timestamp, a UUID, a Unix time or a hex nonce is moved, unchanged, to
    a user message of its own after the conversation's last message, so the model still
    reads it but the cached prefix no longer ends at it. A message of its own, not text
    appended to the last one: the tokenizer cannot merge its first token with the end of
    the conversation, so no token outside the moved lines changes.
Each rewrite is written to the audit log (`prefix_guard.rewrite`: the request, the kinds and
how many characters moved or went). A prompt whose last message is the assistant's (a
prefill to continue) keeps its moving lines where they are.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from shared.tokenizer.chat import Chat, Message

STRIP, MOVE = "strip", "move"
REWRITE_ACTION = "prefix_guard.rewrite"  # its audit records' action


@dataclass(frozen=True)
class Kind:
    name: str
    pattern: re.Pattern[str]
    action: str  # STRIP: the line goes; MOVE: the line moves to the prompt's end


KINDS = (
    Kind(
        "billing_header",
        re.compile(r"^[ \t]*x-anthropic-billing-header:.*$", re.IGNORECASE | re.MULTILINE),
        STRIP,
    ),
    Kind(
        "timestamp",
        re.compile(
            r"\b\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}(?::\d{2}(?:\.\d+)?)?(?:Z|[+-]\d{2}:?\d{2})?\b"
        ),
        MOVE,
    ),
    Kind(
        "uuid",
        re.compile(
            r"\b[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\b"
        ),
        MOVE,
    ),
    # Seconds or milliseconds since 1970 in 2001-2286: ten or thirteen digits from 1.
    Kind("unix_time", re.compile(r"\b1\d{9}(?:\d{3})?\b"), MOVE),
    # 16 or more hex digits with at least one letter and one digit (not a word, not a number).
    Kind(
        "nonce", re.compile(r"\b(?=[0-9a-fA-F]*\d)(?=[0-9a-fA-F]*[a-fA-F])[0-9a-fA-F]{16,}\b"), MOVE
    ),
)
TOOL_ORDER = "tool_order"  # the tools' order changed, nothing else of them


def kinds_in(text: str) -> list[str]:
    """The kinds of volatile span `text` holds, in KINDS order (a span inside an earlier
    kind's, as the nonce of a billing header, is that kind's)."""
    found = []
    for kind in KINDS:
        text, count = kind.pattern.subn(f"\x00{kind.name}\x00", text)
        if count:
            found.append(kind.name)
    return found


def masked(text: str) -> str:
    """`text` with every span of a known kind replaced by its kind's name."""
    for kind in KINDS:
        text = kind.pattern.sub(f"\x00{kind.name}\x00", text)
    return text


@dataclass(frozen=True)
class Rewrite:
    kinds: tuple[str, ...]
    num_chars_stripped: int
    num_chars_moved: int


def _line_kind(line: str) -> Kind | None:
    for kind in KINDS:
        if kind.pattern.search(line):
            return kind
    return None


def canonical(chat: Chat) -> tuple[Chat, Rewrite | None]:
    """The chat with its system prompt's volatile lines removed or moved (module doc), and
    what changed (None: nothing did, and the chat is returned as it came)."""
    messages = chat.messages
    if not messages or messages[0].role != "system":
        return chat, None
    # A prefill to continue (the assistant's last): nothing may come after it.
    can_move = len(messages) > 1 and messages[-1].role != "assistant"
    kept, moved, kinds = [], [], []
    stripped = 0
    for line in messages[0].content.split("\n"):
        kind = _line_kind(line)
        if kind is None or (kind.action == MOVE and not can_move):
            kept.append(line)
            continue
        kinds.append(kind.name)
        if kind.action == STRIP:
            stripped += len(line) + 1
        else:
            moved.append(line)
    if not kinds:
        return chat, None
    out = [dataclasses.replace(messages[0], content="\n".join(kept)), *messages[1:]]
    if moved:
        out.append(Message("user", "\n".join(moved)))
    rewrite = Rewrite(tuple(dict.fromkeys(kinds)), stripped, sum(len(line) + 1 for line in moved))
    return dataclasses.replace(chat, messages=tuple(out)), rewrite


# Harnesses told apart in the metrics (a label's values are fixed): the product name a user
# agent starts with, lowercased, mapped here; anything else is "other".
HARNESSES = {
    "claude-cli": "claude-code",
    "claude-code": "claude-code",
    "codex_cli_rs": "codex",
    "codex": "codex",
    "aider": "aider",
    "cline": "cline",
    "opencode": "opencode",
    "cursor": "cursor",
    "openai": "openai-sdk",  # OpenAI/Python 1.99, OpenAI/JS ...
    "asyncopenai": "openai-sdk",
    "anthropic": "anthropic-sdk",  # Anthropic/Python 0.60 ...
    "asyncanthropic": "anthropic-sdk",
    "curl": "curl",
}
HARNESS_LABELS = (*dict.fromkeys(HARNESSES.values()), "other")
SPAN_LABELS = (*(k.name for k in KINDS), TOOL_ORDER, "unknown")


def harness(user_agent: str) -> str:
    """A caller's harness, as a metric label (HARNESS_LABELS): `claude-cli/2.0.1 (external,
    cli)` -> claude-code, `OpenAI/Python 1.99.9` -> openai-sdk, anything unknown -> other."""
    product = user_agent.strip().split(" ", 1)[0].split("/", 1)[0].lower()
    return HARNESSES.get(product, "other")
