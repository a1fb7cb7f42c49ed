"""The agent load generator against real clusters (mock engine, separate processes):

- `python -m loadtest.bench_agent --quick --protocol both` starts its own cluster and drives
  it through the `openai` and the `anthropic` SDK: every request answered, TTFT measured,
  later steps served mostly from the cache, what it printed equal to its bench.json, and the
  per-request reports and PNGs written;
- `run_agents` against a cluster this module starts (as against any server): each step's
  prompt hits through the previous step's prompt *and* the model's answer, so the answer sent
  back is the one the server generated, and the think time passes between steps.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path

import pytest

from loadtest.agent import AgentReport, Target, Workload, run_agents
from loadtest.agent.report import hit_share
from loadtest.bench_agent import QUICK
from loadtest.results import BenchResult, Figure, Ratio
from services.admin.launcher import Cluster
from shared.subjects import BILLING, DECODE, INGRESS, PREFILL, ROUTER
from tests.e2e.cluster_helpers import apart, run_cluster

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
KEY = "kvf-test-agent-key-0123"
BLOCK = 16
MOCK_ARGS = [
    "--engine",
    "mock",
    "--kv-block-size-tokens",
    str(BLOCK),
    "--max-model-len",
    "8192",
    "--store-file-nbytes",
    str(8 << 20),
]
QUICK_REQUESTS = QUICK[0] * QUICK[1]  # sessions x steps


def rebuilt(bench: dict) -> BenchResult:
    """The BenchResult a bench.json holds, to print it again."""
    result = BenchResult(bench["name"], bench["quick"], notes=bench["notes"])
    result.ratios = [Ratio(**{f.name: r[f.name] for f in fields(Ratio)}) for r in bench["ratios"]]
    result.figures = [
        Figure(**{f.name: x[f.name] for f in fields(Figure)}) for x in bench["figures"]
    ]
    return result


def test_the_benchmark_drives_its_own_cluster_through_both_sdks(tmp_path: Path) -> None:
    out = tmp_path / "out"
    command = [
        sys.executable,
        "-m",
        "loadtest.bench_agent",
        "--quick",
        "--protocol",
        "both",
        "--out",
        str(out),
        "--no-progress",
    ]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    bench = json.loads((out / "bench.json").read_text())
    assert done.stdout.splitlines() == rebuilt(bench).lines()  # every printed figure is kept
    figures = {f["name"]: f["value"] for f in bench["figures"]}

    for protocol in ("openai", "anthropic"):
        report = AgentReport.load(out / f"report-{protocol}.json")
        assert report.target["protocol"] == protocol
        assert len(report.records) == QUICK_REQUESTS and report.num_skipped == 0
        assert report.errors_by_class == {}
        for r in report.records:
            assert r.ttft_s is not None and 0 < r.ttft_s <= r.e2e_s, r
            assert r.prompt_tokens and r.output_tokens and r.cached_tokens is not None, r
        for session in {r.session for r in report.records}:
            prompts = [r.prompt_tokens for r in report.records if r.session == session]
            assert prompts == sorted(prompts) and len(set(prompts)) == len(prompts)  # it grows
        later = hit_share(report.later_steps())
        assert later is not None and later > 0.5, later
        assert figures[f"{protocol}: cache-hit share, later steps"] == pytest.approx(100 * later)
        assert figures[f"{protocol}: requests answered"] == QUICK_REQUESTS
        assert figures[f"{protocol}: errors"] == 0
        assert figures[f"{protocol}: TTFT p50"] > 0 and figures[f"{protocol}: requests/s"] > 0
        ratio = next(r for r in bench["ratios"] if r["name"].startswith(f"{protocol}: TTFT p50"))
        assert ratio["ours"] > 0 and ratio["peer"] > 0

    for name in ("ttft_per_step.png", "hit_share_per_step.png", "latency_cdf.png"):
        png = (out / name).read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000, name


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    yield from run_cluster(
        tmp_path_factory.mktemp("agents"),
        replicas={BILLING: 0},
        extra_args={
            PREFILL: MOCK_ARGS,
            DECODE: MOCK_ARGS,
            ROUTER: ["--decode-page-size-tokens", str(BLOCK)],
            INGRESS: ["--dev-api-key", KEY],
        },
        ready_timeout_s=120,
        hosts=apart,
    )


@pytest.mark.parametrize("protocol", ["openai", "anthropic"])
async def test_each_step_hits_through_the_answer_the_server_gave(
    cluster: Cluster, protocol: str
) -> None:
    workload = Workload(
        num_sessions=2,
        num_steps=5,
        initial_context_tokens=400,
        growth_tokens_per_step=100,
        max_output_tokens=24,
        think_time_s=0.3,
        seed=11 if protocol == "openai" else 12,
    )
    target = Target(f"{cluster.http_urls[0]}/v1", KEY, "tiny-coder", protocol)  # type: ignore[arg-type]
    report = await run_agents(target, workload, concurrency=2)
    assert len(report.answered) == workload.num_requests, report.errors_by_class
    num_through_answer = 0
    for session in range(workload.num_sessions):
        steps = [r for r in report.records if r.session == session]
        for before, after in zip(steps, steps[1:], strict=False):
            assert before.prompt_tokens and before.output_tokens and after.cached_tokens
            assert after.started_s - (before.started_s + before.e2e_s) >= workload.think_time_s
            # Decode stores the previous prompt and its answer (all but the last token, whose
            # KV was never computed) in whole blocks, and the next step re-sends both.
            prompt_blocks = before.prompt_tokens // BLOCK * BLOCK
            answer_blocks = (before.prompt_tokens + before.output_tokens - 1) // BLOCK * BLOCK
            assert after.cached_tokens >= prompt_blocks, (before, after)
            # The mock's answers are random ids; one with half a UTF-8 character or an added
            # token (1.8% of tiny-coder's vocabulary) is text that re-tokenizes differently,
            # so only such answers stop the hit. The run is deterministic (seeded texts, the
            # mock's ids a hash of the prompt), so this counts the same every time.
            num_through_answer += after.cached_tokens >= answer_blocks > prompt_blocks
    assert num_through_answer >= 1, report.records
