from __future__ import annotations

import numpy as np
import pytest

from shared.block_hashing import BlockHasher
from shared.schema import pack_token_ids

TOKENS = list(range(1000, 1000 + 64 * 5 + 17))  # 5 complete blocks and a partial one


def test_only_complete_blocks_are_hashed() -> None:
    hasher = BlockHasher("tiny-coder", block_size_tokens=64)
    assert len(hasher.hashes(TOKENS)) == 5
    assert hasher.hashes(TOKENS[:63]) == []


def test_prefix_property() -> None:
    """Equal prefixes give equal hashes; one changed token changes its block and all after."""
    hasher = BlockHasher("tiny-coder", block_size_tokens=64)
    full = hasher.hashes(TOKENS)
    assert hasher.hashes(TOKENS[: 64 * 3]) == full[:3]
    changed = list(TOKENS)
    changed[64 * 2 + 5] += 1
    other = hasher.hashes(changed)
    assert other[:2] == full[:2]
    assert all(a != b for a, b in zip(other[2:], full[2:], strict=True))


def test_input_forms_and_continuation_agree() -> None:
    hasher = BlockHasher("tiny-coder", block_size_tokens=16)
    full = hasher.hashes(TOKENS)
    assert hasher.hashes(pack_token_ids(TOKENS)) == full
    assert hasher.hashes(np.array(TOKENS, dtype=np.uint32)) == full
    # Decode appends output blocks: continuing the chain from the last prompt block.
    assert hasher.hashes(TOKENS[16 * 4 : 16 * 9], parent_hash=full[3]) == full[4:9]


@pytest.mark.parametrize(
    "other",
    [
        BlockHasher("other-model", block_size_tokens=64),
        BlockHasher("tiny-coder", block_size_tokens=64, layout_version=2),
        BlockHasher("tiny-coder", block_size_tokens=64, salt="tenant-b"),
    ],
)
def test_namespaces_share_nothing(other: BlockHasher) -> None:
    mine = BlockHasher("tiny-coder", block_size_tokens=64)
    assert set(mine.hashes(TOKENS)).isdisjoint(other.hashes(TOKENS))


def test_hashes_are_stable_across_releases() -> None:
    """The SSD tier outlives processes and versions: a hash must never silently change."""
    hasher = BlockHasher("tiny-coder", block_size_tokens=4)
    assert hasher.hashes([1, 2, 3, 4, 5, 6, 7, 8]) == GOLDEN


GOLDEN = [1971297726012274822, 13351539096441539992]
