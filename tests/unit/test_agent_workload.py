"""The agent load generator's pure parts: seeded sessions (the same seed, the same texts;
another seed, others), contexts that grow as configured (counted with tiny-coder's real
tokenizer), the conversation each step sends; the report's summaries, its JSON and its plots."""

from __future__ import annotations

import json
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
from tokenizers import Tokenizer

from loadtest.agent import AgentReport, RequestRecord, Workload, write_plots
from loadtest.agent.report import hit_share, percentiles
from loadtest.agent.runner import Target, error_class
from shared.models import BUNDLED_MODEL_DIR

WORKLOAD = Workload(
    num_sessions=6,
    num_steps=5,
    initial_context_tokens=1500,
    growth_tokens_per_step=300,
    max_output_tokens=32,
    seed=7,
)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(BUNDLED_MODEL_DIR / "tokenizer.json"))


def texts_of(workload: Workload) -> list[tuple[str, ...]]:
    return [(s.system, s.task, *s.tool_results) for s in workload.sessions()]


# -- sessions ------------------------------------------------------------------------------
def test_the_same_seed_gives_the_same_texts_and_another_seed_others() -> None:
    again = Workload(**WORKLOAD.to_dict())
    assert texts_of(again) == texts_of(WORKLOAD)
    other = texts_of(Workload(**{**WORKLOAD.to_dict(), "seed": 8}))
    for mine, theirs in zip(texts_of(WORKLOAD), other, strict=True):
        assert all(a != b for a, b in zip(mine, theirs, strict=True))


def test_sessions_differ_but_share_the_system_prompt_unless_told_not_to() -> None:
    sessions = WORKLOAD.sessions()
    assert len({s.task for s in sessions}) == len(sessions)
    assert len({s.tool_results for s in sessions}) == len(sessions)
    assert len({s.system for s in sessions}) == 1
    apart = Workload(**{**WORKLOAD.to_dict(), "shared_system_prompt": False}).sessions()
    assert len({s.system for s in apart}) == len(apart)


def test_a_volatile_harness_stamps_each_step_and_nothing_else() -> None:
    """Each step's system prompt: a billing header with its own nonce on top, the time at
    the end, the session's prompt between; the same under the same seed."""
    stamped = Workload(**{**WORKLOAD.to_dict(), "volatile_system": True})
    session = stamped.session(2)
    prompts = [session.system_for(step) for step in range(stamped.num_steps)]
    assert len(set(prompts)) == len(prompts)
    for prompt in prompts:
        header, *middle, clock = prompt.split("\n")
        assert header.startswith("x-anthropic-billing-header: ") and clock.startswith("Current")
        assert "\n".join(middle) == WORKLOAD.session(2).system
    assert stamped.session(2).system_for(3) == prompts[3]
    assert WORKLOAD.session(2).system_for(3) == WORKLOAD.session(2).system  # not stamped


def test_tool_results_look_like_the_tools_an_agent_calls() -> None:
    results = [r for s in Workload(num_sessions=20, num_steps=4).sessions() for r in s.tool_results]
    kinds = {r.split("\n", 1)[0] for r in results}
    assert kinds == {f"[tool result: {k}]" for k in ("read_file", "run_tests", "grep", "git_diff")}
    listing = next(r for r in results if r.startswith("[tool result: read_file]"))
    assert "def " in listing and "return " in listing
    tests = next(r for r in results if r.startswith("[tool result: run_tests]"))
    assert "test session starts" in tests and "AssertionError" in tests


@pytest.mark.parametrize(("initial", "growth"), [(1000, 200), (6000, 600), (20_000, 2000)])
def test_the_context_grows_as_configured(tokenizer: Tokenizer, initial: int, growth: int) -> None:
    workload = Workload(
        num_sessions=5, num_steps=4, initial_context_tokens=initial, growth_tokens_per_step=growth
    )

    def count(text: str) -> int:
        return len(tokenizer.encode(text).ids)

    for session in workload.sessions():
        first = count(session.system) + count(session.task)
        assert 0.85 * initial <= first <= 1.15 * initial, first
        assert len(session.tool_results) == workload.num_steps - 1
        for result in session.tool_results:
            assert 0.85 * growth <= count(result) <= 1.15 * growth, count(result)


def test_each_step_sends_the_previous_one_then_the_answer_and_a_tool_result() -> None:
    session = WORKLOAD.session(2)
    answers = [f"answer {k}" for k in range(WORKLOAD.num_steps - 1)]
    steps = [session.messages(answers[:k]) for k in range(WORKLOAD.num_steps)]
    assert [(m.role, m.content) for m in steps[0]] == [("user", session.task)]
    for k in range(1, WORKLOAD.num_steps):
        assert steps[k][: len(steps[k - 1])] == steps[k - 1]  # a prefix: what the cache hits
        assert [(m.role, m.content) for m in steps[k][-2:]] == [
            ("assistant", answers[k - 1]),
            ("user", session.tool_results[k - 1]),
        ]
    roles = [m.role for m in steps[-1]]
    assert roles == ["user", "assistant"] * (WORKLOAD.num_steps - 1) + ["user"]
    with pytest.raises(ValueError, match="has 5 steps"):
        session.messages([*answers, "one too many"])


