"""The prefix benchmark's arithmetic ceiling (loadtest.bench_prefix_reuse.prefill_flops): the
closed form against a count token by token and key by key, on a hybrid model whose sliding
window falls inside, before and after the cached prefix."""

from __future__ import annotations

import pytest

from loadtest.bench_prefix_reuse import prefill_flops
from worker.engine.config import FULL, SLIDING, ModelConfig

HYBRID = ModelConfig(
    model_type="qwen3",
    vocab_size=100,
    hidden_size=32,
    intermediate_size=48,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    sliding_window=5,
    layer_types=(SLIDING, FULL, SLIDING, FULL),
)


def counted(config: ModelConfig, num_cached: int, num_new: int) -> float:
    """Each new token through each layer: its projections, and one q.k and p.v per key."""
    h, q, kv = config.hidden_size, config.num_heads * config.head_dim, 2 * config.head_dim
    total = 0.0
    for position in range(num_cached, num_cached + num_new):
        for layer_type in config.layer_types:
            total += 2 * (h * q + 2 * h * kv + q * h + 3 * h * config.intermediate_size)
            first = 0 if layer_type == FULL else max(0, position - config.sliding_window + 1)
            for _key in range(first, position + 1):
                total += config.num_heads * (2 * config.head_dim + 2 * config.head_dim)
    return total + 2 * config.hidden_size * config.vocab_size  # the last token's logits


@pytest.mark.parametrize(
    ("num_cached", "num_new"), [(0, 1), (0, 3), (0, 12), (2, 2), (3, 9), (7, 1), (9, 6), (40, 17)]
)
def test_closed_form_equals_the_count(num_cached: int, num_new: int) -> None:
    assert prefill_flops(HYBRID, num_cached, num_new) == counted(HYBRID, num_cached, num_new)


def test_attention_keeps_the_warm_gain_below_the_token_ratio() -> None:
    """At 96% cached, full layers leave the warm step most of its attention: FLOPs fall by
    little more than half as much as tokens do; with every layer sliding over a short window,
    nearly as much."""
    full = ModelConfig(**{**HYBRID.__dict__, "layer_types": (FULL,) * 4, "sliding_window": None})
    sliding = ModelConfig(**{**HYBRID.__dict__, "layer_types": (SLIDING,) * 4})
    ideal = 8192 / 320
    full_gain = prefill_flops(full, 0, 8192) / prefill_flops(full, 7872, 320)
    sliding_gain = prefill_flops(sliding, 0, 8192) / prefill_flops(sliding, 7872, 320)
    assert full_gain < 0.6 * ideal
    assert 0.95 * ideal < sliding_gain < ideal
