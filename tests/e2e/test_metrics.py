"""/metrics of a real cluster (mock engine, every service a process of its own): after one
HTTP request, each process's scrape counts it where it happened -- ingress by protocol and
status with its time to first token, the router's decision, decode's time to first token,
billing's ledgered record and its revenue -- and discovery's snapshot (what `kvfabric
status --json` shows) reads the same registry. `promtool check metrics` finds nothing wrong
with any scrape."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.admin.launcher import Cluster
from shared.discovery import discover
from shared.models import BUNDLED_MODEL_DIR
from shared.subjects import BILLING, DECODE, INGRESS, ROUTER, SERVICES
from tests.e2e.cluster_helpers import connect

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def cluster(observed_cluster: Cluster) -> Cluster:
    return observed_cluster


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        return response.read().decode()


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    """(sample name, its labels but the constant ones) -> value."""
    found = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = frozenset(
                (k, v) for k, v in s.labels.items() if k not in ("service", "instance")
            )
            found[(s.name, labels)] = s.value
    return found


def url_of(cluster: Cluster, service: str) -> str:
    [url] = [u for i, u in cluster.metrics_urls.items() if i.startswith(f"{service}-")]
    return url


def chat(cluster: Cluster) -> dict:
    body = json.dumps(
        {
            "model": BUNDLED_MODEL_DIR.name,
            "max_tokens": 8,
            "messages": [{"role": "user", "content": "def is_palindrome(s):"}],
        }
    ).encode()
    request = urllib.request.Request(
        f"{cluster.http_urls[0]}/v1/chat/completions",
        data=body,
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.status == 200
        return json.loads(response.read())


def test_every_process_has_a_metrics_url_with_its_constant_labels(cluster: Cluster) -> None:
    assert sorted(cluster.metrics_urls) == sorted(c.instance_id for c in cluster.children)
    if getattr(cluster, "client", None) is not None:  # split over hosts: each on its own
        hosts = {urllib.parse.urlsplit(u).hostname for u in cluster.metrics_urls.values()}
        assert len(hosts) == 3 and "127.0.0.1" not in hosts, hosts
    for instance_id, url in cluster.metrics_urls.items():
        service = instance_id.rsplit("-", 1)[0]
        assert service in SERVICES
        for family in text_string_to_metric_families(scrape(url)):
            assert family.name.startswith("kvfabric_"), family.name
            for s in family.samples:
                assert (s.labels["service"], s.labels["instance"]) == (service, instance_id)


def test_a_request_is_counted_where_it_happened(cluster: Cluster) -> None:
    ingress_before = samples(scrape(url_of(cluster, INGRESS)))
    answer = chat(cluster)
    assert answer["choices"][0]["message"]["content"] is not None

    ingress = samples(scrape(url_of(cluster, INGRESS)))
    key = (
        "kvfabric_ingress_requests_total",
        frozenset({("protocol", "openai.chat_completions"), ("status", "200")}),
    )
    assert ingress[key] - ingress_before[key] == 1
    ttft = ("kvfabric_ingress_time_to_first_token_seconds_count", frozenset())
    assert ingress[ttft] - ingress_before[ttft] == 1
    assert ingress[("kvfabric_ingress_time_to_first_token_seconds_sum", frozenset())] > 0

    router = samples(scrape(url_of(cluster, ROUTER)))
    assert router[("kvfabric_router_decisions_total", frozenset({("outcome", "routed")}))] >= 1
    prompt_tokens = router[("kvfabric_router_prompt_tokens_total", frozenset())]
    assert prompt_tokens >= answer["usage"]["prompt_tokens"]

    decode = samples(scrape(url_of(cluster, DECODE)))
    assert decode[("kvfabric_decode_time_to_first_token_seconds_count", frozenset())] >= 1
    assert decode[("kvfabric_decode_output_tokens_total", frozenset())] >= 1
    assert decode[("kvfabric_endpoint_requests_total", frozenset({("endpoint", "run")}))] >= 1

    # Billing ledgers the record asynchronously (decode's outbox -> JetStream -> ledger).
    ledgered = ("kvfabric_billing_records_ledgered_total", frozenset({("source", "decode")}))
    deadline = time.monotonic() + 30
    while (billing := samples(scrape(url_of(cluster, BILLING))))[ledgered] < 1:
        assert time.monotonic() < deadline, "billing never ledgered the request"
        time.sleep(0.2)
    revenue = ("kvfabric_billing_revenue_pico_cny_total", frozenset({("kind", "miss")}))
    assert billing[revenue] > 0  # the prompt's uncached tokens, priced


def test_discovery_shows_the_same_registry(cluster: Cluster) -> None:
    async def instances() -> list:
        bus = await connect(cluster)
        try:
            return await discover(bus, service=ROUTER)
        finally:
            await bus.close()

    [router] = asyncio.run(instances())
    assert router.metadata["metrics_url"] == url_of(cluster, ROUTER)
    text = scrape(router.metadata["metrics_url"])
    scraped = samples(text)
    for series, value in router.metrics.items():
        name, _, rest = series.partition("{")
        labels = frozenset(
            (k, v.strip('"'))
            for k, v in (p.split("=", 1) for p in rest.rstrip("}").split(",") if p)
        )
        # Counters only grow between the snapshot and the scrape; gauges may move either way.
        if name.endswith(("_total", "_count", "_sum")):
            assert scraped[(name, labels)] >= value, series


@pytest.mark.skipif(
    shutil.which("promtool") is None,
    reason="promtool not installed (Debian: apt-get install prometheus)",
)
def test_promtool_finds_no_problem_in_any_scrape(cluster: Cluster) -> None:
    chat(cluster)  # histograms with observations, not only empty ones
    for instance_id, url in cluster.metrics_urls.items():
        checked = subprocess.run(
            ["promtool", "check", "metrics"],
            input=scrape(url),
            capture_output=True,
            text=True,
            timeout=60,
        )
        # promtool prints lint problems and exits 1 on any; nothing printed means none.
        assert checked.returncode == 0, f"{instance_id}: {checked.stdout}{checked.stderr}"
        assert checked.stdout.strip() == "" and checked.stderr.strip() == "", instance_id
