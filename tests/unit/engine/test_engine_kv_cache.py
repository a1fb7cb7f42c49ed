"""Paged pool, block layout, window buffers, prefix reuse."""

from __future__ import annotations

import pytest
import torch

from tests.unit.engine.engine_helpers import assert_logits_close, random_tokens
from worker.engine import (
    BlockAllocator,
    KVBlockLayout,
    KVLayoutError,
    ModelConfig,
    ModelRunner,
    OutOfBlocksError,
    PagedKVPool,
    Sequence,
    SequenceStateError,
    load_model,
)

QWEN3_SWA = {
    "use_sliding_window": True,
    "sliding_window": 8,
    "layer_types": ["sliding_attention", "sliding_attention", "full_attention", "full_attention"],
}
BLOCK = 16


def test_allocator_counts_and_refuses_when_full() -> None:
    allocator = BlockAllocator(4)
    first = allocator.allocate(3)
    assert len(set(first)) == 3 and allocator.num_free_blocks == 1
    assert not allocator.can_allocate(2)
    with pytest.raises(OutOfBlocksError):
        allocator.allocate(2)
    allocator.share(first[:2])  # a second sequence reuses the prefix blocks
    allocator.free(first)
    assert allocator.num_free_blocks == 2  # the shared two are still owned
    allocator.free(first[:2])
    assert allocator.num_free_blocks == 4 and allocator.can_allocate(4)
    with pytest.raises(SequenceStateError):
        allocator.free(first[:1])


def test_tagged_blocks_are_revived_until_handed_out_again() -> None:
    allocator = BlockAllocator(4)
    blocks = allocator.allocate(3)
    for block_id, block_hash in zip(blocks, (11, 12, 13), strict=True):
        allocator.tag(block_id, block_hash)
    allocator.free(blocks)
    assert allocator.num_free_blocks == 4
    # The leading run it still holds, each taken back with one owner; a gap ends the run.
    assert allocator.revive([11, 12, 99, 13]) == blocks[:2]
    assert allocator.num_free_blocks == 2
    assert [allocator.ref_count(b) for b in blocks[:2]] == [1, 1]
    assert allocator.revive([11]) == blocks[:1]  # in use: shared, not taken twice
    assert allocator.ref_count(blocks[0]) == 2
    # Free blocks are handed out oldest first: the never-used one, then block 13's page,
    # which loses its tag (it is about to be written over).
    handed = allocator.allocate(2)
    assert blocks == [0, 1, 2] and handed == [3, 2]
    assert allocator.revive([13]) == []
    assert allocator.num_free_blocks == 0
    allocator.free(blocks[:1])
    allocator.free(blocks[:2])
    allocator.free(handed)
    assert allocator.num_free_blocks == 4
    assert allocator.revive([11, 12]) == blocks[:2]  # freed again, still tagged
    with pytest.raises(SequenceStateError):
        allocator.tag(handed[0], 14)  # a free block holds nothing to name


def test_block_layout_holds_only_full_layers() -> None:
    config = ModelConfig(
        model_type="qwen3",
        vocab_size=10,
        hidden_size=16,
        intermediate_size=8,
        num_layers=5,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        sliding_window=4,
        layer_types=("sliding_attention",) * 3 + ("full_attention",) * 2,
    )
    layout = KVBlockLayout.for_model(config, block_size_tokens=64, dtype=torch.bfloat16)
    # 2 full layers x (K, V) x 64 tokens x 2 heads x 8 dims x 2 bytes
    assert layout.block_nbytes == 2 * 2 * 64 * 2 * 8 * 2
    assert KVBlockLayout.for_model(config).block_size_tokens == 64


def test_block_bytes_round_trip_is_exact() -> None:
    layout = KVBlockLayout(
        num_full_layers=2, block_size_tokens=4, num_kv_heads=2, head_dim=3, dtype=torch.bfloat16
    )
    pool = PagedKVPool(layout, num_blocks=3)
    pool.kv.normal_()
    payload = pool.block_to_bytes(1)
    assert len(payload) == layout.block_nbytes
    other = PagedKVPool(layout, num_blocks=2)
    other.block_from_bytes(0, payload)
    assert torch.equal(other.kv[0], pool.kv[1])
    other.write_block(1, pool.read_block(2))
    assert torch.equal(other.kv[1], pool.kv[2])
    with pytest.raises(KVLayoutError):
        other.block_from_bytes(0, payload[:-2])


