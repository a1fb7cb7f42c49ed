"""The host-memory tier behind a worker's KV pool, in a live cluster on the mock engine (the
production worker code over a simulated model): a prefill worker whose pool is small hands an
agent's earlier turn's pages out to other requests; the next turn's prefix then comes back
from its host tier, not from the store, and the answer is the one the model gives."""

from __future__ import annotations

import asyncio
import json
import random
import time
import urllib.request
from collections.abc import Callable, Iterator

import pytest

from services.admin.launcher import Cluster
from shared import kv_index_client as index_client
from shared.blocks import RequestBlocks
from shared.bus import Bus
from shared.client import GenerateResult, build_request, generate
from shared.kv_index_client import MemoryHit
from shared.models import BUNDLED_MODEL_DIR
from shared.subjects import BILLING, DECODE, INGRESS, PREFILL, ROUTER
from tests.e2e.cluster_helpers import apart, connect, num_indexed_blocks, run_cluster
from worker.mock_engine.simulated import simulated_output

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

BLOCK = 16
PROMPT_TOKENS = 320  # 20 blocks
POOL_BLOCKS = 48  # the prefill worker's: two prompts' pages, then it hands out the oldest
MAX_TOKENS = 8
MODEL = BUNDLED_MODEL_DIR.name
VOCAB = json.loads((BUNDLED_MODEL_DIR / "config.json").read_text())["vocab_size"]
MOCK_ARGS = ["--engine", "mock", "--kv-block-size-tokens", str(BLOCK)]
MOCK_ARGS += ["--store-file-nbytes", str(8 << 20)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    yield from run_cluster(
        tmp_path_factory.mktemp("host-tier"),
        replicas={PREFILL: 1, DECODE: 1, BILLING: 0, INGRESS: 0},
        extra_args={
            PREFILL: [*MOCK_ARGS, "--num-kv-blocks", str(POOL_BLOCKS)],
            DECODE: MOCK_ARGS,
            ROUTER: ["--decode-page-size-tokens", str(BLOCK)],
        },
        ready_timeout_s=120,
        hosts=apart,
    )


def host_tier_blocks(cluster: Cluster, instance_id: str) -> dict[str, float]:
    """The worker's `kvfabric_worker_host_tier_blocks_total` by outcome, from its /metrics."""
    with urllib.request.urlopen(cluster.metrics_urls[instance_id], timeout=10) as response:
        text = response.read().decode()
    found = {}
    for line in text.splitlines():
        if line.startswith("kvfabric_worker_host_tier_blocks_total{"):
            outcome = line.split('outcome="', 1)[1].split('"', 1)[0]
            found[outcome] = float(line.rsplit(" ", 1)[1])
    return found


async def test_an_agents_next_turn_comes_back_from_the_host_tier(cluster: Cluster) -> None:
    [prefill_id] = [i for i in cluster.metrics_urls if i.startswith(PREFILL)]
    rng = random.Random(3)
    turn = [rng.randrange(3, VOCAB) for _ in range(PROMPT_TOKENS)]
    others = [[rng.randrange(3, VOCAB) for _ in range(PROMPT_TOKENS)] for _ in range(3)]
    bus = await connect(cluster)
    try:
        await ask(bus, turn)
        hashes = RequestBlocks.hash_prompt(turn, model=MODEL, block_size_tokens=BLOCK).hashes
        assert await num_indexed_blocks(bus, hashes, timeout_s=10.0) == len(hashes)
        for prompt in others:  # 60 more pages through a pool of 48: the first turn's go
            await ask(bus, prompt)
        before = host_tier_blocks(cluster, prefill_id)
        assert before["saved"] >= 19 and before["restored"] == 0
        # kv-index heard it from the worker: the turn's blocks in its memory, most of them
        # in its host tier now, not its pool.
        own = await held_by(bus, hashes, prefill_id, lambda hit: hit.num_device_blocks < 19)
        assert own.num_blocks == len(hashes)

        next_turn = turn + [rng.randrange(3, VOCAB) for _ in range(40)]
        result = await ask(bus, next_turn)
        assert result.usage is not None and result.usage.num_cached_tokens == 20 * BLOCK
        after = host_tier_blocks(cluster, prefill_id)
        # Its prefix (the blocks a job reuses: all 20) copied back from host memory.
        assert after["restored"] - before["restored"] >= 19
    finally:
        await bus.close()


async def held_by(
    bus: Bus, hashes: list[int], holder: str, until: Callable[[MemoryHit], bool]
) -> MemoryHit:
    """`holder`'s own hit on `hashes` as kv-index answers it, once `until` holds (its
    updates come every 0.25 s)."""
    deadline = time.monotonic() + 10.0
    while True:
        _, own = await index_client.match_with_holders(bus, hashes, num_shards=1)
        hit = own.get(holder, MemoryHit(0, 0))
        if until(hit) or time.monotonic() > deadline:
            return hit
        await asyncio.sleep(0.05)


async def ask(bus: Bus, prompt: list[int]) -> GenerateResult:
    """`prompt` through the cluster; the mock's answer to it, checked."""
    request = build_request(prompt, model=MODEL, block_size_tokens=BLOCK, max_tokens=MAX_TOKENS)
    result = await generate(bus, request, liveness_timeout_s=10.0)
    assert result.token_ids == simulated_output(prompt, MAX_TOKENS, VOCAB)
    return result
