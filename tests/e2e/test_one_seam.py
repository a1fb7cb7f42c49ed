"""The engine is the only seam between a worker and its model: a mock cluster and a
tiny-coder cluster serve the same two-turn session, and the same worker, restore, handoff and
persist functions run in both.

The call trace is coverage's, taken inside every worker process (coverage starts in each
Python process that finds COVERAGE_PROCESS_START, through the .pth file coverage installs):
per cluster, the functions of services/prefill, services/decode and worker/serving whose
first statement ran. The handoffs are read off the bus: a second subscriber to decode's
suffix subject gets a copy of every `SuffixReady`, which must carry pages and a window of
the model's own sizes from the mock too.
"""

from __future__ import annotations

import ast
import asyncio
import os
import random
from pathlib import Path

import coverage
import pytest

from shared.blocks import RequestBlocks
from shared.bus import Bus
from shared.client import GenerateResult, build_request, generate
from shared.models import BUNDLED_MODEL_DIR
from shared.schema import SuffixReady
from shared.subjects import BILLING, DECODE, INGRESS, PREFILL, ROUTER
from tests.e2e.cluster_helpers import (
    apart,
    connect,
    num_indexed_blocks,
    on_the_client_host,
    run_cluster,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REPO = Path(__file__).parents[2]
TRACED = ("services/prefill", "services/decode", "worker/serving")
BLOCK = 16
MODEL = BUNDLED_MODEL_DIR.name
# What must have run in both: restore (from the store, with the window's snapshot), compute,
# handoff (staged, pulled), persist (blocks and windows, by prefill and by decode).
ESSENTIAL = {
    "services/prefill/restore.py:PrefixRestorer.restore",
    "services/prefill/restore.py:PrefixRestorer._load",
    "services/prefill/restore.py:PrefixRestorer._window",
    "services/prefill/worker.py:PrefillWorker._prefill",
    "services/prefill/worker.py:PrefillWorker._send_suffix",
    "services/prefill/worker.py:PrefillWorker._persist",
    "services/prefill/handoff.py:tell_decode",
    "services/prefill/handoff.py:put_window",
    "services/decode/worker.py:DecodeWorker._join",
    "services/decode/worker.py:DecodeWorker._pull",
    "services/decode/worker.py:DecodeWorker._on_finish",
    "services/decode/finish.py:Finisher.end",
    "worker/serving/pages.py:stage_pages",
    "worker/serving/pages.py:unstage_pages",
    "worker/serving/pages.py:store_blocks",
    "worker/serving/pages.py:take_prefix",
}

# Reached only from decode's once-a-second deadline sweep when a request happens to be in
# flight at a tick: whether it runs is timing, not the code path.
BY_THE_CLOCK = {
    "worker/serving/lifecycle.py:StreamedRequest.seconds_left",
    # Orphaned usage outboxes are looked for every 30 s: a run that lasts longer runs it.
    "services/decode/main.py:open_outbox.adopt",
}


def first_statements(path: Path) -> dict[int, str]:
    """line of each function's first statement (after its docstring) -> its qualified name."""
    tree = ast.parse(path.read_text())
    lines: dict[int, str] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                body = child.body
                if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                    body = body[1:] or body
                lines[body[0].lineno] = f"{prefix}{child.name}"
                visit(child, f"{prefix}{child.name}.")

    visit(tree, "")
    return lines


def functions_run(data_dir: Path) -> set[str]:
    cov = coverage.Coverage(data_file=str(data_dir / ".coverage"))
    cov.combine([str(data_dir)])
    data = cov.get_data()
    ran = set()
    for filename in data.measured_files():
        relative = Path(filename).resolve().relative_to(REPO).as_posix()
        if not relative.startswith(TRACED):
            continue
        executed = set(data.lines(filename) or ())
        for line, name in first_statements(Path(filename)).items():
            if line in executed:
                ran.add(f"{relative}:{name}")
    return ran


async def session(bus: Bus) -> list[GenerateResult]:
    """Two turns: the second re-sends the first with its answer, its prefix in the store."""
    rng = random.Random(11)
    prompt = [rng.randrange(3, 4000) for _ in range(150)]
    results = []
    for turn in range(2):
        request = build_request(prompt, model=MODEL, block_size_tokens=BLOCK, max_tokens=12)
        results.append(await generate(bus, request, liveness_timeout_s=30))
        if turn == 0:  # the next turn's hit: kv-index knows the first prompt's blocks
            hashes = RequestBlocks.hash_prompt(prompt, model=MODEL, block_size_tokens=BLOCK).hashes
            assert await num_indexed_blocks(bus, hashes, timeout_s=30) == len(hashes)
        prompt = prompt + results[-1].token_ids + [rng.randrange(3, 4000) for _ in range(40)]
    return results


def serve(engine: str, state_dir: Path) -> tuple[list[GenerateResult], list[SuffixReady], set]:
    data_dir = state_dir / "coverage"
    data_dir.mkdir(parents=True)
    rc = state_dir / "coveragerc"
    rc.write_text(
        "[run]\n"
        f"data_file = {data_dir / '.coverage'}\n"
        "parallel = true\n"
        "sigterm = true\n"
        f"source = {', '.join(str(REPO / t) for t in TRACED)}\n"
    )
    args = ["--engine", engine, "--kv-block-size-tokens", str(BLOCK)]
    outer = os.environ.get("COVERAGE_PROCESS_START")  # a coverage run of the suite's own
    os.environ["COVERAGE_PROCESS_START"] = str(rc)
    try:
        fixture = run_cluster(
            state_dir,
            replicas={BILLING: 0, INGRESS: 0},
            extra_args={
                PREFILL: args,
                DECODE: args,
                ROUTER: ["--decode-page-size-tokens", str(BLOCK)],
            },
            ready_timeout_s=120,
            hosts=apart,
        )
        cluster = next(fixture)
    finally:  # later clusters: as before
        if outer is None:
            del os.environ["COVERAGE_PROCESS_START"]
        else:
            os.environ["COVERAGE_PROCESS_START"] = outer
    try:

        async def run() -> tuple[list[GenerateResult], list[SuffixReady]]:
            bus = await connect(cluster)
            handoffs: list[SuffixReady] = []

            async def keep(ready: SuffixReady) -> None:
                handoffs.append(ready)

            try:
                await bus.subscribe(
                    bus.subjects.instance(bus.subjects.decode_suffix, "decode-0"), SuffixReady, keep
                )
                results = await session(bus)
                return results, handoffs
            finally:
                await bus.close()

        with on_the_client_host(cluster):
            results, handoffs = asyncio.run(run())
    finally:
        next(fixture, None)  # stops the cluster: each process writes its coverage data
    return results, handoffs, functions_run(data_dir)


def test_mock_and_model_run_the_same_worker_functions(tmp_path: Path) -> None:
    mock_results, mock_handoffs, mock_ran = serve("mock", tmp_path / "mock")
    model_results, model_handoffs, model_ran = serve("model", tmp_path / "model")

    assert model_ran >= ESSENTIAL, sorted(ESSENTIAL - model_ran)
    mock_ran, model_ran = mock_ran - BY_THE_CLOCK, model_ran - BY_THE_CLOCK
    assert mock_ran == model_ran, (
        f"only on the model: {sorted(model_ran - mock_ran)}; "
        f"only on the mock: {sorted(mock_ran - model_ran)}"
    )
    for results in (mock_results, model_results):
        assert [r.finish_reason for r in results] == ["length", "length"]
        assert results[0].usage.num_cached_tokens == 0
        assert results[1].usage.num_cached_tokens > 0
    assert len(mock_handoffs) == len(model_handoffs) == 2
    for mock, model in zip(mock_handoffs, model_handoffs, strict=True):
        assert mock.num_blocks > 0 and mock.window_nbytes > 0  # pages and a window
        assert mock.first_token_id is not None
        assert (mock.block_nbytes, mock.window_nbytes) == (model.block_nbytes, model.window_nbytes)