def test_prefix_cached_prefill_equals_cold_prefill(make_hf) -> None:
    _, path = make_hf("qwen3", **QWEN3_SWA)
    runner = ModelRunner(load_model(path), num_blocks=16, block_size_tokens=BLOCK)
    prefix = random_tokens(32, seed=5)
    suffix = random_tokens(11, seed=6)

    runner.prefill([Sequence(99, [0])])  # occupy a block so ids are not trivially 0..n
    snapshot_seq = Sequence(1, prefix)
    runner.prefill([snapshot_seq])
    window_at_32 = snapshot_seq.window  # what swa-memcache would keep
    prefix_blocks = snapshot_seq.block_table[:2]
    assert window_at_32.num_tokens == 8 and window_at_32.end_position == 32

    warm = Sequence(2, prefix + suffix)
    runner.block_manager.attach_prefix(warm, prefix_blocks, window_at_32)
    warm_logits = runner.prefill([warm], return_all_logits=True)[0]
    cold = Sequence(3, prefix + suffix)
    cold_logits = runner.prefill([cold], return_all_logits=True)[0]
    assert_logits_close(warm_logits, cold_logits[32:])
    assert runner.allocator.ref_count(prefix_blocks[0]) == 2
    assert warm.block_table[:2] == prefix_blocks and cold.block_table[0] not in prefix_blocks


def test_prefix_blocks_survive_a_byte_copy_to_another_pool(make_hf) -> None:
    """What the SSD store will do: save whole blocks as bytes, load them into other slots."""
    _, path = make_hf("qwen3", **QWEN3_SWA)
    model = load_model(path)
    tokens = random_tokens(32, seed=7) + random_tokens(9, seed=8)
    source = ModelRunner(model, num_blocks=4, block_size_tokens=BLOCK)
    producer = Sequence(0, tokens[:32])
    source.prefill([producer])
    saved = [source.pool.block_to_bytes(b) for b in producer.block_table[:2]]

    target = ModelRunner(model, num_blocks=6, block_size_tokens=BLOCK)
    target.allocator.allocate(3)  # different block ids on the receiving side
    block_ids = target.allocator.allocate(2)
    for block_id, payload in zip(block_ids, saved, strict=True):
        target.pool.block_from_bytes(block_id, payload)
    consumer = Sequence(1, tokens)
    target.block_manager.attach_prefix(consumer, block_ids, producer.window)
    target.allocator.free(block_ids)  # attach_prefix took its own reference
    resumed = target.prefill([consumer], return_all_logits=True)[0]
    assert_logits_close(resumed, target.forward_dense([tokens])[0][32:])


def test_window_buffer_keeps_only_the_last_w_tokens(make_hf) -> None:
    _, path = make_hf("qwen3", **QWEN3_SWA)
    runner = ModelRunner(load_model(path), num_blocks=4, block_size_tokens=BLOCK)
    seq = Sequence(0, random_tokens(40, seed=9))
    runner.prefill([seq])
    # 2 sliding layers x (K, V) x 8 tokens x 2 kv heads x head_dim 8: never the whole context.
    assert tuple(seq.window.kv.shape) == (2, 2, 8, 2, 8)
    assert (seq.window.start_position, seq.window.end_position) == (32, 40)
    # The pool holds 2 full layers per block; sliding layers never enter it.
    assert runner.layout.block_shape == (2, 2, BLOCK, 2, 8)


def test_paged_paths_refuse_inconsistent_state(make_hf) -> None:
    _, path = make_hf("qwen3", **QWEN3_SWA)
    runner = ModelRunner(load_model(path), num_blocks=4, block_size_tokens=BLOCK)
    seq = Sequence(0, random_tokens(20, seed=10))
    runner.prefill([seq])
    with pytest.raises(SequenceStateError):
        runner.prefill([seq])  # nothing left to compute
    seq.token_ids.extend([1, 2])
    with pytest.raises(SequenceStateError):
        runner.decode([seq])  # two uncomputed tokens: that is a prefill
    late = Sequence(1, random_tokens(40, seed=11))
    with pytest.raises(SequenceStateError):  # window ends at 16, prefix at 32
        runner.block_manager.attach_prefix(late, [0, 1], runner.empty_window(16))
    with pytest.raises(OutOfBlocksError):
        runner.prefill([Sequence(2, random_tokens(100, seed=12))])
