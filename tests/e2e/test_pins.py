"""Pins (cache_control, docs/ingress.md 'Pins') on a mock cluster whose kv-index holds
only a few prompts' blocks and sweeps every 0.2 s: a pinned prefix survives the sweeps that
evict an unpinned one stored at the same time, and a restart of the prefill worker that
stored it; Anthropic's usage reports what the pin wrote. The cluster's swa-memcache keeps a
window 1 s: a session's next turn after that hits every token but recomputes the window,
and is diagnosed `window_expired`."""

from __future__ import annotations

import re
import time
import urllib.request
from collections.abc import Iterator

import anthropic
import pytest

from services.admin.launcher import Cluster
from shared.models import model_path
from shared.subjects import BILLING, DECODE, INGRESS, KV_INDEX, PREFILL, SWA_MEMCACHE
from tests.e2e.cluster_helpers import apart, run_cluster
from worker.engine.checkpoint import Checkpoint
from worker.engine.kv_cache import KVBlockLayout

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

KEY = "kvf-test-pins-key-0123"
MOCK = ["--engine", "mock", "--mock-speedup", "50", "--max-model-len", "4096"]
BLOCK = 64
CAPACITY_BLOCKS = 40  # a few prompts of ~10 blocks: the watermark (90%) is soon passed
PINNED = " ".join(f"Pinned rule {i}: keep functions short and typed." for i in range(45))
CONTROL = " ".join(f"Control rule {i}: keep functions short and typed." for i in range(45))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    config = Checkpoint(model_path("tiny-coder")).config()
    block_nbytes = KVBlockLayout.for_model(config, BLOCK).block_nbytes
    yield from run_cluster(
        tmp_path_factory.mktemp("pins"),
        replicas={BILLING: 0, INGRESS: 1},
        extra_args={
            PREFILL: MOCK,
            DECODE: MOCK,
            INGRESS: ["--dev-api-key", KEY],
            KV_INDEX: [
                "--capacity",
                f"ssd={CAPACITY_BLOCKS * block_nbytes}",
                "--evict-interval-s",
                "0.2",
            ],
            SWA_MEMCACHE: ["--ttl-s", "1", "--expire-interval-s", "0.2"],
        },
        ready_timeout_s=120,
        hosts=apart,
    )


def ask(cluster: Cluster, system: str, question: str, ttl: str | None = None):  # noqa: ANN201
    client = anthropic.Anthropic(base_url=cluster.http_urls[0], api_key=KEY, max_retries=0)
    block: dict = {"type": "text", "text": system}
    if ttl is not None:
        block["cache_control"] = {"type": "ephemeral", "ttl": ttl}
    return client.messages.create(
        model="tiny-coder",
        max_tokens=2,
        system=[block],
        messages=[{"role": "user", "content": question}],
    ).usage


def cached_once_stored(cluster: Cluster, system: str) -> int:
    """The system prompt's cached tokens once kv-index applied its blocks (asynchronously):
    asked again, without a pin, until it hits."""
    deadline = time.monotonic() + 30
    while (cached := ask(cluster, system, "Again?").cache_read_input_tokens) == 0:
        assert time.monotonic() < deadline, "the prompt was never indexed"
    return cached


def metric(cluster: Cluster, service: str, pattern: str) -> float:
    url = next(u for i, u in cluster.metrics_urls.items() if i.startswith(service))
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return sum(float(v) for v in re.findall("^" + pattern + r" (\S+)$", text, re.M))


def capacity_evictions(cluster: Cluster) -> float:
    name = r'kvfabric_kv_index_evicted_blocks_total\{[^}]*reason="capacity"[^}]*\}'
    return metric(cluster, KV_INDEX, name)


