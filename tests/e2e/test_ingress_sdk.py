"""Ingress driven as agents drive it: the official `openai` and `anthropic` SDKs against the
running cluster on 127.0.0.1 (separate processes, both real models), through their streaming
helpers; the raw JSON and SSE frames checked strictly against the SDKs' own types.

SmolLM2 (ChatML) and tiny-coder (DeepSeek-V3 markers) both serve every scenario: plain,
streamed, tool calls streamed (a named tool choice forces the call's opening, so even a model
that never learned the format produces one), a second turn whose prompt comes mostly from
the store, `previous_response_id`, and every error class in each protocol's own shape.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import jiter
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response as OpenAIResponse
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter

from services.admin.launcher import Cluster
from shared.schema import UsageStatus
from shared.subjects import BILLING, DECODE, INGRESS, PREFILL, ROUTER
from tests.e2e.cluster_helpers import connect, run_cluster, two_nodes, usage_records

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SMOLLM2, TINY = "SmolLM2-135M-Instruct", "tiny-coder"
MODELS = (SMOLLM2, TINY)
KEY = "kvf-test-dev-key-0123"
BLOCK = 16
MAX_BODY = 400_000
KVFABRIC = str(Path(sys.executable).parent / "kvfabric")
WORKER_ARGS = ["--kv-block-size-tokens", str(BLOCK)]
QUESTION = "Write a Python function add(a, b) that returns the sum of a and b."
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
SYSTEM = " ".join(
    f"Rule {i}: keep functions short, name things clearly and test edge cases." for i in range(20)
)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    yield from run_cluster(
        tmp_path_factory.mktemp("ingress"),
        replicas={BILLING: 0, INGRESS: 2},  # stateless replicas share keys and responses
        extra_args={
            PREFILL: WORKER_ARGS,
            DECODE: WORKER_ARGS,
            ROUTER: ["--decode-page-size-tokens", str(BLOCK)],
            INGRESS: [
                "--dev-api-key",
                KEY,
                "--max-body-bytes",
                str(MAX_BODY),
                "--keepalive-s",
                "0.5",
            ],
        },
        models=MODELS,
        ready_timeout_s=180,
        hosts=two_nodes,
    )


@pytest.fixture(scope="module")
def url(cluster: Cluster) -> str:
    return cluster.http_urls[0]


@pytest.fixture(scope="module")
def oai(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def ant(url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0, timeout=120)


def sse_frames(url: str, path: str, body: dict, headers: dict | None = None) -> list[tuple]:
    """(event name or None, data text) of every SSE frame, comments skipped; strict framing:
    each frame is `event:`/`data:` lines ended by a blank line, data never empty."""
    frames, event, data = [], None, None
    headers = {"authorization": f"Bearer {KEY}", **(headers or {})}
    with httpx.stream("POST", url + path, json=body, headers=headers, timeout=120) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith(":"):
                continue
            if line == "":
                if data is not None:
                    frames.append((event, data))
                event, data = None, None
            elif line.startswith("event: "):
                event = line[7:]
            else:
                assert line.startswith("data: "), line
                assert data is None, "one data line per frame"
                data = line[6:]
                assert data, "empty data"
    assert event is None and data is None, "the stream ended inside a frame"
    return frames


# -- models --------------------------------------------------------------------------------
def test_models_are_listed_by_both_sdks(oai: openai.OpenAI, ant: anthropic.Anthropic) -> None:
    assert {m.id for m in oai.models.list()} == set(MODELS)
    assert {m.id for m in ant.models.list()} == set(MODELS)


# -- OpenAI Chat Completions ---------------------------------------------------------------
@pytest.mark.parametrize("model", MODELS)
def test_chat_plain_and_streamed_agree(oai: openai.OpenAI, model: str) -> None:
    messages = [{"role": "user", "content": QUESTION}]
    raw = oai.chat.completions.with_raw_response.create(
        model=model, messages=messages, max_tokens=12, temperature=0
    )
    plain = ChatCompletion.model_validate(raw.http_response.json())  # strict, not construct()
    choice = plain.choices[0]
    assert isinstance(choice.message.content, str) and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    usage = plain.usage
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert 0 < usage.completion_tokens <= 12
    assert 0 <= usage.prompt_tokens_details.cached_tokens <= usage.prompt_tokens

    state = ChatCompletionStreamState()
    chunks = list(
        oai.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    for chunk in chunks:
        ChatCompletionChunk.model_validate(chunk.model_dump())
        state.handle_chunk(chunk)
    snapshot = state.current_completion_snapshot
    assert chunks[0].choices[0].delta.role == "assistant"  # OC-S-02
    assert len({c.id for c in chunks}) == 1  # OC-S-01
    assert chunks[-1].choices == [] and chunks[-1].usage is not None  # OC-S-08
    assert all(c.usage is None for c in chunks[:-1])
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1 and finish[0].choices[0].delta.content is None  # OC-S-07
    assert snapshot.choices[0].message.content == choice.message.content
    assert snapshot.choices[0].finish_reason == choice.finish_reason
    assert chunks[-1].usage.completion_tokens == usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == usage.prompt_tokens


@pytest.mark.parametrize("model", MODELS)
def test_chat_tool_call_streams_as_the_sdk_expects(oai: openai.OpenAI, model: str) -> None:
    chunks = list(
        oai.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Weather in Paris?"}],
            tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            max_tokens=24,
            temperature=0,
            stream=True,
        )
    )
    deltas = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or ()]
    assert deltas, "no tool-call delta"
    first, rest = deltas[0], deltas[1:]
    assert (first.index, first.type, first.function.name) == (0, "function", "get_weather")
    assert first.id and first.function.arguments == ""  # OC-S-04
    assert all(d.id is None and d.function.name is None and d.index == 0 for d in rest)
    arguments = ""
    for d in rest:
        arguments += d.function.arguments
        jiter.from_json(arguments.encode(), partial_mode="trailing-strings")  # a JSON prefix
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finish in (["tool_calls"], ["length"])
    assert not any(c.choices and c.choices[0].delta.tool_calls == [] for c in chunks)  # OC-S-10


def test_chat_n_choices_come_in_order(oai: openai.OpenAI) -> None:
    chunks = list(
        oai.chat.completions.create(
            model=TINY,
            messages=[{"role": "user", "content": QUESTION}],
            max_tokens=6,
            n=2,
            temperature=1.0,
            seed=7,
            stream=True,
        )
    )
    firsts = [c.choices[0].index for c in chunks[:2]]
    assert firsts == [0, 1]  # OC-S-11
    assert {c.choices[0].index for c in chunks if c.choices} == {0, 1}
    plain = oai.chat.completions.create(
        model=TINY, messages=[{"role": "user", "content": QUESTION}], max_tokens=6, n=2
    )
    assert [c.index for c in plain.choices] == [0, 1]


# -- a coding agent's second turn ----------------------------------------------------------
@pytest.mark.parametrize("model", MODELS)
def test_second_turn_reports_the_cached_prefix(oai: openai.OpenAI, model: str) -> None:
    turn_1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    first = oai.chat.completions.create(model=model, messages=turn_1, max_tokens=16)
    turn_2 = [
        *turn_1,
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "Now add type hints."},
    ]
    second = oai.chat.completions.create(model=model, messages=turn_2, max_tokens=4)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= 0.8 * first.usage.prompt_tokens, (cached, first.usage.prompt_tokens)
    extra = second.model_extra or {}
    usage_extra = second.usage.model_extra or {}
    assert usage_extra["prompt_cache_hit_tokens"] == cached, extra
    assert usage_extra["prompt_cache_miss_tokens"] == second.usage.prompt_tokens - cached


@pytest.mark.parametrize("model", MODELS)
def test_anthropic_turns_split_input_disjointly(ant: anthropic.Anthropic, model: str) -> None:
    system = SYSTEM + " (anthropic)"
    turn_1 = [{"role": "user", "content": QUESTION}]
    first = ant.messages.create(model=model, system=system, messages=turn_1, max_tokens=16)
    counted = ant.messages.count_tokens(model=model, system=system, messages=turn_1)
    u = first.usage
    assert u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens == (
        counted.input_tokens
    )  # AN-U-01
    text = "".join(b.text for b in first.content if b.type == "text")
    turn_2 = [
        *turn_1,
        {"role": "assistant", "content": text},
        {"role": "user", "content": "Now add type hints."},
    ]
    second = ant.messages.create(model=model, system=system, messages=turn_2, max_tokens=4)
    assert second.usage.cache_read_input_tokens >= 0.8 * counted.input_tokens


# -- why a turn missed the cache ----------------------------------------------------------
def diagnosed(raw: object) -> tuple[dict, dict]:
    """The header's fields (router's count) and the usage's `kvfabric_cache` (decode's)."""
    header = raw.headers["x-kvfabric-cache"]  # type: ignore[attr-defined]
    fields = dict(part.split("=", 1) for part in header.split("; "))
    return fields, raw.http_response.json()["usage"]["kvfabric_cache"]  # type: ignore[attr-defined]


def explanation(url: str, response_id: str, timeout_s: float = 30.0) -> dict:
    """GET /v1/kvfabric/cache/explain/{id} once it is kept (in the background, after the
    answer)."""
    deadline = time.monotonic() + timeout_s
    headers = {"authorization": f"Bearer {KEY}"}
    while True:
        r = httpx.get(f"{url}/v1/kvfabric/cache/explain/{response_id}", headers=headers)
        if r.status_code != 404 or time.monotonic() > deadline:
            assert r.status_code == 200, r.text
            return r.json()
        time.sleep(0.1)


def test_a_sessions_misses_are_diagnosed_across_ingress_replicas(cluster: Cluster) -> None:
    """One agent session, its turns sent to either ingress replica in turn: each names why
    its prompt missed past what was cached, against the session's previous turn."""
    session = {"x-session-id": f"agent-{time.time_ns()}"}
    clients = [
        openai.OpenAI(base_url=f"{u}/v1", api_key=KEY, max_retries=0, timeout=120)
        for u in cluster.http_urls[:2]
    ]
    system = "You write short Python."  # tiny-coder's context is 512 tokens: room for 7 turns
    history = [{"role": "system", "content": system}, {"role": "user", "content": QUESTION}]

    def ask(i: int, messages: list[dict], **kwargs: object) -> tuple[dict, dict, object]:
        raw = clients[i % 2].chat.completions.with_raw_response.create(
            model=TINY, messages=messages, max_tokens=8, extra_headers=session, **kwargs
        )
        header, usage = diagnosed(raw)
        return header, usage, raw.parse()

    header, usage, first = ask(0, history)
    assert header["cause"] == usage["cause"] == "never_seen"
    assert usage["first_miss_token"] == first.usage.prompt_tokens_details.cached_tokens
    history += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "Now add type hints."},
    ]
    header, usage, second = ask(1, history)
    cached = second.usage.prompt_tokens_details.cached_tokens
    expected = min(
        first.usage.prompt_tokens // BLOCK * BLOCK,
        (second.usage.prompt_tokens - 1) // BLOCK * BLOCK,
    )
    assert usage == {
        "cause": "none" if cached >= expected else "not_cached",
        "first_miss_token": cached,
    }
    # A nonce in the system prompt: a change, then the same change again (volatile).
    for i, (nonce, cause) in enumerate([("n-1", "system_changed"), ("n-2", "volatile_span")]):
        history[0] = {"role": "system", "content": f"{system} Request {nonce}."}
        header, usage, answer = ask(i, history)
        assert (header["cause"], header["part"]) == (usage["cause"], usage["part"])
        assert (usage["cause"], usage["part"]) == (cause, "system")
    # The dev account's cache is shared: its explanation keeps the text around the miss.
    explained = explanation(cluster.http_urls[1], answer.id)
    assert (explained["cause"], explained["part"], explained["has_text"]) == (
        "volatile_span",
        "system",
        True,
    )
    assert explained["first_miss_token"] == usage["first_miss_token"]
    assert "Request n-2." in explained["before"] + explained["after"]
    header, usage, _ = ask(0, history, tools=[WEATHER])
    assert (usage["cause"], usage["part"]) == ("tools_changed", "tools")
    history[1] = {"role": "user", "content": QUESTION + " In Rust."}
    header, usage, _ = ask(1, history, tools=[WEATHER])
    assert (usage["cause"], usage["part"]) == ("earlier_turn_edited", "message:0")
    # Another session, and no session at all, know nothing of this one.
    raw = clients[0].chat.completions.with_raw_response.create(
        model=TINY, messages=history, max_tokens=4, extra_headers={"x-session-id": "other"}
    )
    assert diagnosed(raw)[1]["cause"] == "never_seen"


