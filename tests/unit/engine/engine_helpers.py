"""Helpers for the engine tests: tiny random transformers models are the reference.

Tolerance (float32 everywhere), bound on max |ours - ref| over a logits tensor:

| comparison                          | bound                       | why                       |
|-------------------------------------|-----------------------------|---------------------------|
| logits vs transformers (eager)      | 2e-5 * max|ref| (~1e-4 at   | same math, other          |
|                                     | our logit scale of ~5)      | summation order (1)       |
| paged vs dense, cached vs cold      | same bound                  | only the K/V source moves |
| block bytes round trip              | exact                       | a byte copy               |

(1) SDPA vs matmul + softmax, packed vs padded matmuls. Measured: 2e-7 .. 6e-7 relative
(float32 eps is 1.2e-7), so the bound leaves > 30x margin; a mask off by one token or a
wrong RoPE frequency moves logits by > 1e-2 relative, 500x over the bound.

Weights use initializer_range=0.2 so logits are O(1-10) and attention is far from uniform;
with the default 0.02 every path would look alike because every softmax would be flat.
"""

from __future__ import annotations

import torch
import transformers

REL_TOL = 2e-5

SMALL = {
    "vocab_size": 97,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "initializer_range": 0.2,
    "attn_implementation": "eager",  # its sliding-window mask is the reference
}

SLIDING = {  # qwen3 overrides: sliding layers first, then full ones (both kinds of state)
    "use_sliding_window": True,
    "sliding_window": 8,
    "layer_types": ["sliding_attention", "sliding_attention", "full_attention", "full_attention"],
}

FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
}


def assert_logits_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.shape == ref.shape
    bound = REL_TOL * float(ref.abs().max())
    err = float((ours - ref).abs().max())
    assert err <= bound, f"max |diff| {err:.3g} > {bound:.3g}"


def hf_logits(model: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    """Logits of every position, whole sequence at once, no cache: [n, vocab]."""
    with torch.no_grad():
        return model(torch.tensor([token_ids]), use_cache=False).logits[0].float()


def random_tokens(n: int, seed: int, vocab_size: int = 97) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (n,), generator=generator).tolist()
