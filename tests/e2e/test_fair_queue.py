"""Fair queueing end to end (docs/services.md, 'queue policy'): a cluster of separate
processes on the mock engine, its prefill worker on `--queue-policy fair`, driven over HTTP
through the OpenAI SDK with `x-session-id` as an agent sends it.

A long session's second turn and a new session's first are prompts of the same level on
their own (under 8K tokens of work each); the long session's first turn put 12K tokens of
work on its account. Ingress carries the session (hashed with the account) to the router,
whose ledger ranks the long session's turn a level lower, so the fair worker computes the
new session's prompt first although it arrived second: its first token comes first. (First
come, first served, or without the session, the long session's turn, sent first, would be
answered first: tests/service/test_prefill_fairness.py shows the worker side of both.)
"""

from __future__ import annotations

import asyncio
import random
import time
import urllib.request
from collections.abc import Iterator

import openai
import pytest

from loadtest.agent import texts
from services.admin.launcher import Cluster
from shared.subjects import BILLING, DECODE, INGRESS, PREFILL, ROUTER
from tests.e2e.cluster_helpers import apart, run_cluster

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

KEY = "kvf-test-fair-key-0123"
SPEEDUP = 0.1  # 6K simulated prefill tokens/s: a 2,048-token pass takes 0.34 s
MOCK_ARGS = [
    "--engine",
    "mock",
    "--mock-speedup",
    str(SPEEDUP),
    "--max-model-len",
    "32768",
    "--store-file-nbytes",
    str(32 << 20),
]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    yield from run_cluster(
        tmp_path_factory.mktemp("fair"),
        replicas={BILLING: 0},
        extra_args={
            PREFILL: [*MOCK_ARGS, "--queue-policy", "fair"],
            DECODE: MOCK_ARGS,
            # The router's estimates at the mock's speed (its objective is 2 s).
            ROUTER: ["--cost-speedup", str(SPEEDUP)],
            INGRESS: ["--dev-api-key", KEY],
        },
        ready_timeout_s=120,
        hosts=apart,
    )


def queued_tokens(cluster: Cluster) -> float:
    """The prefill worker's `kvfabric_worker_queued_tokens`, from its /metrics."""
    with urllib.request.urlopen(cluster.metrics_urls[f"{PREFILL}-0"], timeout=10) as response:
        for line in response.read().decode().splitlines():
            if line.startswith("kvfabric_worker_queued_tokens"):
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no kvfabric_worker_queued_tokens in the prefill worker's metrics")


async def first_token_at(
    client: openai.AsyncOpenAI, messages: list[dict[str, str]], session: str
) -> tuple[float, str]:
    """(when the first text came, the whole answer)."""
    stream = await client.chat.completions.create(
        model="tiny-coder",
        messages=messages,  # type: ignore[arg-type]
        max_tokens=8,
        temperature=0,
        stream=True,
        extra_headers={"x-session-id": session},
    )
    first, text = None, ""
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.monotonic()
            text += chunk.choices[0].delta.content
    assert first is not None, f"{session}: no text"
    return first, text


async def test_a_new_session_passes_a_long_sessions_turn_of_the_same_size(
    cluster: Cluster,
) -> None:
    client = openai.AsyncOpenAI(
        base_url=f"{cluster.http_urls[0]}/v1", api_key=KEY, max_retries=0, timeout=120
    )
    long = [{"role": "user", "content": texts.tool_result(random.Random(1), 12_000)}]
    try:
        _, answer = await first_token_at(client, long, "long")
        long += [
            {"role": "assistant", "content": answer},
            {"role": "user", "content": texts.tool_result(random.Random(2), 6_000)},
        ]
        short = [{"role": "user", "content": texts.tool_result(random.Random(3), 1_500)}]
        long_turn = asyncio.create_task(first_token_at(client, long, "long"))
        async with asyncio.timeout(60):  # the long session's turn is at the worker...
            while not await asyncio.to_thread(queued_tokens, cluster):
                await asyncio.sleep(0.01)
        short_turn = asyncio.create_task(first_token_at(client, short, "short"))
        (long_first, _), (short_first, _) = await asyncio.gather(long_turn, short_turn)
    finally:
        await client.close()
    # ...and the new session's, sent after it, is computed first.
    assert short_first < long_first, (short_first, long_first)
