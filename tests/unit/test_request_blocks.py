"""RequestBlocks: a request's block layout, hashed once by the caller, taken from the request
by every later hop, checked cheaply by the router, extended over the answer exactly as a
fresh hash of the whole sequence would be."""

from __future__ import annotations

import msgspec
import pytest

from shared.block_hashing import BlockHasher
from shared.blocks import BlockLayoutError, RequestBlocks
from shared.schema import GenerateRequest, pack_block_hashes, pack_token_ids

BLOCK = 16


def request_for(token_ids: list[int], blocks: RequestBlocks | None) -> GenerateRequest:
    return GenerateRequest(
        request_id="r",
        model="m",
        prompt_token_ids=pack_token_ids(token_ids),
        block_hashes=b"" if blocks is None else blocks.packed(),
        block_size_tokens=BLOCK,
        cache_salt="tenant",
    )


def hash_prompt(token_ids: list[int], salt: str = "tenant") -> RequestBlocks:
    return RequestBlocks.hash_prompt(token_ids, model="m", block_size_tokens=BLOCK, cache_salt=salt)


def test_the_caller_hashes_in_the_request_namespace() -> None:
    prompt = list(range(100, 150))  # 3 complete blocks and a partial one
    blocks = hash_prompt(prompt)
    assert blocks.hashes == BlockHasher("m", BLOCK, salt="tenant").hashes(prompt)
    assert blocks.hashes != hash_prompt(prompt, salt="other").hashes
    assert blocks.num_prompt_tokens == 50 and len(blocks.hashes) == 3


def test_later_hops_take_the_chain_from_the_request_and_extend_it_like_a_fresh_hash() -> None:
    prompt, answer = list(range(100, 150)), list(range(7, 47))
    blocks = RequestBlocks.of_request(request_for(prompt, hash_prompt(prompt)))
    fresh = BlockHasher("m", BLOCK, salt="tenant").hashes(prompt + answer)
    assert blocks.extend(prompt + answer, 5) == fresh[:5]
    assert blocks.extend(prompt + answer, 2) == fresh[:2]  # a prefix: nothing hashed again
    assert blocks.packed() == pack_block_hashes(fresh[:3])  # still the prompt's own chain


@pytest.mark.parametrize(
    ("num_tokens", "num_hit", "expected"),
    [(64, 4, 3), (64, 2, 2), (65, 4, 4), (65, 9, 4), (17, 1, 1), (16, 1, 0), (10, 3, 0)],
)
def test_the_last_prompt_token_is_decodes_so_a_hit_never_covers_it(
    num_tokens: int, num_hit: int, expected: int
) -> None:
    blocks = hash_prompt(list(range(num_tokens)))
    assert blocks.num_prefill_blocks == (num_tokens - 1) // BLOCK
    assert blocks.num_reusable_blocks(num_hit) == expected
    assert blocks.num_reusable_blocks(-1) == 0
    boundary = blocks.boundary_hash(expected)
    assert boundary == (blocks.hashes[expected - 1] if expected else None)


def test_the_router_s_check_passes_the_callers_chain() -> None:
    prompt = list(range(1000))
    blocks = RequestBlocks.of_request(request_for(prompt, hash_prompt(prompt)))
    blocks.check(pack_token_ids(prompt))
    tiny = RequestBlocks.of_request(request_for(prompt[:5], hash_prompt(prompt[:5])))
    tiny.check(pack_token_ids(prompt[:5]))  # no complete block: nothing to check


def test_the_router_s_check_catches_another_namespace_a_changed_tail_or_a_short_list() -> None:
    prompt = list(range(1000))
    packed = pack_token_ids(prompt)
    other_salt = RequestBlocks.of_request(request_for(prompt, hash_prompt(prompt, salt="x")))
    with pytest.raises(BlockLayoutError, match="does not match its tokens"):
        other_salt.check(packed)
    edited = prompt[:990] + [7] + prompt[991:]  # a token of the last complete block (of 62)
    stale = RequestBlocks.of_request(request_for(edited, hash_prompt(prompt)))
    with pytest.raises(BlockLayoutError, match="block 61 of 62"):
        stale.check(pack_token_ids(edited))
    request = request_for(prompt, hash_prompt(prompt))
    short = msgspec.structs.replace(request, block_hashes=request.block_hashes[:-8])
    with pytest.raises(BlockLayoutError, match="61 block hashes for 1000 tokens"):
        RequestBlocks.of_request(short)
    with pytest.raises(BlockLayoutError, match="expected 62"):
        RequestBlocks.of_request(request_for(prompt, None))  # a caller that hashed nothing
