"""Decoder-only transformer (llama / qwen2 / qwen3 / mistral) over packed tokens.

Tokens of all sequences in a batch are packed into one [num_tokens] tensor so projections and
MLPs run as single matmuls; only attention needs to know the sequence boundaries, and that is
delegated to a backend from attention.py (dense, paged prefill, or paged decode).
Module and parameter names equal the HF checkpoint names (`model.layers.3.self_attn.q_proj`).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn
from torch.nn import functional as F

from worker.engine import fused_ops, quant
from worker.engine.config import ModelConfig
from worker.engine.layers import Embedding, Linear, RMSNorm, SwiGLU, project
from worker.engine.rope import RotaryEmbedding, apply_rotary


class AttentionBackend(Protocol):
    def __call__(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor: ...


class LanguageModel(Protocol):
    """What the runner calls: `CausalLM`, or the mock's simulated model
    (worker/mock_engine/simulated.py) with no weights. `backend` is one of attention.py's:
    `CausalLM` attends through it, the simulated model only stores K/V through it."""

    config: ModelConfig

    @property
    def dtype(self) -> torch.dtype: ...

    def __call__(
        self, token_ids: torch.Tensor, positions: torch.Tensor, backend: Any
    ) -> torch.Tensor: ...

    def replay(self, token_ids: torch.Tensor, positions: torch.Tensor, backend: Any) -> None: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        q_dim, kv_dim = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        self.q_proj = Linear(config.hidden_size, q_dim, bias=config.attention_bias)
        self.k_proj = Linear(config.hidden_size, kv_dim, bias=config.attention_bias)
        self.v_proj = Linear(config.hidden_size, kv_dim, bias=config.attention_bias)
        self.o_proj = Linear(q_dim, config.hidden_size, bias=config.o_proj_bias)
        if config.qk_norm:
            # Qwen3: RMSNorm over each head's vector, before RoPE.
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        # q, k and v in one oneDNN product (weights concatenated and packed by
        # layers.pack_linears), for the rows the block kernel does not take.
        self.qkv_packed: torch.Tensor | None = None
        self.qkv_bias: torch.Tensor | None = None

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: AttentionBackend
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = project(
            x, (self.q_proj, self.k_proj, self.v_proj), self.qkv_packed, self.qkv_bias
        )
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if fused_ops.serves(q, k, cos, sin):
            q, k = fused_ops.rope(q, cos, sin), fused_ops.rope(k, cos, sin)
        else:
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = backend(self.layer_id, q, k, v)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_id)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size, config.mlp_bias)

    def forward(
        self,
        x: torch.Tensor,
        pending: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        backend: AttentionBackend,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the residual stream, still without `pending`, the last layer's MLP output (None
        before the first layer). Returns the stream with that and this layer's attention
        added, and this layer's MLP output, pending: each residual add is done by the next
        RMSNorm, in the same pass (RMSNorm.add_and_norm; x may be updated in place)."""
        x, h = self.input_layernorm.add_and_norm(x, pending)
        x, h = self.post_attention_layernorm.add_and_norm(x, self.self_attn(h, cos, sin, backend))
        return x, self.mlp(h)


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)


class CausalLM(nn.Module):
    """`forward` returns final hidden states; `compute_logits` only for the rows needed."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = Transformer(config)
        # Tied models have no lm_head tensor; logits reuse the embedding matrix.
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        # The output projection as GGUF blocks (the embedding's when tied), set by weights.py.
        self.logits_quant: quant.QuantWeight | None = None

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @torch.no_grad()
    def forward(
        self, token_ids: torch.Tensor, positions: torch.Tensor, backend: AttentionBackend
    ) -> torch.Tensor:
        """token_ids, positions: [num_tokens] int64 (packed) -> [num_tokens, hidden]."""
        x = self.model.embed_tokens(token_ids)
        cos, sin = self.model.rotary_emb(positions, x.dtype)
        pending = None
        for layer in self.model.layers:
            x, pending = layer(x, pending, cos, sin, backend)
        return self.model.norm.add_and_norm(x, pending)[1]

    @torch.no_grad()
    def replay(
        self, token_ids: torch.Tensor, positions: torch.Tensor, backend: AttentionBackend
    ) -> None:
        """Run the layers up to the last sliding one, for the sliding K/V `backend` records
        (swa_restore.replay_window): layers after it cannot change any."""
        x = self.model.embed_tokens(token_ids)
        cos, sin = self.model.rotary_emb(positions, x.dtype)
        pending = None
        for layer in self.model.layers[: self.config.sliding_layer_ids[-1] + 1]:
            x, pending = layer(x, pending, cos, sin, backend)

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if quant.use_kernel(self.logits_quant, hidden):
            return self.logits_quant.matmul(hidden.float())
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()
