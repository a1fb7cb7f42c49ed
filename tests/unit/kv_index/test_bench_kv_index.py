"""loadtest/bench_kv_index.py in quick mode, ours alone (CI never builds Dynamo's venv): the
result holds every figure it prints, with values a real run gives, and the event files it
writes read the same through the Dynamo side's reader."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from loadtest import bench_kv_index as bench
from loadtest.peers import dynamo_indexer


def test_quick_run_without_the_peer_reports_every_figure(tmp_path: Path) -> None:
    result = bench.run(quick=True, peer=False, sizes=(3_000, 9_000), num_matches=40, rounds=2)
    path = tmp_path / "kv-index.json"
    result.write_json(path)
    data = json.loads(path.read_text())
    assert data["ratios"] == []  # no peer, so nothing to divide by
    names = {f["name"]: f for f in data["figures"]}
    expected = {"memory per indexed block, 9K blocks (tracemalloc)"}
    for when in ("before", "after"):
        expected |= {
            f"machine {when}: stalls > 10 us a busy loop sees",
            f"machine {when}: median stall",
        }
    for label in ("3K", "9K"):
        expected |= {
            f"ingest, {label} blocks",
            f"ingest per CPU-second, {label} blocks",
            f"resident memory growth per indexed block, {label} blocks",
        }
        for how in bench.PREFIXES.values():
            for stat in ("p99", "p50", "CPU p99"):
                expected.add(f"match 1200 blocks {how}, {label} blocks: {stat}")
    assert set(names) == expected
    for name, figure in names.items():
        if not name.startswith("machine"):  # a quiet machine may show no stall at all
            assert figure["value"] > 0 and math.isfinite(figure["value"]), name
    p50 = names["match 1200 blocks stored by one event, 9K blocks: p50"]["value"]
    assert p50 <= names["match 1200 blocks stored by one event, 9K blocks: p99"]["value"]
    assert 20 < names["memory per indexed block, 9K blocks (tracemalloc)"]["value"] < 400
    assert any("--no-peer" in note for note in data["notes"])
    assert result.lines()[0] == "kv-index (quick)"


def test_both_sides_read_the_same_events(tmp_path: Path) -> None:
    workload = bench.write_workload(tmp_path, 5_000, seed=3)
    ours = [e for chunk in workload.chunks for e in bench.read_events(chunk)]
    theirs = [e for chunk in workload.chunks for e in dynamo_indexer.read_events(str(chunk))]
    assert len(ours) == len(theirs) > 5_000 // bench.BLOCKS_PER_EVENT
    for (writer, parent, hashes), (their_writer, their_parent, their_hashes) in zip(
        ours, theirs, strict=True
    ):
        assert (writer, parent) == (their_writer, their_parent)
        assert hashes.tolist() == their_hashes.tolist()
    assert sum(len(h) for _, _, h in ours) == workload.num_blocks == 5_000 + 2 * 1200
    # Each prefix's query is its writer's blocks in order: one event, or the 40 turns chained.
    for writer, query in workload.queries.items():
        stored = np.concatenate([h for w, _, h in ours if w == writer])
        assert stored.tobytes() == query.read_bytes()
    turns = [(parent, h) for w, parent, h in ours if w == bench.TURNS]
    assert len(turns) == bench.NUM_TURNS and turns[0][0] == 0
    chained = zip(turns[1:], turns[:-1], strict=True)
    assert all(parent == int(previous[-1]) for (parent, _), (_, previous) in chained)