def test_a_turn_whose_prefix_was_evicted_is_told_so(cluster: Cluster) -> None:
    """A session's turn stored, the cache flushed by an admin, the next turn sent: its
    diagnosis is `evicted`, with kv-index's tombstone (tier, why, when), in the header, the
    usage, the explanation and `kvfabric cache explain`."""
    session = {"x-session-id": f"evicted-{time.time_ns()}"}
    client = openai.OpenAI(
        base_url=f"{cluster.http_urls[0]}/v1", api_key=KEY, max_retries=0, timeout=120
    )
    system = "You write short Python: keep functions short and name things clearly."
    history = [{"role": "system", "content": system}, {"role": "user", "content": QUESTION}]
    first = client.chat.completions.create(
        model=TINY, messages=history, max_tokens=4, extra_headers=session
    )
    assert first.usage.prompt_tokens >= 2 * BLOCK  # whole blocks to store, and to miss
    where = ["--nats-url", cluster.nats_url, "--root", cluster.spec.root]
    flushed_ms = time.time_ns() // 1_000_000
    subprocess.run(
        [KVFABRIC, "cache", "flush", *where],
        env=cluster.admin_env(),
        capture_output=True,
        timeout=60,
        check=True,
    )
    history += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "Now add type hints."},
    ]
    raw = client.chat.completions.with_raw_response.create(
        model=TINY, messages=history, max_tokens=4, extra_headers=session
    )
    header, usage = diagnosed(raw)
    assert raw.parse().usage.prompt_tokens_details.cached_tokens == 0
    assert header["cause"] == usage["cause"] == "evicted"
    evicted = usage["evicted"]
    assert evicted["reason"] == header["evicted_reason"] == "admin"
    assert evicted["tier"] == header["evicted_tier"] and evicted["tier"]
    assert 0 <= evicted["ago_s"] <= (time.time_ns() // 1_000_000 - flushed_ms) / 1000 + 1
    explained = explanation(cluster.http_urls[1], raw.parse().id)
    assert explained["cause"] == "evicted" and explained["eviction"]["reason"] == "admin"
    printed = subprocess.run(
        [KVFABRIC, "cache", "explain", raw.parse().id, *where],
        env=cluster.admin_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert "cause    evicted" in printed
    assert f"evicted  from {evicted['tier']} (admin)" in printed


def test_a_turn_ending_in_a_tool_call_stages_its_session_on_its_prefill_worker(
    cluster: Cluster,
) -> None:
    """A session's turn that calls a tool: its prompt's blocks are staged on the prefill
    worker that served it (counted there), the turn counted staged at ingress."""

    def total(prefix: str, name: str) -> float:
        found = 0.0
        for instance, url in cluster.metrics_urls.items():
            if instance.startswith(prefix):
                text = httpx.get(url).text
                found += sum(
                    float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)
                )
        return found

    before = total(PREFILL, "kvfabric_prefill_staged_blocks_total")
    client = openai.OpenAI(base_url=f"{cluster.http_urls[0]}/v1", api_key=KEY, max_retries=0)
    reply = client.chat.completions.create(
        model=SMOLLM2,  # greedy, it closes the forced call within the budget
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=48,
        temperature=0,
        extra_headers={"x-session-id": f"staged-{time.time_ns()}"},
    )
    assert reply.choices[0].finish_reason == "tool_calls"
    deadline = time.monotonic() + 10  # a published StageRequest, applied asynchronously
    while (staged := total(PREFILL, "kvfabric_prefill_staged_blocks_total")) <= before:
        assert time.monotonic() < deadline, "no prefill worker staged the session"
        time.sleep(0.1)
    assert staged - before >= reply.usage.prompt_tokens // BLOCK - 1
    assert total(INGRESS, "kvfabric_ingress_staged_turns_total") >= 1


def test_anthropic_sessions_and_response_chains_are_diagnosed(
    ant: anthropic.Anthropic, oai: openai.OpenAI
) -> None:
    user = {"user_id": f"user-{time.time_ns()}"}
    turn_1 = [{"role": "user", "content": QUESTION}]
    raw = ant.messages.with_raw_response.create(
        model=TINY, system=SYSTEM, messages=turn_1, max_tokens=8, metadata=user
    )
    assert diagnosed(raw)[1]["cause"] == "never_seen"
    raw = ant.messages.with_raw_response.create(
        model=TINY, system=SYSTEM + " Edited.", messages=turn_1, max_tokens=8, metadata=user
    )
    assert diagnosed(raw)[0]["cause"] == diagnosed(raw)[1]["cause"] == "system_changed"

    raw = oai.responses.with_raw_response.create(
        model=TINY, instructions=SYSTEM, input=QUESTION, max_output_tokens=8
    )
    assert diagnosed(raw)[1]["cause"] == "never_seen"
    first = raw.parse()
    raw = oai.responses.with_raw_response.create(
        model=TINY,
        instructions=SYSTEM + " Edited.",
        input="Now add type hints.",
        previous_response_id=first.id,
        max_output_tokens=8,
    )
    assert diagnosed(raw)[1]["cause"] == "system_changed"


# -- Anthropic Messages ------------------------------------------------------------------
@pytest.mark.parametrize("model", MODELS)
def test_anthropic_plain_and_streamed_agree(ant: anthropic.Anthropic, model: str) -> None:
    messages = [{"role": "user", "content": QUESTION}]
    plain = ant.messages.create(
        model=model, messages=messages, max_tokens=12, extra_body={"temperature": 0}
    )
    assert plain.stop_reason in ("end_turn", "max_tokens")
    assert plain.usage.output_tokens <= 12
    with ant.messages.stream(
        model=model, messages=messages, max_tokens=12, extra_body={"temperature": 0}
    ) as s:
        streamed_text = "".join(s.text_stream)
        final = s.get_final_message()
    assert streamed_text == plain.content[0].text == final.content[0].text
    assert final.stop_reason == plain.stop_reason
    assert final.usage.output_tokens == plain.usage.output_tokens


@pytest.mark.parametrize("model", MODELS)
def test_anthropic_tool_use_streams(ant: anthropic.Anthropic, model: str) -> None:
    tool = {
        "name": "get_weather",
        "description": "The weather in a city now.",
        "input_schema": WEATHER["function"]["parameters"],
    }
    with ant.messages.stream(
        model=model,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[tool],
        tool_choice={"type": "tool", "name": "get_weather"},
        max_tokens=24,
    ) as s:
        final = s.get_final_message()  # the SDK parses every partial_json as it comes
    uses = [b for b in final.content if b.type == "tool_use"]
    assert uses and uses[0].name == "get_weather" and uses[0].id.startswith("toolu_")
    assert final.stop_reason in ("tool_use", "max_tokens")


def test_anthropic_stop_sequence_is_reported(ant: anthropic.Anthropic) -> None:
    plain = ant.messages.create(
        model=TINY,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=40,
        extra_body={"temperature": 0},
    )
    text = plain.content[0].text
    stop = text[len(text) // 2 :][:3]
    assert stop.strip(), text
    cut = ant.messages.create(
        model=TINY,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=40,
        extra_body={"temperature": 0},
        stop_sequences=[stop],
    )
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert text.startswith(cut.content[0].text) and stop not in cut.content[0].text


# -- OpenAI Responses -------------------------------------------------------------------
@pytest.mark.parametrize("model", MODELS)
def test_responses_stream_store_and_chain(oai: openai.OpenAI, model: str) -> None:
    # A long first input: the cached share is counted in whole blocks of 16.
    events = list(
        oai.responses.create(
            model=model, input=f"{SYSTEM}\n\n{QUESTION}", max_output_tokens=10, stream=True
        )
    )
    assert events[0].type == "response.created"  # OR-S-01
    assert [e.sequence_number for e in events] == list(range(len(events)))
    last = events[-1]
    assert last.type in ("response.completed", "response.incomplete")
    first = last.response
    if last.type == "response.incomplete":  # OR-S-07
        assert first.incomplete_details.reason == "max_output_tokens"
    assert first.usage.input_tokens_details.cached_tokens <= first.usage.input_tokens
    assert oai.responses.retrieve(first.id).output[0].content[0].text == first.output_text

    second = oai.responses.create(
        model=model, previous_response_id=first.id, input="Now add type hints.", max_output_tokens=4
    )
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens
    assert second.usage.input_tokens_details.cached_tokens >= 0.8 * first.usage.input_tokens

    unstored = oai.responses.create(model=model, input=QUESTION, max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.create(model=model, previous_response_id=unstored.id, input="x")


def test_responses_function_call_item(oai: openai.OpenAI) -> None:
    tool = {
        "type": "function",
        "name": "get_weather",
        **{k: WEATHER["function"][k] for k in ("description", "parameters")},
    }
    response = oai.responses.create(
        model=SMOLLM2,
        input="Weather in Paris?",
        tools=[tool],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=24,
    )
    OpenAIResponse.model_validate(response.model_dump())
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and calls[0].call_id


# -- raw frames ---------------------------------------------------------------------------
def test_raw_frames_of_each_protocol(url: str) -> None:
    chat = sse_frames(
        url,
        "/v1/chat/completions",
        {
            "model": TINY,
            "messages": [{"role": "user", "content": QUESTION}],
            "max_tokens": 6,
            "stream": True,
        },
    )
    assert chat[-1] == (None, "[DONE]")
    for _, data in chat[:-1]:
        assert json.loads(data)["object"] == "chat.completion.chunk"
        ChatCompletionChunk.model_validate_json(data)

    responses = sse_frames(
        url,
        "/v1/responses",
        {"model": TINY, "input": QUESTION, "max_output_tokens": 6, "stream": True},
    )
    adapter = TypeAdapter(ResponseStreamEvent)
    numbers = []
    for name, data in responses:
        event = adapter.validate_json(data)
        assert name == event.type
        numbers.append(event.sequence_number)
    assert numbers == list(range(len(responses)))
    assert all(data != "[DONE]" for _, data in responses)

    messages = sse_frames(
        url,
        "/v1/messages",
        {
            "model": TINY,
            "messages": [{"role": "user", "content": QUESTION}],
            "max_tokens": 6,
            "stream": True,
        },
        {"anthropic-version": "2023-06-01"},
    )
    adapter = TypeAdapter(anthropic.types.RawMessageStreamEvent)
    names = [name for name, _ in messages if name != "ping"]
    assert names[0] == "message_start" and names[-1] == "message_stop"  # AN-S-01, AN-S-02
    assert names.count("message_start") == 1 and names.count("message_delta") == 1
    for name, data in messages:
        assert json.loads(data)["type"] == name
        if name != "ping":
            adapter.validate_json(data)


# -- errors ------------------------------------------------------------------------------
def test_errors_in_each_protocol_shape(url: str, oai: openai.OpenAI, ant: anthropic.Anthropic):
    bad_oai = openai.OpenAI(base_url=f"{url}/v1", api_key="kvf-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_oai.chat.completions.create(model=TINY, messages=[{"role": "user", "content": "x"}])
    bad_ant = anthropic.Anthropic(base_url=url, api_key="kvf-wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        bad_ant.messages.create(
            model=TINY, max_tokens=4, messages=[{"role": "user", "content": "x"}]
        )

    with pytest.raises(openai.NotFoundError) as missing:
        oai.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "x"}])
    assert SMOLLM2 in str(missing.value) and TINY in str(missing.value)
    with pytest.raises(anthropic.NotFoundError):
        ant.messages.create(
            model="claude-9", max_tokens=4, messages=[{"role": "user", "content": "x"}]
        )

    long_prompt = "def f(x):\n    return x\n" * 200  # well past tiny-coder's 512 tokens
    with pytest.raises(openai.BadRequestError) as too_long:
        oai.chat.completions.create(model=TINY, messages=[{"role": "user", "content": long_prompt}])
    assert "512" in str(too_long.value)
    with pytest.raises(anthropic.BadRequestError):
        ant.messages.create(
            model=TINY, max_tokens=100_000, messages=[{"role": "user", "content": "x"}]
        )

    huge = "x" * (MAX_BODY + 1)
    with pytest.raises(openai.APIStatusError) as large:
        oai.chat.completions.create(model=TINY, messages=[{"role": "user", "content": huge}])
    assert large.value.status_code == 413
    with pytest.raises(anthropic.APIStatusError) as large_ant:
        ant.messages.create(model=TINY, max_tokens=4, messages=[{"role": "user", "content": huge}])
    assert large_ant.value.status_code == 413

    def chunked():  # no Content-Length: counted as it arrives
        yield b'{"model": "tiny-coder", "max_tokens": 4, "messages": [{"role": "user", '
        yield b'"content": "' + b"x" * (MAX_BODY + 1) + b'"}]}'

    r = httpx.post(
        f"{url}/v1/messages",
        content=chunked(),
        headers={"x-api-key": KEY, "content-type": "application/json"},
    )
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"

    # Validation: the protocol's shape, not FastAPI's.
    r = httpx.post(
        f"{url}/v1/messages", json={"model": TINY, "messages": []}, headers={"x-api-key": KEY}
    )
    assert r.status_code == 400 and r.headers["x-should-retry"] == "false"
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    r = httpx.post(
        f"{url}/v1/chat/completions",
        json={"model": TINY},
        headers={"authorization": f"Bearer {KEY}"},
    )
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(
        f"{url}/v1/chat/completions",
        json={
            "model": TINY,
            "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
            ],
        },
        headers={"authorization": f"Bearer {KEY}"},
    )
    assert r.status_code == 400 and "image_url" in r.json()["error"]["message"]


