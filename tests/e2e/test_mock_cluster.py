"""`--engine mock` end to end: 8 prefill and 8 decode workers under concurrent load (the
issue's "with the mock engine, 8 workers of each kind under concurrent load").

Everything but the model's arithmetic is real: separate processes, the workers and engine of
the model path over a simulated model (its K/V pages, windows and handoffs real bytes), NATS,
the router's policy, kv-index fed by the workers' KV events, swa-memcache, store files,
streams and usage on JetStream. The simulated model's tokens are deterministic
(`simulated_output`), so every answer is known in advance.
Blocks are 16 tokens so that short prompts have many blocks; billing and ingress are left
out (nothing here needs them): 19 service processes share a 2-core host.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Iterator

import msgspec
import pytest

from services.admin.launcher import Cluster
from shared.blocks import RequestBlocks
from shared.bus import Bus
from shared.client import GenerateResult, build_request, generate
from shared.discovery import discover
from shared.models import BUNDLED_MODEL_DIR
from shared.subjects import BILLING, DECODE, INGRESS, PREFILL, ROUTER
from tests.e2e.cluster_helpers import (
    connect,
    num_indexed_blocks,
    run_cluster,
    usage_records,
)
from worker.mock_engine.simulated import simulated_output

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

BLOCK = 16
NUM_WORKERS = 8
# Split over hosts where the machine allows it (root): half the workers on each of two nodes.
HOSTS = {
    f"{service}-{i}": "node-a" if i < NUM_WORKERS // 2 else "node-b"
    for service in (PREFILL, DECODE)
    for i in range(NUM_WORKERS)
}
NUM_REQUESTS = 40
MAX_TOKENS = 16
MODEL = BUNDLED_MODEL_DIR.name
HF_CONFIG = json.loads((BUNDLED_MODEL_DIR / "config.json").read_text())
MOCK_ARGS = [
    "--engine",
    "mock",
    "--kv-block-size-tokens",
    str(BLOCK),
    "--store-file-nbytes",
    str(8 << 20),  # 16 workers x the 256 MiB default, preallocated
]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    yield from run_cluster(
        tmp_path_factory.mktemp("mock"),
        replicas={PREFILL: NUM_WORKERS, DECODE: NUM_WORKERS, BILLING: 0, INGRESS: 0},
        extra_args={
            PREFILL: MOCK_ARGS,
            DECODE: MOCK_ARGS,
            ROUTER: ["--decode-page-size-tokens", str(BLOCK)],
        },
        ready_timeout_s=120,
        hosts=HOSTS,
    )


def _prompts() -> list[list[int]]:
    rng = random.Random(7)
    vocab = HF_CONFIG["vocab_size"]
    return [
        [rng.randrange(3, vocab) for _ in range(rng.randrange(100, 300))]
        for _ in range(NUM_REQUESTS)
    ]


def _expected(prompt: list[int]) -> list[int]:
    """The mock's answer: the simulated model's tokens, through the first end-of-sequence id."""
    tokens = simulated_output(prompt, MAX_TOKENS, HF_CONFIG["vocab_size"])
    eos = HF_CONFIG["eos_token_id"]
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


async def _round(bus: Bus, prompts: list[list[int]]) -> list[GenerateResult]:
    requests = [
        build_request(p, model=MODEL, block_size_tokens=BLOCK, max_tokens=MAX_TOKENS)
        for p in prompts
    ]
    # 19 processes share 2 cores here: a heartbeat may come late, never 10 s late.
    return await asyncio.gather(*(generate(bus, r, liveness_timeout_s=10.0) for r in requests))


async def _indexed(bus: Bus, prompt: list[int]) -> None:
    """Until kv-index knows every complete block of `prompt`."""
    hashes = RequestBlocks.hash_prompt(prompt, model=MODEL, block_size_tokens=BLOCK).hashes
    num_blocks = await num_indexed_blocks(bus, hashes, timeout_s=10.0)
    assert num_blocks == len(hashes), "kv-index never learnt the prompt's blocks"


async def test_eight_and_eight_mock_workers_serve_concurrent_load(cluster: Cluster) -> None:
    bus = await connect(cluster)
    try:
        workers = [i for i in await discover(bus) if i.service in (PREFILL, DECODE)]
        assert len(workers) == 2 * NUM_WORKERS
        assert {i.metadata.get("engine") for i in workers} == {"mock"}

        prompts = _prompts()
        started = time.monotonic()
        first = await _round(bus, prompts)
        first_s = time.monotonic() - started
        for prompt, result in zip(prompts, first, strict=True):
            assert result.token_ids == _expected(prompt), result.request_id
            assert result.finish_reason in ("stop", "length")
            assert result.usage is not None and result.usage.num_prompt_tokens == len(prompt)
        used_prefill = {r.decision.prefill_worker_id for r in first}
        used_decode = {r.decision.decode_worker_id for r in first}
        assert len(used_prefill) >= 4, used_prefill
        assert len(used_decode) >= 4, used_decode

        for prompt in prompts:
            await _indexed(bus, prompt)
        started = time.monotonic()
        second = await _round(bus, prompts)
        second_s = time.monotonic() - started
        for prompt, result in zip(prompts, second, strict=True):
            assert result.token_ids == _expected(prompt), result.request_id
            assert result.usage is not None and result.usage.num_cached_tokens > 0
            assert result.decision.num_cached_tokens == result.usage.num_cached_tokens
        restores = {r.stats.prefill.swa_restore for r in second if r.stats is not None}

        results = {r.request_id: r for r in first + second}
        records = await usage_records(bus, set(results), timeout_s=15)
        for request_id, result in results.items():
            record = records[request_id]
            assert record.status == "completed"
            assert record.num_output_tokens == len(result.token_ids)
            assert record.num_cache_hit_tokens == result.usage.num_cached_tokens
            assert record.decode_worker_id == result.decision.decode_worker_id
        print(
            f"{NUM_REQUESTS} concurrent requests on {NUM_WORKERS}+{NUM_WORKERS} mock workers: "
            f"cold round {first_s:.2f}s, cached round {second_s:.2f}s; prefill workers used "
            f"{len(used_prefill)}, decode {len(used_decode)}; window restores {restores}"
        )
    finally:
        await bus.close()


async def test_cancelled_mock_stream_frees_pages_and_bills_what_was_produced(
    cluster: Cluster,
) -> None:
    bus = await connect(cluster)
    try:
        got_tokens = asyncio.Event()
        prompt = _prompts()[0][:100]
        request = build_request(prompt, model=MODEL, block_size_tokens=BLOCK, max_tokens=400)
        sampling = msgspec.structs.replace(request.sampling, ignore_eos=True)
        request = msgspec.structs.replace(request, sampling=sampling)
        # 400 simulated steps of >= 10 ms: still streaming when the cancel lands.
        task = asyncio.create_task(generate(bus, request, on_chunk=lambda c: got_tokens.set()))
        await asyncio.wait_for(got_tokens.wait(), 30)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        records = await usage_records(bus, {request.request_id}, timeout_s=15)
        record = records[request.request_id]
        assert record.status == "cancelled"
        assert 0 < record.num_output_tokens < 400
        deadline = time.monotonic() + 10
        while True:
            worker = await discover(bus, service=DECODE)
            load = next(i.load for i in worker if i.instance_id == record.decode_worker_id)
            if load["num_kv_pages_free"] == load["num_kv_pages_total"]:
                break
            assert time.monotonic() < deadline, "decode pages not freed after cancellation"
            await asyncio.sleep(0.2)
    finally:
        await bus.close()
