"""SmolLM2-135M-Instruct (from its GGUF) served by the cluster: its greedy answer to a chat
prompt is token for token transformers' greedy answer from the same file, and an agent's
next turn is served mostly from the store with the tokens a cold run gives.

Real processes: kv-index, swa-memcache, router, one prefill and one decode worker running
SmolLM2 (full attention: no window to restore or hand off). Blocks of 16 tokens so the
short prompts here have many.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from services.admin.launcher import Cluster
from shared.client import build_request, generate
from shared.discovery import discover
from shared.models import model_path
from shared.subjects import BILLING, DECODE, INGRESS, PREFILL, ROUTER
from tests.e2e.cluster_helpers import connect, run_cluster, two_nodes, usage_records
from worker.engine.checkpoint import Checkpoint

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MODEL = "SmolLM2-135M-Instruct"
BLOCK = 16
MAX_TOKENS = 40
QUESTION = "Write a Python function that returns the maximum of a list of numbers."
WORKER_ARGS = ["--kv-block-size-tokens", str(BLOCK)]


@pytest.fixture(scope="module")
def checkpoint() -> Checkpoint:
    return Checkpoint(model_path(MODEL))


@pytest.fixture(scope="module")
def prompt(checkpoint: Checkpoint) -> list[int]:
    text = checkpoint.chat_template().render([{"role": "user", "content": QUESTION}])
    return checkpoint.tokenizer().encode(text, add_special_tokens=False).ids


@pytest.fixture(scope="module")
def reference(
    checkpoint: Checkpoint, prompt: list[int], transformers_smollm2: torch.nn.Module
) -> list[int]:
    """transformers' greedy answer from the same GGUF (dequantized, fp32, eager)."""
    with torch.no_grad():
        out = transformers_smollm2.generate(
            torch.tensor([prompt]),
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
            eos_token_id=list(checkpoint.eos_token_ids()),
        )
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    yield from run_cluster(
        tmp_path_factory.mktemp("smollm2"),
        replicas={BILLING: 0, INGRESS: 0},
        extra_args={
            PREFILL: WORKER_ARGS,
            DECODE: WORKER_ARGS,
            ROUTER: ["--decode-page-size-tokens", str(BLOCK)],
        },
        models=(MODEL,),
        ready_timeout_s=180,
        hosts=two_nodes,
    )


def request(tokens: list[int], salt: str = ""):  # noqa: ANN201
    return build_request(
        tokens, model=MODEL, block_size_tokens=BLOCK, max_tokens=MAX_TOKENS, cache_salt=salt
    )


async def test_greedy_answer_is_transformers_answer_and_the_next_turn_hits_the_store(
    cluster: Cluster, checkpoint: Checkpoint, prompt: list[int], reference: list[int]
) -> None:
    bus = await connect(cluster)
    try:
        workers = await discover(bus, service=PREFILL) + await discover(bus, service=DECODE)
        assert {w.metadata["model"] for w in workers} == {MODEL}
        assert {w.metadata["max_model_len"] for w in workers} == {"8192"}  # its own context
        # Decode multiplies by the file's own Q4_1 blocks (and the Q8_0 embedding for logits).
        assert {w.metadata["weight_blocks"] for w in workers} == {"Q4_1,Q8_0"}
        first = await generate(bus, request(prompt))
        assert first.token_ids == reference, (
            checkpoint.tokenizer().decode(first.token_ids),
            checkpoint.tokenizer().decode(reference),
        )
        tool = (  # the next turn as ChatML goes on after the answer's <|im_end|>
            "\n<|im_start|>tool\nmax([3, 9, 2]) -> 9<|im_end|>\n"
            "<|im_start|>user\nNow the minimum.<|im_end|>\n<|im_start|>assistant\n"
        )
        follow = (
            prompt
            + first.token_ids
            + checkpoint.tokenizer().encode(tool, add_special_tokens=False).ids
        )
        cold = await generate(bus, request(follow, salt="cold"))
        for _ in range(50):  # kv-index learns the answer's blocks asynchronously
            warm = await generate(bus, request(follow))
            if warm.usage is not None and warm.usage.num_cached_tokens > len(prompt):
                break
        assert warm.usage is not None and warm.usage.num_cached_tokens > len(prompt)
        assert cold.usage is not None and cold.usage.num_cached_tokens == 0
        assert warm.token_ids == cold.token_ids
        records = await usage_records(
            bus, {first.request_id, cold.request_id, warm.request_id}, timeout_s=15
        )
        assert records[warm.request_id].num_cache_hit_tokens == warm.usage.num_cached_tokens
    finally:
        await bus.close()