# -- cancellation ------------------------------------------------------------------------
def test_a_client_that_goes_away_cancels_downstream(cluster: Cluster, url: str) -> None:
    body = {
        "model": SMOLLM2,
        "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": 400,
        "stream": True,
    }
    with httpx.stream(
        "POST",
        f"{url}/v1/chat/completions",
        json=body,
        headers={"authorization": f"Bearer {KEY}"},
        timeout=60,
    ) as r:
        data = []
        for line in r.iter_lines():
            if line.startswith("data: "):
                data.append(json.loads(line[6:]))
            if len(data) >= 3:
                break
    request_id = data[0]["id"].removeprefix("chatcmpl-")

    async def record():
        bus = await connect(cluster)
        try:
            return (await usage_records(bus, {request_id}, timeout_s=30))[request_id]
        finally:
            await bus.close()

    usage = asyncio.run(record())
    assert usage.status == UsageStatus.CANCELLED
    assert 0 < usage.num_output_tokens < 400


# -- replicas, keys, the OpenAPI document --------------------------------------------------
def test_a_conversation_continues_on_another_replica(cluster: Cluster) -> None:
    first_url, second_url = cluster.http_urls
    one = openai.OpenAI(base_url=f"{first_url}/v1", api_key=KEY, max_retries=0)
    other = openai.OpenAI(base_url=second_url, api_key=KEY, max_retries=0)  # no /v1 (C-05)
    first = one.responses.create(model=TINY, input=QUESTION, max_output_tokens=4)
    second = other.responses.create(
        model=TINY, previous_response_id=first.id, input="And tests?", max_output_tokens=4
    )
    assert second.usage.input_tokens > first.usage.input_tokens
    assert other.responses.retrieve(first.id).id == first.id


