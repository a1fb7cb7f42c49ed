"""`kvfabric bench faults --quick` end to end: a real run of the benchmark (a supervised
cluster, agent load, faults made for real), its JSON holding what it printed, no usage lost
in any fault, every fault followed by full service, kv-index's restart measured both
ways (from its snapshot, and replaying its whole log), and the resume gap of a decode
failover against recomputing, every continued answer the uninterrupted one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.faults, pytest.mark.slow]

KVFABRIC = Path(sys.executable).with_name("kvfabric")


@pytest.mark.timeout(900)
def test_quick_bench_faults_loses_no_usage(tmp_path: Path) -> None:
    out = tmp_path / "faults.json"
    done = subprocess.run(
        [str(KVFABRIC), "bench", "faults", "--quick", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=840,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    figures = {f["name"]: f for f in result["figures"]}
    faults = {name.split(": ")[0] for name in figures if ": usage lost" in name}
    assert faults >= {"kill -9 billing-0", "kill -9 decode-1", "one NATS server of three killed"}
    for fault in faults:
        assert figures[f"{fault}: usage lost"]["value"] == 0, fault
        assert figures[f"{fault}: time to full service"]["value"] > 0, fault
    assert not [n for n in result["notes"] if "outside the protocol" in n], result["notes"]
    [ratio] = [r for r in result["ratios"] if r["name"].startswith("kv-index SIGKILL")]
    assert ratio["ours"] > 0 and ratio["peer"] > 0
    assert any(name.startswith("router-0: SIGKILL to serving") for name in figures)
    # The resume gap: a decode worker killed mid-stream, measured against recomputing.
    [gap] = [r for r in result["ratios"] if ": resume gap after" in r["name"]]
    assert gap["ours"] > 0 and gap["peer"] > 0
    [differ] = [f for n, f in figures.items() if "differ from the uninterrupted" in n]
    assert differ["value"] == 0
    assert "  kill -9 decode-1: usage lost: 0 records (target <= 0: met)" in done.stdout
