"""Fixtures the e2e modules share."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from services.admin.launcher import Cluster
from shared.subjects import DECODE, INGRESS, PREFILL
from tests.e2e.cluster_helpers import apart, on_the_client_host, run_cluster

MOCK_ARGS = ["--engine", "mock", "--store-file-nbytes", str(8 << 20)]


@pytest.fixture(autouse=True)
def _on_the_client_host(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test of a module whose cluster is split over hosts runs on the client host (its
    sockets and subprocesses there); any other test as it is."""
    if "cluster" not in request.fixturenames:
        yield
        return
    with on_the_client_host(request.getfixturevalue("cluster")):
        yield


@pytest.fixture(scope="session")
def observed_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """One of each service on the mock engine, ingress without API keys: the cluster the
    observability tests (/metrics, dashboards, `kvfabric top`) read. They only add traffic
    and read counters as deltas or lower bounds, so one cluster serves them all (each boot
    costs 10-20 s here)."""
    yield from run_cluster(
        tmp_path_factory.mktemp("observed"),
        replicas={},
        extra_args={PREFILL: MOCK_ARGS, DECODE: MOCK_ARGS, INGRESS: ["--require-api-key", "false"]},
        ready_timeout_s=120,
        hosts=apart,
    )
