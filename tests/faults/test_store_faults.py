"""The store's faults under a real model: its disk full (and the usage outbox's volume with
it), and its slots corrupt or truncated.

A tiny-coder cluster whose store and usage outboxes lie on a tmpfs of their own (the shared
store's stand-in), with small slot files so that writes keep creating new ones. A full disk
skips the writes (counted) and every request is still answered, the same answer as before,
and billed exactly once (the outbox publishes what its volume refuses straight to
JetStream); once there is room again the writes resume. Slots overwritten with garbage or
cut short are misses (counted): the prompt is recomputed and the answer is the one first
given, never one computed from wrong KV.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.admin.launcher import Cluster
from shared.client import GenerateResult, build_request, generate
from shared.models import BUNDLED_MODEL_DIR
from shared.schema import UsageRecord, unpack_block_hashes
from shared.subjects import DECODE, PREFILL
from shared.testing.volumes import fill, tmpfs
from tests.e2e.cluster_helpers import (
    apart,
    connect,
    num_indexed_blocks,
    on_the_client_host,
    run_cluster,
    usage_records,
)
from worker.kvstore.slots import FILE_SUFFIX

pytestmark = [pytest.mark.faults, pytest.mark.slow]

MODEL = BUNDLED_MODEL_DIR.name
BLOCK = 16
STORE_BYTES = 48 << 20
# Slot files of 1 MiB: each write of a few blocks soon needs a new file, which a full disk
# refuses (files are preallocated, so a full disk shows at file creation).
# Pools of 48 pages and no host tier: a few other prompts push a prompt's blocks out of the
# workers' own memory, so that serving it again reads the store (the faults under test).
WORKER_ARGS = [
    "--kv-block-size-tokens",
    str(BLOCK),
    "--store-file-nbytes",
    str(1 << 20),
    "--num-kv-blocks",
    "48",
    "--host-tier-bytes",
    "0",
]
BOUND_S = 30.0


@pytest.fixture(scope="module")
def volume(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    with tmpfs(tmp_path_factory.mktemp("store-faults") / "volume", str(STORE_BYTES)) as path:
        yield path


@pytest.fixture(scope="module")
def store_dir(volume: Path) -> Path:
    return volume / "kvstore"


@pytest.fixture(scope="module")
def cluster(volume: Path, store_dir: Path) -> Iterator[Cluster]:
    on_volume = ["--store-dir", str(store_dir)]
    outbox = ["--usage-outbox-dir", str(volume / "outbox")]
    yield from run_cluster(
        volume.parent,
        replicas={PREFILL: 1, DECODE: 1},
        extra_args={PREFILL: WORKER_ARGS + on_volume, DECODE: WORKER_ARGS + on_volume + outbox},
        ready_timeout_s=180,
        hosts=apart,
    )


@pytest.fixture(autouse=True)
def _on_the_client_host(cluster: Cluster) -> Iterator[None]:
    """Each test's sockets on the client host, the cluster being split over hosts."""
    with on_the_client_host(cluster):
        yield


def prompt(seed: int, num_tokens: int = 8 * BLOCK + 5) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 4000) for _ in range(num_tokens)]


async def answer(cluster: Cluster, token_ids: list[int]) -> GenerateResult:
    bus = await connect(cluster)
    try:
        request = build_request(token_ids, model=MODEL, block_size_tokens=BLOCK, max_tokens=12)
        result = await generate(bus, request)
        assert result.finish_reason in ("stop", "length"), result
        return result
    finally:
        await bus.close()


def answer_now(cluster: Cluster, token_ids: list[int]) -> GenerateResult:
    return asyncio.run(answer(cluster, token_ids))


def indexed(cluster: Cluster, token_ids: list[int], timeout_s: float = 0.0) -> int:
    """How many of the prompt's blocks kv-index holds (waiting up to `timeout_s` for all)."""

    async def count() -> int:
        bus = await connect(cluster)
        try:
            request = build_request(token_ids, model=MODEL, block_size_tokens=BLOCK)
            hashes = unpack_block_hashes(request.block_hashes).tolist()
            return await num_indexed_blocks(bus, hashes, timeout_s)
        finally:
            await bus.close()

    return asyncio.run(count())


