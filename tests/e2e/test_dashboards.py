"""Every query of every Grafana dashboard (compose/grafana/dashboards/) answers with data from a
real Prometheus scraping a running mock-engine cluster: each process a target (honor_labels,
so the series keep our `instance`), load through ingress over HTTP (Chat Completions plain
and streamed, Messages, Responses; turns sharing a long prefix, so some are cache hits),
then each expression through /api/v1/query with Grafana's variables substituted (the
per-service dashboards' `$instance` by a live instance of that service)."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from services.admin.launcher import Cluster
from shared.models import BUNDLED_MODEL_DIR
from tests.e2e.cluster_helpers import on_the_client_host
from tests.unit.test_dashboards import (
    HISTOGRAM_SERIES,
    dashboards,
    declared_metrics,
    expressions,
    substitute,
)

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.skipif(
        shutil.which("prometheus") is None,
        reason="the prometheus binary is not installed (Debian: apt-get install prometheus)",
    ),
]

# ~300 tokens (of the model's 512) every request starts with: after the first request, its
# complete blocks are cache hits.
SYSTEM = "You review Python code for a coding agent. " + " ".join(
    f"Rule {i}: prefer clear names, small functions and tests that assert." for i in range(16)
)


@pytest.fixture(scope="module")
def cluster(observed_cluster: Cluster) -> Cluster:
    return observed_cluster


def client_address(cluster: Cluster) -> str:
    """Where the test's own servers listen: the client host's address on a cluster split
    over hosts, else loopback."""
    client = getattr(cluster, "client", None)
    return client.address if client is not None else "127.0.0.1"


def free_port(address: str) -> int:
    with socket.socket() as s:
        s.bind((address, 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def prometheus(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real Prometheus on the client host scraping every process each second (from their
    hosts' addresses); yields its URL."""
    workdir = tmp_path_factory.mktemp("prometheus")
    targets: dict[str, list[str]] = {}
    for instance_id, url in cluster.metrics_urls.items():
        service = instance_id.rsplit("-", 1)[0]
        targets.setdefault(service, []).append(urllib.parse.urlsplit(url).netloc)
    config = {
        "global": {
            "scrape_interval": f"{SCRAPE_INTERVAL_S}s",
            "evaluation_interval": f"{SCRAPE_INTERVAL_S}s",
        },
        "scrape_configs": [
            {"job_name": service, "honor_labels": True, "static_configs": [{"targets": hosts}]}
            for service, hosts in sorted(targets.items())
        ],
    }
    (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
    address = client_address(cluster)
    log = (workdir / "prometheus.log").open("wb")
    with on_the_client_host(cluster):  # module fixtures run before the per-test client host
        port = free_port(address)
        process = subprocess.Popen(
            [
                "prometheus",
                f"--config.file={workdir / 'prometheus.yml'}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address={address}:{port}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    url = f"http://{address}:{port}"
    try:
        with on_the_client_host(cluster):
            wait_until(lambda: http_ok(f"{url}/-/ready"), 30, "prometheus never got ready", workdir)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def wait_until(check, timeout_s: float, message: str, workdir: Path | None = None) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            tail = (workdir / "prometheus.log").read_text()[-2000:] if workdir else ""
            pytest.fail(f"{message}\n{tail}")
        time.sleep(0.25)


def query(prometheus: str, expr: str, at: float | None = None) -> list[dict]:
    params = {"query": expr} | ({"time": f"{at:.3f}"} if at is not None else {})
    url = f"{prometheus}/api/v1/query?{urllib.parse.urlencode(params)}"
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            body = json.loads(response.read())
    except urllib.error.HTTPError as exc:
        pytest.fail(f"{expr}: HTTP {exc.code}: {exc.read().decode(errors='replace')}")
    assert body["status"] == "success", body
    return body["data"]["result"]


def post(url: str, body: dict) -> bytes:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.read()
    except urllib.error.HTTPError as exc:
        pytest.fail(f"{url}: HTTP {exc.code}: {exc.read().decode(errors='replace')}")


def one_request(base_url: str, i: int) -> None:
    """The i-th request of the load: the protocols in turn, every other one streamed; all
    share SYSTEM, and each conversation's second turn repeats its first."""
    model = BUNDLED_MODEL_DIR.name
    turn = [{"role": "user", "content": f"Review function number {i // 2}: def f(x): return x"}]
    if i % 2:
        turn += [
            {"role": "assistant", "content": "It returns x."},
            {"role": "user", "content": "Add a docstring."},
        ]
    stream = i % 2 == 0
    match i % 4:
        case 0 | 1:
            body = {
                "model": model,
                "max_tokens": 8,
                "stream": stream,
                "messages": [{"role": "system", "content": SYSTEM}, *turn],
            }
            answer = post(f"{base_url}/v1/chat/completions", body)
        case 2:
            body = {
                "model": model,
                "max_tokens": 8,
                "stream": stream,
                "system": SYSTEM,
                "messages": turn,
            }
            answer = post(f"{base_url}/v1/messages", body)
        case _:
            body = {
                "model": model,
                "max_output_tokens": 8,
                "stream": stream,
                "instructions": SYSTEM,
                "input": turn,
            }
            answer = post(f"{base_url}/v1/responses", body)
    assert answer  # a body (a whole answer, or an SSE stream to its end)


def send_load(base_url: str, num_requests: int, concurrency: int = 4) -> None:
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(lambda i: one_request(base_url, i), range(num_requests)))


NUM_REQUESTS = 32
SCRAPE_INTERVAL_S = 1


@pytest.fixture(scope="module")
def loaded(cluster: Cluster, prometheus: str) -> float:
    """Load sent and scraped: the time (unix s) to evaluate the dashboards at."""
    with on_the_client_host(cluster):  # module fixtures run before the per-test client host
        return _load_and_scrape(cluster, prometheus)


def _load_and_scrape(cluster: Cluster, prometheus: str) -> float:
    num_processes = len(cluster.metrics_urls)
    wait_until(
        lambda: len(query(prometheus, "up == 1")) == num_processes,
        30,
        "not every process scraped",
    )

    def num_ledgered() -> float:  # billing is the last to see a request (JetStream -> ledger)
        result = query(prometheus, "sum(kvfabric_billing_records_ledgered_total)")
        return float(result[0]["value"][1]) if result else 0.0

    # other tests may have sent requests to this cluster before: count from here
    before = num_ledgered()
    send_load(cluster.http_urls[0], NUM_REQUESTS)

    def ledgered() -> bool:
        return num_ledgered() >= before + NUM_REQUESTS

    wait_until(ledgered, 30, "billing's ledgered records never reached the requests sent")
    ledgered_at = time.time()

    def scraped_twice_since() -> bool:  # every process, after its last record
        last = query(prometheus, "min(timestamp(up))")
        return bool(last) and float(last[0]["value"][1]) > ledgered_at + SCRAPE_INTERVAL_S

    wait_until(scraped_twice_since, 30, "not every process was scraped again")
    return time.time()


def test_every_target_is_up_with_its_own_instance_label(
    cluster: Cluster, prometheus: str, loaded: float
) -> None:
    up = query(prometheus, "up", loaded)
    assert len(up) == len(cluster.metrics_urls)
    assert all(r["value"][1] == "1" for r in up), up
    names = query(prometheus, "group by (instance) (kvfabric_inflight_requests)", loaded)
    assert {r["metric"]["instance"] for r in names} == set(cluster.metrics_urls)


def test_the_declared_metrics_scan_covers_every_scraped_metric(
    prometheus: str, loaded: float
) -> None:
    declared = declared_metrics()
    every = query(prometheus, 'group by (__name__) ({__name__=~"kvfabric_.+"})', loaded)
    scraped = {r["metric"]["__name__"] for r in every}
    bases = set()
    for name in scraped:
        base = next((name.removesuffix(s) for s in HISTOGRAM_SERIES if name.endswith(s)), name)
        bases.add(base if base in declared else name)
    assert bases - set(declared) == set()


@pytest.mark.parametrize("file_name", sorted(dashboards()))
def test_every_dashboard_query_returns_data(
    cluster: Cluster, prometheus: str, loaded: float, file_name: str
) -> None:
    dashboard = dashboards()[file_name]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    instance = ".*"
    if "instance" in variables:
        # The variable's own query lists the service's live instances; use the first.
        service = dashboard["uid"].removeprefix("kvfabric-")
        match = f'kvfabric_inflight_requests{{service="{service}"}}'
        values_url = f"{prometheus}/api/v1/label/instance/values?match[]={match}"
        with urllib.request.urlopen(values_url, timeout=10) as response:
            instances = json.loads(response.read())["data"]
        expected = sorted(i for i in cluster.metrics_urls if i.rsplit("-", 1)[0] == service)
        assert instances == expected
        instance = instances[0]
    empty = [
        f"{title}: {expr}"
        for title, expr in expressions(dashboard)
        if not query(prometheus, substitute(expr, instance), loaded)
    ]
    assert not empty, "queries without data:\n" + "\n".join(empty)


def test_the_load_shows_in_the_headline_panels(prometheus: str, loaded: float) -> None:
    """Not only series, but the load's numbers: requests, a cache hit share, revenue."""

    def first(file_name: str, title: str) -> str:
        return next(e for t, e in expressions(dashboards()[file_name]) if t == title)

    def value(expr: str) -> float:
        [result] = query(prometheus, substitute(expr), loaded)
        return float(result["value"][1])

    requests = query(
        prometheus, substitute(first("overview.json", "Requests by protocol and status")), loaded
    )
    protocols = {r["metric"]["protocol"] for r in requests if r["metric"]["status"] == "200"}
    assert protocols == {"openai.chat_completions", "anthropic.messages", "openai.responses"}
    assert 0 < value(first("cache-economics.json", "Hit share")) < 1  # billed (decode)
    assert value(first("cache-economics.json", "Revenue per GPU-hour")) > 0
    assert value(first("overview.json", "Time to first token")) > 0  # p50
