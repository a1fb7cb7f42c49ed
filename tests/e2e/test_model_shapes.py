"""Models of other shapes through the whole pipeline, each served by its own prefill and
decode processes in one cluster: a Llama-shaped model (every layer full attention: no
window to restore, snapshot or hand off) and a Mistral-shaped one (every layer sliding: its
KV blocks carry no bytes, the window is everything). Random weights, tiny-coder's tokenizer.

Each serves a request, and an agent's next turn is served from the cache (its first blocks
from the prefill and decode workers' own pools, the rest from the store) with the very
tokens a cold run of the same prompt gives (greedy). A copy of the Llama-shaped model is
served in bfloat16 (`--dtype bfloat16`): half-size pages, its next turn from the store. A
seeded, sampled request draws across prefill (its first token) and decode (the rest) exactly
what one engine draws alone.
"""

from __future__ import annotations

import shutil
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import transformers

from services.admin.launcher import Cluster
from shared.client import build_request, generate
from shared.discovery import discover
from shared.models import BUNDLED_MODEL_DIR
from shared.subjects import BILLING, DECODE, INGRESS, PREFILL, ROUTER
from tests.e2e.cluster_helpers import connect, run_cluster, two_nodes
from worker.engine import Engine, ModelRunner, SamplingParams
from worker.engine.config import ModelConfig
from worker.engine.kv_cache import KVBlockLayout
from worker.engine.weights import load_model

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

BLOCK = 16
SHAPE = {
    "vocab_size": 8192,  # tiny-coder's tokenizer
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "initializer_range": 0.1,
    "eos_token_id": 1,
    "tie_word_embeddings": True,
}
WORKER_ARGS = ["--kv-block-size-tokens", str(BLOCK), "--num-kv-blocks", "256"]


def random_checkpoint(out: Path, family: str) -> Path:
    torch.manual_seed(0)
    if family == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE))
    else:
        config = transformers.MistralConfig(**SHAPE, sliding_window=32)
        model = transformers.MistralForCausalLM(config)
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(BUNDLED_MODEL_DIR / name, out / name)
    return out


@pytest.fixture(scope="module")
def shapes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("shapes")
    paths = {f: random_checkpoint(root / f"random-{f}", f) for f in ("llama", "mistral")}
    paths["bf16"] = shutil.copytree(paths["llama"], root / "random-bf16")
    return paths


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, shapes: dict[str, Path]) -> Iterator[Cluster]:
    yield from run_cluster(
        tmp_path_factory.mktemp("shapes-cluster"),
        replicas={BILLING: 0, INGRESS: 0},
        extra_args={
            PREFILL: WORKER_ARGS,
            DECODE: WORKER_ARGS,
            ROUTER: ["--decode-page-size-tokens", str(BLOCK)],
        },
        instance_args={f"{s}-random-bf16-0": ["--dtype", "bfloat16"] for s in (PREFILL, DECODE)},
        models=tuple(str(path) for path in shapes.values()),
        ready_timeout_s=120,
        hosts=two_nodes,
    )


def _store_blocks_read(cluster: Cluster, instance_id: str) -> float:
    """The worker's `kvfabric_store_read_blocks_total` from its /metrics."""
    with urllib.request.urlopen(cluster.metrics_urls[instance_id], timeout=10) as response:
        text = response.read().decode()
    [line] = [x for x in text.splitlines() if x.startswith("kvfabric_store_read_blocks_total")]
    return float(line.rsplit(" ", 1)[1])


