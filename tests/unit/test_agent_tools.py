"""Named tools in the agent workload: seeded plans (the same seed, the same calls and
durations), durations whose medians and spreads are the ones stated, waits scaled, results of
each tool's kind; the harness that forces each step's call and sends its result back (against
a fake server speaking OpenAI's SSE); the staging benchmark's reading of its traces."""

from __future__ import annotations

import json
import math
import random
import statistics
from collections import Counter
from pathlib import Path

import httpx
import openai
import pytest

from loadtest.agent.tool_agents import ToolAgents, Turn
from loadtest.agent.tools import BY_NAME, TOOLS, plan_calls
from loadtest.agent.workload import Workload
from loadtest.bench_staging import LONG_TOOLS, SNAPSHOT_TTL_S, Side, timed

NAMED = Workload(num_sessions=4, num_steps=5, named_tools=True, tool_time_scale=0.01, seed=3)


def test_the_same_seed_gives_the_same_calls_and_another_seed_others() -> None:
    again = Workload(**NAMED.to_dict())
    assert [s.calls for s in again.sessions()] == [s.calls for s in NAMED.sessions()]
    other = Workload(**{**NAMED.to_dict(), "seed": 4})
    assert [s.calls for s in other.sessions()] != [s.calls for s in NAMED.sessions()]


def test_named_tools_plan_every_step_and_change_nothing_else() -> None:
    plain = Workload(**{**NAMED.to_dict(), "named_tools": False})
    for named, unnamed in zip(NAMED.sessions(), plain.sessions(), strict=True):
        assert len(named.calls) == named.num_steps and not unnamed.calls
        assert (named.system, named.task) == (unnamed.system, unnamed.task)
        assert len(named.tool_results) == named.num_steps - 1
        assert unnamed.wait_s(0) == 0.0


def test_waits_are_the_durations_scaled() -> None:
    session = NAMED.session(1)
    for step, call in enumerate(session.calls):
        assert session.wait_s(step) == pytest.approx(call.duration_s * 0.01)
    with pytest.raises(ValueError, match="tool_time_scale"):
        Workload(named_tools=True, tool_time_scale=0)


def test_each_result_is_its_tools_kind_of_text() -> None:
    marks = {
        "read_file": "$ cat -n",
        "grep": "$ grep -rn",
        "edit": "diff --git",
        "run_tests": "test session starts",
        "build": "$ make",
    }
    seen = set()
    for session in Workload(num_sessions=12, num_steps=6, named_tools=True).sessions():
        for call, result in zip(session.calls, session.tool_results, strict=False):
            assert marks[call.tool] in result
            seen.add(call.tool)
    assert seen == set(marks)


def test_durations_have_the_stated_medians_and_the_long_tools_outlast_the_ttl() -> None:
    """log(duration) = log(median) + N(0, sigma_session^2 + sigma_call^2): its median is the
    tool's, over many sessions."""
    rng = random.Random(0)
    durations: dict[str, list[float]] = {t.name: [] for t in TOOLS}
    picks = Counter()
    for _ in range(3000):
        for call in plan_calls(rng, 4):
            durations[call.tool].append(call.duration_s)
            picks[call.tool] += 1
    for tool in TOOLS:
        assert statistics.median(durations[tool.name]) == pytest.approx(tool.median_s, rel=0.1)
        # the spread of log(duration): both levels together
        spread = statistics.stdev(math.log(d) for d in durations[tool.name])
        assert spread == pytest.approx(math.hypot(tool.sigma_session, tool.sigma_call), rel=0.1)
        share = picks[tool.name] / picks.total()
        assert share == pytest.approx(tool.weight / sum(t.weight for t in TOOLS), abs=0.02)
    assert set(LONG_TOOLS) == {"run_tests", "build"}
    assert all(BY_NAME[name].median_s > SNAPSHOT_TTL_S for name in LONG_TOOLS)


def test_a_sessions_calls_of_a_tool_spread_less_than_all_sessions() -> None:
    """What a wait learned per session can use: its repository's suite runs about as long
    each time."""
    rng = random.Random(1)
    within, means = [], []
    for _ in range(400):
        logs = [math.log(c.duration_s) for c in plan_calls(rng, 12) if c.tool == "run_tests"]
        if len(logs) >= 2:
            within.append(statistics.stdev(logs))
            means.append(statistics.mean(logs))
    assert statistics.mean(within) == pytest.approx(BY_NAME["run_tests"].sigma_call, rel=0.25)
    assert statistics.stdev(means) > 2 * statistics.mean(within)


def test_a_tool_is_an_openai_function_with_one_required_argument() -> None:
    schema = BY_NAME["grep"].schema()
    assert schema["type"] == "function" and schema["function"]["name"] == "grep"
    assert schema["function"]["parameters"]["required"] == ["pattern"]


