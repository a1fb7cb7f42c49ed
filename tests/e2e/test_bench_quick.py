"""Every benchmark of the suite runs in its quick mode through `kvfabric bench NAME --quick
--json` (a real process: clusters, servers and models as in a full run, at small sizes), and
its JSON holds every ratio and figure it printed, with the values printed. Speed is not
asserted: only that each side measured something."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from loadtest.registry import BENCHMARKS

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

KVFABRIC = Path(sys.executable).with_name("kvfabric")


# Run in quick mode by a test of their own, with more checks: left out here.
OWN_TEST = {"agent": "tests/e2e/test_agent_load.py", "faults": "tests/faults/test_bench_faults.py"}
# Parts run by a test of their own, left out here: the trace's live replay
# (tests/e2e/test_trace_live.py, alone: it keeps the trace's pace only with the machine to
# itself).
CI_ARGS = {"trace": ["--set", "offline=true"]}


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "name", [b.name for b in BENCHMARKS.values() if b.in_suite and b.name not in OWN_TEST]
)
def test_quick_mode_prints_what_its_json_holds(name: str, tmp_path: Path) -> None:
    out = tmp_path / f"{name}.json"
    # CI measures ours alone where a peer would be installed (kv-index: Dynamo's venv)
    no_peer = ["--no-peer"] if BENCHMARKS[name].has_peer_option else []
    done = subprocess.run(
        [
            str(KVFABRIC),
            "bench",
            name,
            "--quick",
            "--json",
            str(out),
            *no_peer,
            *CI_ARGS.get(name, []),
        ],
        capture_output=True,
        text=True,
        timeout=540,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["name"] == name and result["quick"] is True
    assert result["ratios"] or result["figures"], "measured nothing"
    printed = done.stdout.splitlines()
    header = printed.index(f"{name} (quick)")
    body = [line for line in printed[header + 1 :] if line.startswith("  ")]
    # one printed line per ratio, figure and note, in that order, nothing else
    assert len(body) == len(result["ratios"]) + len(result["figures"]) + len(result["notes"])
    for line, ratio in zip(body, result["ratios"], strict=False):
        assert line.startswith(f"  {ratio['name']}: ours ")
        assert f" = {ratio['value']:.2f}x" in line
        assert math.isfinite(ratio["value"]) and ratio["ours"] > 0 and ratio["peer"] > 0
        assert ratio["met"] in (None, True, False)
    for line, figure in zip(body[len(result["ratios"]) :], result["figures"], strict=False):
        assert line.startswith(f"  {figure['name']}: ")
        assert math.isfinite(figure["value"])
    assert result["machine"]["cpu_count"] >= 1 and result["duration_s"] > 0