@pytest.mark.parametrize("family", ["llama", "mistral"])
async def test_a_model_of_this_shape_serves_and_reuses_its_prefix(
    cluster: Cluster, family: str
) -> None:
    model = f"random-{family}"
    bus = await connect(cluster)
    try:
        workers = [i for i in await discover(bus) if i.metadata.get("model") == model]
        assert sorted(w.service for w in workers) == [DECODE, PREFILL]
        layers = {w.metadata["layer_types"] for w in workers}
        assert layers == {"fff" if family == "llama" else "sss"}
        prompt = [(7 * i) % 8000 + 3 for i in range(150)]

        def request(tokens: list[int], salt: str = ""):  # noqa: ANN202
            return build_request(
                tokens, model=model, block_size_tokens=BLOCK, max_tokens=12, cache_salt=salt
            )

        first = await generate(bus, request(prompt))
        assert first.finish_reason in ("stop", "length") and first.token_ids
        assert first.decision.prefill_worker_id in {w.instance_id for w in workers}
        follow = prompt + first.token_ids + [5, 6, 7, 8] * 10
        cold = await generate(bus, request(follow, salt="cold"))
        for _ in range(50):  # kv-index learns the answer's blocks asynchronously
            warm = await generate(bus, request(follow))
            if warm.usage is not None and warm.usage.num_cached_tokens > len(prompt) // 2:
                break
        assert warm.usage is not None and warm.usage.num_cached_tokens >= 9 * BLOCK
        assert cold.usage is not None and cold.usage.num_cached_tokens == 0
        assert warm.token_ids == cold.token_ids
        # The first request's prompt blocks were still in the prefill worker's pool: taken
        # from there, not read from the store, with the same answer.
        assert warm.stats is not None
        assert warm.stats.prefill.num_local_blocks >= len(prompt) // BLOCK
        # Decode's pool kept the finished turns too (prompt and answer): the same turn again
        # reads fewer blocks from the store than it has cached.
        read_before = _store_blocks_read(cluster, f"{DECODE}-{model}-0")
        again = await generate(bus, request(follow))
        assert again.token_ids == cold.token_ids and again.usage is not None
        num_read = _store_blocks_read(cluster, f"{DECODE}-{model}-0") - read_before
        assert num_read < again.usage.num_cached_tokens // BLOCK
    finally:
        await bus.close()


async def test_a_bfloat16_worker_pair_serves_from_half_size_pages(
    cluster: Cluster, shapes: dict[str, Path]
) -> None:
    model = "random-bf16"
    float32_pages = KVBlockLayout.for_model(ModelConfig.from_hf(shapes["bf16"]), BLOCK)
    bus = await connect(cluster)
    try:
        workers = [i for i in await discover(bus) if i.metadata.get("model") == model]
        assert sorted(w.service for w in workers) == [DECODE, PREFILL]
        assert {w.metadata["dtype"] for w in workers} == {"bfloat16"}
        assert {int(w.metadata["kv_block_nbytes"]) for w in workers} == {
            float32_pages.block_nbytes // 2
        }
        others = [i for i in await discover(bus) if i.metadata.get("model") == "random-llama"]
        assert {w.metadata["dtype"] for w in others} == {"float32"}
        prompt = [(11 * i) % 8000 + 3 for i in range(150)]

        def request(tokens: list[int]):  # noqa: ANN202
            return build_request(tokens, model=model, block_size_tokens=BLOCK, max_tokens=12)

        first = await generate(bus, request(prompt))
        assert first.finish_reason in ("stop", "length") and first.token_ids
        follow = prompt + first.token_ids + [5, 6, 7, 8] * 10
        for _ in range(50):  # kv-index learns the answer's blocks asynchronously
            warm = await generate(bus, request(follow))
            if warm.usage is not None and warm.usage.num_cached_tokens > len(prompt) // 2:
                break
        # Its half-size pages went to the store and came back for the next turn.
        assert warm.usage is not None and warm.usage.num_cached_tokens >= 9 * BLOCK
        assert warm.finish_reason in ("stop", "length") and warm.token_ids
    finally:
        await bus.close()


async def test_a_seeded_request_draws_what_one_engine_draws_alone(
    cluster: Cluster, shapes: dict[str, Path]
) -> None:
    """Prefill samples the first token and hands decode its generator's state: a seeded,
    sampled answer is the one a single engine gives for the same seed."""
    prompt = [(13 * i) % 8000 + 3 for i in range(150)]
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=7, max_new_tokens=12)
    runner = ModelRunner(load_model(shapes["llama"]), num_blocks=64, block_size_tokens=BLOCK)
    expected = Engine(runner).generate([prompt], params)[0].completion_token_ids
    greedy = Engine(runner).generate([prompt], SamplingParams(temperature=0, max_new_tokens=12))
    assert expected != greedy[0].completion_token_ids  # the draw matters, not only the argmax
    bus = await connect(cluster)
    try:
        result = await generate(
            bus,
            build_request(
                prompt,
                model="random-llama",
                block_size_tokens=BLOCK,
                max_tokens=12,
                temperature=1.0,
                top_p=0.95,
                seed=7,
                cache_salt="seeded",
            ),
        )
        assert result.token_ids == expected
    finally:
        await bus.close()