def test_max_context_bounds_the_last_step(tokenizer: Tokenizer) -> None:
    workload = Workload(
        num_sessions=3,
        num_steps=6,
        initial_context_tokens=2000,
        growth_tokens_per_step=500,
        max_output_tokens=64,
    )
    answer = " ".join(["word"] * 64)  # 64 tokens or more: at least as long as any answer
    for session in workload.sessions():
        messages = session.messages([answer] * (workload.num_steps - 1))
        total = len(tokenizer.encode(session.system).ids) + sum(
            len(tokenizer.encode(m.content).ids) for m in messages
        )
        assert 0.85 * workload.max_context_tokens <= total <= 1.15 * workload.max_context_tokens


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("num_sessions", 0, "num_sessions must be >= 1"),
        ("num_steps", 0, "num_steps must be"),
        ("growth_tokens_per_step", -1, "growth_tokens_per_step must be >= 0"),
        ("think_time_s", -0.5, "think_time_s must be >= 0"),
    ],
)
def test_bad_sizes_are_refused_with_their_name(field: str, value: float, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Workload(**{field: value})


def test_a_target_refuses_a_bad_protocol_or_url_and_strips_v1() -> None:
    assert Target("http://h:1/v1/", "k", "m").root_url == "http://h:1"
    with pytest.raises(ValueError, match="protocol must be one of openai, anthropic"):
        Target("http://h:1", "k", "m", "grpc")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="http"):
        Target("h:1", "k", "m")
    assert "api_key" not in Target("http://h:1", "secret", "m").describe()


def test_errors_are_classed_by_http_status_stream_error_type_or_exception_type() -> None:
    request = httpx.Request("POST", "http://h/v1/messages")
    limited = openai.RateLimitError(
        "slow", response=httpx.Response(429, request=request), body=None
    )
    assert error_class(limited) == "HTTP 429"
    overloaded = {"type": "error", "error": {"type": "overloaded_error", "message": "busy"}}
    in_stream = anthropic.APIStatusError(
        "busy", response=httpx.Response(200, request=request), body=overloaded
    )  # what the SDK raises for an `event: error` after the 200 response
    assert error_class(in_stream) == "stream error overloaded_error"
    oai_event = openai.APIError("boom", request, body={"type": "server_error", "message": "x"})
    assert error_class(oai_event) == "stream error server_error"
    assert error_class(openai.APIConnectionError(request=request)) == "APIConnectionError"
    assert error_class(TimeoutError()) == "TimeoutError"


# -- the report ----------------------------------------------------------------------------
def record(session: int, step: int, **fields: object) -> RequestRecord:
    values = {
        "started_s": 0.0,
        "e2e_s": 0.5,
        "ttft_s": 0.1,
        "tpot_s": 0.01,
        "prompt_tokens": 1000,
        "cached_tokens": 0,
        "output_tokens": 16,
        **fields,
    }
    return RequestRecord(session, step, **values)  # type: ignore[arg-type]


def sample_report() -> AgentReport:
    records = [
        record(0, 0, ttft_s=0.4),
        record(0, 1, cached_tokens=900),
        record(0, 2, cached_tokens=950),
        record(1, 0, ttft_s=0.2),
        record(1, 1, cached_tokens=None),  # no count: not in the share
        record(1, 2, error="HTTP 429", ttft_s=None, prompt_tokens=None, cached_tokens=None),
    ]
    return AgentReport(
        target={"base_url": "http://h", "model": "m", "protocol": "openai"},
        workload=WORKLOAD.to_dict(),
        concurrency=2,
        wall_s=2.0,
        records=records,
        num_skipped=1,
    )


def test_the_report_summarizes_what_was_measured() -> None:
    report = sample_report()
    assert percentiles([1.0, 2.0, 3.0, None]) == {"p50": 2.0, "p90": 2.8, "p99": 2.98, "mean": 2.0}
    assert percentiles([None])["p50"] is None
    assert hit_share(report.later_steps()) == pytest.approx(1850 / 2000)
    assert hit_share(report.first_step()) == 0.0
    assert report.errors_by_class == {"HTTP 429": 1}
    assert report.throughput()["requests_per_s"] == pytest.approx(5 / 2.0)
    by_step = report.by_step()
    assert [s["step"] for s in by_step] == [0, 1, 2]
    assert by_step[0]["ttft_s"]["p50"] == pytest.approx(0.3)
    assert (by_step[2]["num_requests"], by_step[2]["num_answered"]) == (2, 1)


def test_the_report_round_trips_through_json(tmp_path: Path) -> None:
    report = sample_report()
    report.write_json(tmp_path / "report.json")
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["later_steps"]["hit_share"] == pytest.approx(1850 / 2000)
    assert data["num_skipped"] == 1 and len(data["records"]) == 6
    assert AgentReport.load(tmp_path / "report.json").to_dict() == report.to_dict()


def test_plots_are_written_as_png(tmp_path: Path) -> None:
    paths = write_plots({"openai": sample_report(), "other": sample_report()}, tmp_path)
    assert [p.name for p in paths] == [
        "ttft_per_step.png",
        "hit_share_per_step.png",
        "latency_cdf.png",
    ]
    for path in paths:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000
    with pytest.raises(ValueError, match="no reports"):
        write_plots({}, tmp_path)