# -- the harness ---------------------------------------------------------------------------
def sse(*chunks: dict) -> bytes:
    return b"".join(f"data: {json.dumps(c)}\n\n".encode() for c in chunks) + b"data: [DONE]\n\n"


def chunk(delta: dict | None = None, finish: str | None = None, usage: dict | None = None) -> dict:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
    body = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m"}
    return {**body, "choices": choices, "usage": usage}


async def test_each_step_forces_its_call_and_the_next_sends_the_call_and_its_result() -> None:
    bodies: list[dict] = []

    def answer(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        bodies.append({**body, "session": request.headers["x-session-id"]})
        name = body["tool_choice"]["function"]["name"]
        call = {"index": 0, "id": f"call_{len(bodies)}", "type": "function"}
        usage = {"prompt_tokens": 100, "completion_tokens": 3, "total_tokens": 103}
        usage["prompt_tokens_details"] = {"cached_tokens": 64 * (len(bodies) > 1)}
        stream = sse(
            chunk({"role": "assistant", "tool_calls": [{**call, "function": {"name": name}}]}),
            chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"a": 1}'}}]}),
            chunk({}, "tool_calls"),
            chunk(usage=usage),
        )
        headers = {"content-type": "text/event-stream", "x-trace-id": f"t{len(bodies)}"}
        return httpx.Response(200, content=stream, headers=headers)

    client = openai.AsyncOpenAI(
        base_url="http://fake/v1",
        api_key="k",
        http_client=httpx.AsyncClient(transport=httpx.MockTransport(answer)),
    )
    workload = Workload(num_sessions=1, num_steps=3, named_tools=True, tool_time_scale=1e-4)
    [session] = workload.sessions()
    turns = await ToolAgents(client, "m", "run-a", stop=("</tool_call>",)).run([session])

    assert [b["tool_choice"]["function"]["name"] for b in bodies] == [c.tool for c in session.calls]
    assert {b["session"] for b in bodies} == {"run-a-0"}
    assert all(b["cache_salt"] == "run-a" and b["stop"] == ["</tool_call>"] for b in bodies)
    last = bodies[-1]["messages"]
    assert [m["role"] for m in last] == ["system", "user", "assistant", "tool", "assistant", "tool"]
    assert last[2]["tool_calls"][0]["function"] == {
        "name": session.calls[0].tool,
        "arguments": '{"a": 1}',
    }
    assert last[3] == {
        "role": "tool",
        "tool_call_id": "call_1",
        "content": session.tool_results[0],
    }
    assert last[5]["content"] == session.tool_results[1]
    assert [t.after_tool for t in turns] == [None, session.calls[0].tool, session.calls[1].tool]
    assert [t.trace_id for t in turns] == ["t1", "t2", "t3"]
    assert all(t.finish_reason == "tool_calls" and t.error is None for t in turns)
    assert [t.cached_tokens for t in turns] == [0, 64, 64]


# -- the benchmark's reading of its traces -------------------------------------------------
def test_turns_take_ingress_ttft_and_the_prefix_load_from_their_traces(tmp_path: Path) -> None:
    spans = [
        {"trace_id": "a", "name": "client generate", "attributes": {"kvfabric.ttft_ms": 412.5}},
        {
            "trace_id": "a",
            "name": "prefill load",
            "start_ns": 1_000_000,
            "end_ns": 4_500_000,
            "attributes": {
                "kvfabric.num_local_blocks": 3,
                "kvfabric.num_host_blocks": 9,
                "kvfabric.num_blocks": 2,  # read from the store
            },
        },
        {"trace_id": "b", "name": "client generate", "attributes": {"kvfabric.ttft_ms": 90.0}},
        {"trace_id": "b", "name": "router route", "start_ns": 0, "end_ns": 1, "attributes": {}},
    ]
    lines = "".join(json.dumps({"start_ns": 0, "end_ns": 0, **s}) + "\n" for s in spans)
    (tmp_path / "ingress-0.jsonl").write_text(lines)
    turns = [
        Turn(0, 0, None, 0.0, trace_id="b"),
        Turn(0, 1, "build", 1.0, trace_id="a"),
        Turn(1, 1, "grep", 2.0, trace_id="gone"),
    ]
    first, after_build, untraced = timed(turns, tmp_path)
    assert (first.ttft_ms, first.load_ms) == (90.0, None)
    assert (after_build.ttft_ms, after_build.load_ms) == (412.5, 3.5)
    tiers = (after_build.num_pool_blocks, after_build.num_host_blocks, after_build.num_store_blocks)
    assert tiers == (3, 9, 2)
    assert (untraced.ttft_ms, untraced.load_ms) == (None, None)
    side = Side("on", [first, after_build, untraced], 1.0, {})
    assert side.next_turns(LONG_TOOLS) == [after_build]
    assert side.quantile("ttft_ms", 50) == 412.5  # the first step is not a next turn
