"""The connector's scheduler side without vLLM, over the real kv-index core: a request the
vllm-worker sends carries its chain and the router's match through vLLM's
`kv_transfer_params` (JSON, as the HTTP body carries it), so its prompt is neither hashed
nor matched again; one sent to vLLM directly is hashed and matched here. Either way only
the answer's blocks are hashed at the end, giving the hashes a whole rehash gives, and the
next turn hits the answer."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

from services.kv_index.index import KvIndex
from services.router.handler import cached_prefix
from services.vllm_worker.connector.config import ConnectorConfig
from services.vllm_worker.connector.params import (
    PARAMS_KEY,
    RoutedPrefix,
    RoutedPrefixError,
    from_kv_transfer_params,
    to_kv_transfer_params,
)
from services.vllm_worker.connector.scheduler_side import SaveJob, SchedulerSide
from services.vllm_worker.vllm_client import completion_body
from services.vllm_worker.worker import routed_prefix
from shared.block_hashing import BlockHasher
from shared.blocks import RequestBlocks
from shared.kv_index_client import PrefixMatch, merge, to_wire
from shared.schema import (
    BlocksStored,
    DecodeJob,
    GenerateRequest,
    KvEventBatch,
    RouteDecision,
    SamplingParams,
    StoredBlock,
    pack_block_hashes,
    pack_token_ids,
)
from shared.schema.inference import BlockLocations
from shared.schema.kv_index import MatchReply

B = 4  # tokens a block
MODEL = "SmolLM2-135M-Instruct"
EXTRA = {"nats_url": "nats://x", "model": MODEL, "store_dir": "/s", "writer_id": "vllm-0"}
PROMPT = list(range(1000, 1000 + 5 * B + 2))  # 5 complete blocks and 2 tokens
ANSWER = list(range(2000, 2000 + 2 * B + 1))


@dataclass
class Request:
    """The fields of vLLM's `Request` the scheduler side reads."""

    request_id: str
    prompt_token_ids: list[int]
    kv_transfer_params: dict[str, Any] | None = None
    cache_salt: str | None = None
    num_computed_tokens: int = 0
    output_token_ids: list[int] = field(default_factory=list)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def generate(self, output: Sequence[int]) -> None:
        """vLLM ran it to the end: every token but the last sampled one computed."""
        self.output_token_ids = list(output)
        self.num_computed_tokens = len(self.all_token_ids) - 1


class Index:
    """kv-index (its real core, one shard), counting the matches asked of it."""

    def __init__(self) -> None:
        self.core = KvIndex(capacity_bytes={"ssd": 1 << 30})
        self.num_matches = 0
        self._seq = 0
        self._next_slot = 0

    def match(self, hashes: list[int]) -> dict[str, PrefixMatch]:
        self.num_matches += 1
        results = self.core.match(hashes, now=0)
        parts = tuple(to_wire(r.tier, r.first_miss_index, r.indices, r.locations) for r in results)
        return merge([MatchReply(shard_id=0, num_shards=1, tiers=parts)], len(hashes))

    def store(self, hashes: list[int], parent: int | None = None, writer_id: str = "w") -> None:
        """A writer's `BlocksStored`, as the connector's worker side publishes a save."""
        blocks = tuple(
            StoredBlock(
                block_hash=h, file_id=0, slot=self._next_slot + i, generation=1, num_bytes=1
            )
            for i, h in enumerate(hashes)
        )
        self._next_slot += len(hashes)
        self._seq += 1
        event = BlocksStored(tier="ssd", blocks=blocks, parent_block_hash=parent)
        batch = KvEventBatch(writer_id=writer_id, seq=self._seq, ts_ms=0, events=(event,))
        self.core.apply(batch, now=0)


def chain(tokens: Sequence[int]) -> list[int]:
    """Hashes of every complete block of `tokens`, from scratch."""
    return RequestBlocks.namespace(MODEL, B).hashes(list(tokens))