def store_metric(cluster: Cluster, name: str, **labels: str) -> float:
    """`name` with `labels`, summed over the prefill and decode workers."""
    total = 0.0
    for instance_id, url in cluster.metrics_urls.items():
        if not instance_id.startswith((PREFILL, DECODE)):
            continue
        for family in text_string_to_metric_families(httpx.get(url, timeout=5).text):
            for sample in family.samples:
                if sample.name == name and labels.items() <= sample.labels.items():
                    total += sample.value
    return total


def billed_once(cluster: Cluster, request_ids: set[str]) -> dict[str, UsageRecord]:
    async def records() -> dict[str, UsageRecord]:
        bus = await connect(cluster)
        try:
            return await usage_records(bus, request_ids, timeout_s=BOUND_S)  # one each
        finally:
            await bus.close()

    return asyncio.run(records())


def test_a_full_store_disk_skips_writes_and_every_request_is_answered_and_billed(
    cluster: Cluster, volume: Path
) -> None:
    first = answer_now(cluster, prompt(1))
    assert store_metric(cluster, "kvfabric_store_write_blocks_total") > 0
    skipped = store_metric(cluster, "kvfabric_store_write_skips_total", reason="disk_full")

    bypassed = store_metric(cluster, "kvfabric_usage_outbox_bypassed_total")
    filler = fill(volume)
    try:
        during = [answer_now(cluster, prompt(seed)) for seed in range(10, 16)]
        assert (
            store_metric(cluster, "kvfabric_store_write_skips_total", reason="disk_full") > skipped
        ), "no write met the full disk"
        # The outbox's volume is full too: each usage record went to JetStream directly, once.
        assert store_metric(cluster, "kvfabric_usage_outbox_bypassed_total") >= bypassed + 6
        billed = billed_once(cluster, {r.request_id for r in during})
        assert [billed[r.request_id].num_output_tokens for r in during] == [
            len(r.token_ids) for r in during
        ]
        assert answer_now(cluster, prompt(1)).token_ids == first.token_ids
    finally:
        filler.unlink()

    # Room again: the writes resume (after the store's back-off) and the prompts hit.
    deadline = time.monotonic() + BOUND_S
    seed = 100
    while indexed(cluster, prompt(seed)) == 0:
        assert time.monotonic() < deadline, "writes did not resume once the disk had room"
        seed += 1
        answer_now(cluster, prompt(seed))
    again = answer_now(cluster, prompt(seed))
    assert again.decision.num_cached_tokens > 0
    assert [answer_now(cluster, prompt(s)).token_ids for s in range(10, 16)] == [
        r.token_ids for r in during
    ]


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_corrupt_or_truncated_slots_are_misses_and_the_answer_is_unchanged(
    cluster: Cluster, store_dir: Path, damage: str
) -> None:
    seed = 1000 + len(damage)
    tokens = prompt(seed, num_tokens=12 * BLOCK + 3)
    first = answer_now(cluster, tokens)
    assert indexed(cluster, tokens, timeout_s=BOUND_S) == 12, "the blocks were never indexed"
    for other in range(4):  # out of the workers' pools: served again, it is read from the store
        answer_now(cluster, prompt(seed * 10 + other, num_tokens=12 * BLOCK))
    misses = store_metric(cluster, "kvfabric_store_read_misses_total")

    slot_files = [p for p in store_dir.rglob(f"*{FILE_SUFFIX}") if p.stat().st_size > 0]
    assert slot_files, "the store holds no slot file"
    rng = random.Random(seed)
    for path in slot_files:
        size = path.stat().st_size
        if damage == "truncated":
            os.truncate(path, size // 3)
        else:
            with path.open("r+b") as f:
                for offset in range(0, size, 4096):  # a few bytes of every page
                    f.seek(offset + rng.randrange(0, 4000))
                    f.write(rng.randbytes(64))

    second = answer_now(cluster, tokens)
    assert second.token_ids == first.token_ids
    assert store_metric(cluster, "kvfabric_store_read_misses_total") > misses
