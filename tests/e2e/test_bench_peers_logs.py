"""`kvfabric bench peers` runs for most of an hour; a run that fails, or one whose side
counted a failed request, must leave what its clusters logged behind (their state directory
is a temporary one), and one that ends well must not pile logs up. A real cluster (ingress,
router, kv-index, no workers)."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from pathlib import Path

import pytest

from loadtest.bench_peers import SideResult, _cluster
from services.admin.launcher import ClusterSpec
from shared.subjects import BILLING, DECODE, PREFILL, SWA_MEMCACHE
from shared.testing import unique_root


def _spec(state: Path) -> ClusterSpec:
    return ClusterSpec(
        state_dir=state,
        nats_port=0,
        http_port=0,
        root=unique_root(),
        replicas={PREFILL: 0, DECODE: 0, BILLING: 0, SWA_MEMCACHE: 0},
        shutdown_grace_s=3.0,
    )


async def _run(fail: bool = False, failed_request: bool = False) -> None:
    side = SideResult()
    async with _cluster(_spec, 120, side) as (cluster, *_):
        assert (cluster.spec.state_dir / "logs" / "ingress-0.log").exists()
        if failed_request:  # counted at concurrency; the run goes on and ends well
            side.errors.append("APIError: vLLM failed")
        if fail:
            raise RuntimeError("a request failed")


def _kept(tmp_path: Path) -> None:
    """Exactly one directory of logs was kept in `tmp_path`, with the cluster's logs; removed."""
    kept = list(tmp_path.iterdir())
    assert [p.name.startswith("kvf-bench-peers-logs-") for p in kept] == [True]
    logs = {p.name for p in kept[0].iterdir()}
    assert {"ingress-0.log", "router-0.log", "kv-index-0.log"} <= logs, logs
    assert (kept[0] / "ingress-0.log").stat().st_size > 0
    shutil.rmtree(kept[0])


def test_a_failed_run_or_request_keeps_the_cluster_s_logs_and_a_good_run_does_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    asyncio.run(_run(fail=False))
    assert list(tmp_path.iterdir()) == []  # the state directory went, nothing was kept
    with pytest.raises(RuntimeError, match="a request failed"):
        asyncio.run(_run(fail=True))
    _kept(tmp_path)
    asyncio.run(_run(failed_request=True))
    _kept(tmp_path)