def count_hashing(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """From now on, the blocks each `BlockHasher.hashes` call hashes (the real one runs)."""
    calls: list[int] = []
    real = BlockHasher.hashes

    def hashes(self: BlockHasher, *args: Any, **kwargs: Any) -> list[int]:
        result = real(self, *args, **kwargs)
        calls.append(len(result))
        return result

    monkeypatch.setattr(BlockHasher, "hashes", hashes)
    return calls


def routed(index: Index, request_id: str, prompt: list[int]) -> Request:
    """What vLLM's scheduler gets for a request kvfabric routed: the caller's chain, the
    router's match of it, the vllm-worker's body, through JSON."""
    blocks = RequestBlocks.hash_prompt(prompt, model=MODEL, block_size_tokens=B)
    hit = index.match(blocks.hashes).get("ssd")
    num_cached = blocks.num_reusable_blocks(hit.num_blocks if hit else 0)
    request = GenerateRequest(
        request_id=request_id,
        model=MODEL,
        prompt_token_ids=pack_token_ids(prompt),
        block_hashes=blocks.packed(),
        block_size_tokens=B,
    )
    decision = RouteDecision(
        request_id=request_id,
        prefill_worker_id="vllm-0",
        decode_worker_id="vllm-0",
        num_prompt_tokens=len(prompt),
        num_cached_blocks=num_cached,
        block_size_tokens=B,
        aggregated=True,
    )
    job = DecodeJob(
        request=request, decision=decision, cached_blocks=cached_prefix(hit, num_cached)
    )
    body = completion_body(
        MODEL,
        prompt,
        SamplingParams(),
        request_id=request_id,
        kv_transfer_params=routed_prefix(job),
    )
    return Request(request_id, prompt, json.loads(json.dumps(body))["kv_transfer_params"])


def scheduler(index: Index, **extra: Any) -> SchedulerSide:
    return SchedulerSide(ConnectorConfig.from_extra(EXTRA | extra), B, index.match)


def finish(side: SchedulerSide, request: Request, output: Sequence[int]) -> SaveJob:
    request.generate(output)
    num_blocks = -(-len(request.all_token_ids) // B)
    assert side.finished(request, list(range(100, 100 + num_blocks)))
    [save] = side.take_saves()
    return save


def test_routed_prefix_round_trips_through_json_packed() -> None:
    hashes = chain(range(1200 * B))  # a 77K-token prompt's chain, at 64 tokens a block
    rows = BlockLocations(
        tier="ssd",
        block_hashes=pack_block_hashes(hashes),
        writer_ids=("vllm-0", "prefill-1"),
        writers=bytes(2 * 1200),
        file_ids=bytes(4 * 1200),
        slots=pack_token_ids(range(1200)),
        generations=bytes(4 * 1200),
        num_bytes=bytes(4 * 1200),
    )
    prefix = RoutedPrefix(block_hashes=pack_block_hashes(hashes), cached_blocks=rows)
    params = json.loads(json.dumps(to_kv_transfer_params(prefix)))

    assert from_kv_transfer_params(params) == prefix
    assert from_kv_transfer_params(params).hashes() == hashes  # type: ignore[union-attr]
    # Packed: 8 bytes a hash and 34 a location, as base64 (~55 KB); the chain alone as a
    # JSON list of ints would be ~26 KB, twice its ~13 KB here.
    assert len(params[PARAMS_KEY]) <= 4 / 3 * (8 + 34) * 1200 + 100
    assert from_kv_transfer_params(None) is None
    assert from_kv_transfer_params({"do_remote_prefill": False}) is None  # another connector's
    for bad in ("not base64!", "AAAA", 7):
        with pytest.raises(RoutedPrefixError):
            from_kv_transfer_params({PARAMS_KEY: bad})


def test_a_routed_request_is_not_hashed_nor_matched_again_and_its_answer_extends_the_chain(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    whole = chain(PROMPT + ANSWER)  # 7 complete blocks: 5 of the prompt's, 2 more
    index = Index()
    index.store(whole[:3])  # an earlier request's blocks
    side = scheduler(index)
    request = routed(index, "r1", PROMPT)
    assert index.num_matches == 1  # the router's
    hashed = count_hashing(monkeypatch)

    assert side.num_new_matched_tokens(request, 0) == 3 * B
    # vLLM's own prefix cache now holds block 0 (it asks again): the store offers the rest.
    assert side.num_new_matched_tokens(request, B) == 2 * B
    side.allocated("r1", 2 * B)
    load = side.take_load("r1", [50, 51, 52, 53, 54, 55])
    assert load is not None and load.block_ids == [51, 52]
    assert [r.block_hash for r in load.refs] == whole[1:3]
    assert side.counts["matches"] == 0 and side.counts["hashed_blocks"] == 0 and hashed == []

    save = finish(side, request, ANSWER)

    assert save.block_hashes == whole[3:7] and save.parent_block_hash == whole[2]
    assert save.block_ids == [103, 104, 105, 106]
    assert side.counts["hashed_blocks"] == 2 and hashed == [2]  # past the prompt's chain
    assert side.counts["routed_requests"] == 1 and index.num_matches == 1


def test_a_direct_request_is_hashed_and_matched_here_each_block_once() -> None:
    index = Index()
    index.store(chain(PROMPT)[:3])
    side = scheduler(index)
    request = Request("r1", PROMPT)  # sent to vLLM's server directly: no kv_transfer_params

    assert side.num_new_matched_tokens(request, 0) == 3 * B
    assert index.num_matches == 1 and side.counts["hashed_blocks"] == 5  # the prefill blocks
    save = finish(side, request, ANSWER)

    whole = chain(PROMPT + ANSWER)
    assert save.block_hashes == whole[3:7] and save.parent_block_hash == whole[2]
    assert side.counts["hashed_blocks"] == 7 and side.counts["routed_requests"] == 0


def test_routed_and_direct_requests_save_the_same_blocks_with_the_same_events() -> None:
    saves = []
    for send in ("routed", "direct"):
        index = Index()
        index.store(chain(PROMPT)[:2])
        side = scheduler(index)
        request = routed(index, "r1", PROMPT) if send == "routed" else Request("r1", PROMPT)
        side.num_new_matched_tokens(request, 0)
        side.allocated("r1", 2 * B)
        saves.append(finish(side, request, ANSWER))
    assert saves[0] == saves[1]


@pytest.mark.parametrize("send", ["routed", "direct"])
def test_the_next_turn_hits_the_previous_answer(send: str) -> None:
    index = Index()
    side = scheduler(index)
    first = routed(index, "turn-1", PROMPT) if send == "routed" else Request("turn-1", PROMPT)
    assert side.num_new_matched_tokens(first, 0) == 0
    save = finish(side, first, ANSWER)
    index.store(save.block_hashes, save.parent_block_hash)  # the worker side wrote them

    # The agent's next turn: the whole conversation so far, and its new message.
    prompt = first.all_token_ids + list(range(3000, 3000 + 3 * B))
    second = routed(index, "turn-2", prompt) if send == "routed" else Request("turn-2", prompt)
    # On another worker, whose own prefix cache holds nothing of it:
    other = scheduler(index)
    assert other.num_new_matched_tokens(second, 0) == 7 * B  # the prompt's and the answer's
    other.allocated("turn-2", 7 * B)
    load = other.take_load("turn-2", list(range(20)))
    assert load is not None
    assert [r.block_hash for r in load.refs] == chain(PROMPT + ANSWER)[:7]


def test_a_chain_that_does_not_fit_the_prompt_or_unreadable_params_are_hashed_here() -> None:
    index = Index()
    side = scheduler(index)
    short = RoutedPrefix(block_hashes=pack_block_hashes(chain(PROMPT)[:4]))  # one block short
    for i, params in enumerate(
        [to_kv_transfer_params(short), {PARAMS_KEY: "!!"}, {PARAMS_KEY: {"block_hashes": []}}]
    ):
        request = Request(f"r{i}", PROMPT, params)
        side.num_new_matched_tokens(request, 0)
        save = finish(side, request, ANSWER)
        assert save.block_hashes == chain(PROMPT + ANSWER)
    assert side.counts["matches"] == 3 and side.counts["routed_requests"] == 0


def test_a_routed_request_loads_nothing_with_load_off_and_saves_nothing_with_save_off() -> None:
    index = Index()
    index.store(chain(PROMPT)[:3])
    no_load = scheduler(index, load=False)
    request = routed(index, "r1", PROMPT)
    assert no_load.num_new_matched_tokens(request, 0) == 0
    # As before: with loads off nothing is known stored, so the whole sequence is saved.
    assert finish(no_load, request, ANSWER).block_hashes == chain(PROMPT + ANSWER)
    no_save = scheduler(index, save=False)
    request = routed(index, "r2", PROMPT)
    assert no_save.num_new_matched_tokens(request, 0) == 3 * B
    request.generate(ANSWER)
    assert not no_save.finished(request, list(range(8)))
    assert no_save.take_saves() == []