def test_a_pinned_prefix_outlives_the_sweeps_and_a_worker_restart(cluster: Cluster) -> None:
    first = ask(cluster, PINNED, "Write add(a, b).", ttl="1h")
    # The pin wrote the system prompt's whole blocks (none was cached): reported as such,
    # the three input fields disjoint.
    assert first.cache_creation_input_tokens >= 5 * BLOCK
    assert first.cache_creation_input_tokens % BLOCK == 0
    assert first.cache_read_input_tokens == 0 and first.input_tokens > 0
    ask(cluster, CONTROL, "Write add(a, b).")  # the same size, stored as it, not pinned
    pinned, control = cached_once_stored(cluster, PINNED), cached_once_stored(cluster, CONTROL)
    assert pinned >= first.cache_creation_input_tokens and control >= pinned - BLOCK
    # Fresh prompts until the sweeps evict by capacity, then past the pinned and the
    # control prompts' worth again: least recently used first, the control prompt goes.
    fills, deadline = 0, time.monotonic() + 60
    while capacity_evictions(cluster) < 2 * control // BLOCK:
        assert time.monotonic() < deadline, "kv-index never evicted by capacity"
        filler = " ".join(f"Filler {fills} rule {i}: write tests first." for i in range(45))
        ask(cluster, filler, "Write sub(a, b).")
        fills += 1
    print(f"{fills} filler prompts: {capacity_evictions(cluster):.0f} blocks evicted")
    assert ask(cluster, CONTROL, "Again?").cache_read_input_tokens == 0
    assert ask(cluster, PINNED, "Again?").cache_read_input_tokens >= pinned
    cluster.restart_instance("prefill-0")
    deadline = time.monotonic() + 120
    while True:
        try:
            after = ask(cluster, PINNED, "After the restart?").cache_read_input_tokens
            break
        except (anthropic.APIStatusError, anthropic.APIConnectionError):
            assert time.monotonic() < deadline, "the restarted worker never served"
            time.sleep(0.5)
    assert after >= pinned


def test_a_turn_whose_window_expired_is_told_so(cluster: Cluster) -> None:
    client = anthropic.Anthropic(base_url=cluster.http_urls[0], api_key=KEY, max_retries=0)
    session = {"user_id": f"window-{time.time_ns()}"}
    system = " ".join(f"Window rule {i}: name things well." for i in range(30))
    history = [{"role": "user", "content": "Write add(a, b)."}]

    def turn() -> tuple[object, dict]:
        raw = client.messages.with_raw_response.create(
            model="tiny-coder", max_tokens=2, system=system, messages=history, metadata=session
        )
        return raw.parse(), raw.http_response.json()["usage"]["kvfabric_cache"]

    first, _ = turn()
    cached_once_stored(cluster, system)  # its blocks indexed before the next turn
    expired = r"kvfabric_swa_memcache_expired_total(?:\{[^}]*\})?"
    before = metric(cluster, SWA_MEMCACHE, expired)

    def unpinned() -> float:
        entries = metric(cluster, SWA_MEMCACHE, "kvfabric_swa_memcache_entries")
        return entries - metric(cluster, SWA_MEMCACHE, "kvfabric_swa_memcache_pinned_entries")

    # Every prefill job persisted, its window put included: prefill puts after decode took
    # the suffix, so a loaded machine can put one after the sweeps below seemed done.
    def jobs(name: str) -> float:
        return sum(
            metric(cluster, instance, rf"kvfabric_prefill_jobs_{name}_total(?:\{{[^}}]*\}})?")
            for instance in cluster.metrics_urls
            if instance.startswith(PREFILL)
        )

    deadline = time.monotonic() + 20
    while jobs("ended") < jobs("received"):
        assert time.monotonic() < deadline, "prefill jobs never ended"
        time.sleep(0.1)
    # Every window this turn left swept (prefill's, and decode's at the boundaries its
    # write-through reached): each outlives its 1 s, then is swept.
    deadline = time.monotonic() + 20
    while metric(cluster, SWA_MEMCACHE, expired) <= before or unpinned() > 0:
        assert time.monotonic() < deadline, f"snapshots left unexpired: {unpinned()}"
        time.sleep(0.2)
    history += [
        {"role": "assistant", "content": first.content[0].text or "ok"},
        {"role": "user", "content": "Now sub(a, b)."},
    ]
    second, cache = turn()
    assert second.usage.cache_read_input_tokens > 0
    assert cache["cause"] == "window_expired", cache
