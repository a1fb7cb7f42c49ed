"""`kvfabric demo`'s requests: what a coding agent does, through the front door.

Turn 1 asks SmolLM2 a coding question over HTTP (OpenAI Chat Completions, streamed, as an
agent's SDK sends it); turn 2 re-sends the whole conversation with a tool's output and the
next instruction, and most of its prompt comes from the store: ingress re-uses turn 1's
answer as the exact ids the model generated, so the prefix matches the KV decode wrote.
Then the same second prompt once more in another cache namespace (through the cluster's own
client, which can name one): what turn 2 would have cost without the store.

Only the standard library speaks HTTP here (urllib), so the demo needs no SDK installed.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from services.admin.launcher import Cluster
from services.admin.status import render
from shared import models
from shared.bus import Bus
from shared.client import build_request, generate
from shared.discovery import discover
from shared.tokenizer import PromptTokenizer, format_for
from shared.tokenizer.chat import Chat, Message
from worker.engine.checkpoint import Checkpoint

MODEL = "SmolLM2-135M-Instruct"
QUESTION = (
    "Write a Python function is_palindrome(s) that returns True when the string s reads "
    "the same forwards and backwards."
)
TOOL_RESULT = (
    "$ python -c 'from pal import is_palindrome; print(is_palindrome(\"Racecar\"))'\nFalse"
)
FOLLOW_UP = "The test says False for 'Racecar'. Make it ignore case and spaces."
MAX_TOKENS = 160


@dataclass
class Turn:
    text: str
    usage: dict[str, Any]
    finish_reason: str
    ttft_s: float


def chat_stream(url: str, api_key: str, messages: list[dict[str, str]]) -> Turn:
    """POST /v1/chat/completions with stream=true; the text, usage and time to first token."""
    body = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    request = urllib.request.Request(
        f"{url}/v1/chat/completions",
        data=json.dumps(body).encode(),
        method="POST",
        headers={"authorization": f"Bearer {api_key}", "content-type": "application/json"},
    )
    texts, usage, finish, first_at = [], {}, "", None
    sent_at = time.perf_counter()
    with urllib.request.urlopen(request, timeout=300) as response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk["choices"]:
                if choice["delta"].get("content"):
                    first_at = first_at or time.perf_counter()
                    texts.append(choice["delta"]["content"])
                finish = choice.get("finish_reason") or finish
    return Turn("".join(texts), usage, finish, (first_at or time.perf_counter()) - sent_at)


async def demo_requests(
    cluster: Cluster, bus: Bus, echo: Callable[[str], None], api_key: str
) -> int:
    url = cluster.http_urls[0]
    health = await asyncio.to_thread(
        lambda: urllib.request.urlopen(f"{url}/health", timeout=5).read().decode()
    )
    echo(f"GET {url}/health -> {json.dumps(json.loads(health))}")
    messages = [{"role": "user", "content": QUESTION}]
    first = await _turn(url, api_key, messages, echo, turn=1)
    tool_turn = f"I ran your function:\n{TOOL_RESULT}\n{FOLLOW_UP}"
    messages += [
        {"role": "assistant", "content": first.text},
        {"role": "user", "content": tool_turn},
    ]
    second = await _turn(url, api_key, messages, echo, turn=2)

    # Turn 2's prompt once more where nothing is cached (another tenant namespace).
    checkpoint = Checkpoint(models.model_path(MODEL))
    tokenizer = PromptTokenizer(checkpoint.tokenizer(), format_for(checkpoint))
    chat = Chat(tuple(Message(m["role"], m["content"]) for m in messages))  # type: ignore[arg-type]
    prompt = tokenizer.encode(chat)
    cold = await generate(
        bus, build_request(prompt, model=MODEL, max_tokens=1, cache_salt="demo-cold")
    )
    echo(
        f"time to first token: turn 1 {_ms(first.ttft_s)} "
        f"({first.usage['prompt_tokens']} tokens, cold); turn 2 {_ms(second.ttft_s)} "
        f"({second.usage['prompt_tokens']} tokens, "
        f"{second.usage['prompt_tokens_details']['cached_tokens']} from the store); "
        f"turn 2's prompt computed cold {_ms(cold.ttft_s)} ({len(prompt)} tokens)"
    )
    echo(render(await discover(bus, timeout_s=0.5)))
    return 0


async def _turn(url: str, api_key: str, messages: list[dict[str, str]], echo, *, turn: int):  # noqa: ANN001, ANN202
    try:
        result = await asyncio.to_thread(chat_stream, url, api_key, messages)
    except urllib.error.HTTPError as exc:  # the API's own error body says what went wrong
        raise RuntimeError(f"turn {turn}: HTTP {exc.code}: {exc.read().decode()}") from exc
    usage = result.usage
    echo(
        f"POST /v1/chat/completions turn {turn}: {usage['prompt_tokens']} prompt tokens, "
        f"{usage['prompt_tokens_details']['cached_tokens']} from the store, "
        f"{usage['completion_tokens']} generated ({result.finish_reason}), "
        f"TTFT {_ms(result.ttft_s)}"
    )
    echo(result.text.strip())
    await asyncio.sleep(0.3)  # kv-index applies the answer's BlocksStored asynchronously
    return result


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f} ms"
