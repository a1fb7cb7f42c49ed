"""BlockChain: a sequence's block hashes taken from the request once, extended over the
answer, always equal to hashing the whole sequence afresh."""

from __future__ import annotations

import msgspec

from shared.kvstore.hashing import BlockHasher
from shared.schema import GenerateRequest, pack_block_hashes, pack_token_ids
from shared.serving.kv_io import BlockChain

BLOCK = 16


def _request(token_ids: list[int], block_hashes: list[int] | None) -> GenerateRequest:
    return GenerateRequest(
        request_id="r", model="m", prompt_token_ids=pack_token_ids(token_ids),
        block_hashes=b"" if block_hashes is None else pack_block_hashes(block_hashes),
        block_size_tokens=BLOCK, cache_salt="tenant",
    )  # fmt: skip


def test_chain_uses_the_carried_hashes_and_extends_like_a_fresh_hash() -> None:
    hasher = BlockHasher(model_id="m", block_size_tokens=BLOCK, salt="tenant")
    prompt = list(range(100, 150))  # 3 complete blocks and a partial one
    answer = list(range(7, 47))
    chain = BlockChain.for_prompt(_request(prompt, hasher.hashes(prompt)), prompt)
    assert chain.hashes == hasher.hashes(prompt)
    whole = prompt + answer
    assert chain.upto(whole, 5) == hasher.hashes(whole)[:5]
    assert chain.upto(whole, 2) == hasher.hashes(whole)[:2]  # no re-hash, a prefix


def test_chain_computes_what_a_job_did_not_carry() -> None:
    prompt = list(range(40))
    computed = BlockChain.for_prompt(_request(prompt, None), prompt)
    hasher = BlockHasher(model_id="m", block_size_tokens=BLOCK, salt="tenant")
    assert computed.hashes == hasher.hashes(prompt)
    other_salt = msgspec.structs.replace(_request(prompt, None), cache_salt="other")
    assert BlockChain.for_prompt(other_salt, prompt).hashes != computed.hashes