def test_keys_created_listed_and_revoked_through_the_cli(cluster: Cluster) -> None:
    where = ["--nats-url", cluster.nats_url, "--root", cluster.spec.root]
    created = subprocess.run(
        [KVFABRIC, "keys", "create", "--account", "acme", "--name", "ci", *where],
        env=cluster.admin_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    key_id, key = created.split()[0], created.split()[-1]
    assert key.startswith("kvf-") and key_id.startswith("key_")
    listed = subprocess.run(
        [KVFABRIC, "keys", "list", *where],
        env=cluster.admin_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert key_id in listed and "acme" in listed and key not in listed  # stored hashed
    for url in cluster.http_urls:  # every replica knows it
        client = anthropic.Anthropic(base_url=url, api_key=key, max_retries=0)
        reply = client.messages.create(
            model=TINY, max_tokens=2, messages=[{"role": "user", "content": "def f"}]
        )
        assert reply.usage.output_tokens > 0
    subprocess.run(
        [KVFABRIC, "keys", "revoke", key_id, *where],
        env=cluster.admin_env(),
        timeout=60,
        check=True,
        capture_output=True,
    )
    client = openai.OpenAI(base_url=f"{cluster.http_urls[0]}/v1", api_key=key, max_retries=0)
    deadline = time.monotonic() + 10  # lookups are cached for 2 s
    while True:
        try:
            client.chat.completions.create(
                model=TINY, max_tokens=1, messages=[{"role": "user", "content": "x"}]
            )
        except openai.AuthenticationError:
            break
        assert time.monotonic() < deadline, "a revoked key still works"
        time.sleep(0.5)


def test_the_openapi_document_lists_every_route(url: str) -> None:
    document = httpx.get(f"{url}/openapi.json").json()
    assert {
        "/v1/chat/completions",
        "/v1/responses",
        "/v1/responses/{response_id}",
        "/v1/messages",
        "/v1/messages/count_tokens",
        "/v1/models",
        "/v1/kvfabric/cache/explain/{request_id}",
        "/health",
    } <= set(document["paths"])
    schema = document["paths"]["/v1/messages"]["post"]["requestBody"]["content"]
    assert "application/json" in schema


@pytest.mark.parametrize("model", MODELS)
def test_a_tool_round_trip_continues_from_the_store(oai: openai.OpenAI, model: str) -> None:
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    first = oai.chat.completions.create(
        model=model, messages=messages, tools=[WEATHER], tool_choice=named, max_tokens=24
    )
    call = first.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather"
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature_c": 18}'},
    ]
    second = oai.chat.completions.create(
        model=model, messages=messages, tools=[WEATHER], max_tokens=8
    )
    assert second.usage.prompt_tokens > first.usage.prompt_tokens
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= 0.8 * first.usage.prompt_tokens, (cached, first.usage.prompt_tokens)
