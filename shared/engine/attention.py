"""Attention backends: where K/V come from and which keys each query may see.

The model computes q/k/v for the packed tokens of a batch and hands them to one backend:

- DenseAttention: no cache, every sequence starts at position 0 (the contiguous reference).
- PrefillAttention: variable-length chunks, each resuming after a prefix whose full-layer K/V
  is in the paged pool and whose sliding-layer K/V is in a window buffer.
- DecodeAttention: one token per sequence, batched into one padded attention call.

Masks follow transformers: causal is `key_pos <= query_pos`; a sliding layer of window W adds
`key_pos > query_pos - W`, so a query sees itself and the W-1 tokens before it.
Sliding-layer K/V of the new tokens is recorded, not committed: the runner appends to the
window only what it accepts (all of a prefill, the accepted prefix of a speculative draft).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F

from shared.engine.config import FULL, ModelConfig
from shared.engine.kv_cache import PagedKVPool, SlidingWindowState, slots_for


@dataclass(frozen=True)
class SeqInput:
    """What the backend needs to know about one sequence of the batch."""

    start_position: int  # tokens before this chunk, already cached
    num_tokens: int  # tokens in this chunk
    block_table: torch.Tensor | None = None  # int64 block ids covering start + num tokens
    window: SlidingWindowState | None = None  # sliding K/V of positions before start


def visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Bool mask [..., num_queries, num_keys]: which keys each query may attend to."""
    mask = k_pos.unsqueeze(-2) <= q_pos.unsqueeze(-1)
    if window is not None:
        mask &= k_pos.unsqueeze(-2) > q_pos.unsqueeze(-1) - window
    return mask


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """q: [..., Tq, Hq, D]; k, v: [..., Tk, Hkv, D]; mask: [..., Tq, Tk] -> [..., Tq, Hq, D]."""
    n_rep = q.shape[-2] // k.shape[-2]
    # Query head h reads KV head h // n_rep, the grouping transformers' repeat_kv uses.
    k = k.repeat_interleave(n_rep, dim=-2)
    v = v.repeat_interleave(n_rep, dim=-2)
    out = F.scaled_dot_product_attention(
        q.transpose(-3, -2),
        k.transpose(-3, -2),
        v.transpose(-3, -2),
        attn_mask=mask.unsqueeze(-3),
        scale=q.shape[-1] ** -0.5,
    )
    return out.transpose(-3, -2)


class _Backend:
    def __init__(self, config: ModelConfig, num_tokens_per_seq: list[int]) -> None:
        self.config = config
        self.layer_kind = config.layer_types
        self.full_index = {lid: i for i, lid in enumerate(config.full_layer_ids)}
        self.sliding_index = {lid: i for i, lid in enumerate(config.sliding_layer_ids)}
        offsets = [0]
        for n in num_tokens_per_seq:
            offsets.append(offsets[-1] + n)
        self.offsets = offsets
        self._new_sliding_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def window_for(self, layer_id: int) -> int | None:
        return None if self.layer_kind[layer_id] == FULL else self.config.sliding_window

    def record_sliding(self, layer_id: int, k: torch.Tensor, v: torch.Tensor) -> None:
        if self.layer_kind[layer_id] != FULL:
            self._new_sliding_kv[self.sliding_index[layer_id]] = (k, v)

    def new_window_kv(self, seq_index: int) -> torch.Tensor:
        """[num_sliding_layers, 2, num_tokens, kv_heads, head_dim] of this chunk's tokens."""
        lo, hi = self.offsets[seq_index], self.offsets[seq_index + 1]
        cfg = self.config
        if not self._new_sliding_kv:
            return torch.zeros((0, 2, hi - lo, cfg.num_kv_heads, cfg.head_dim))
        per_layer = [
            torch.stack((self._new_sliding_kv[s][0][lo:hi], self._new_sliding_kv[s][1][lo:hi]))
            for s in range(len(self._new_sliding_kv))
        ]
        return torch.stack(per_layer)


class DenseAttention(_Backend):
    """Whole sequences from position 0, K/V straight from this call: no pool, no window."""

    def __call__(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        self.record_sliding(layer_id, k, v)
        outs = []
        for lo, hi in zip(self.offsets[:-1], self.offsets[1:], strict=True):
            pos = torch.arange(hi - lo)
            outs.append(
                attend(q[lo:hi], k[lo:hi], v[lo:hi], visible(pos, pos, self.window_for(layer_id)))
            )
        return torch.cat(outs)


class PrefillAttention(_Backend):
    """Variable-length chunks, each after a cached prefix (pool + window buffer)."""

    def __init__(self, config: ModelConfig, pool: PagedKVPool, seqs: list[SeqInput]) -> None:
        super().__init__(config, [s.num_tokens for s in seqs])
        self.pool = pool
        self.seqs = seqs
        block = pool.layout.block_size_tokens
        self.q_pos = [torch.arange(s.start_position, s.start_position + s.num_tokens) for s in seqs]
        all_pos = [torch.arange(s.start_position + s.num_tokens) for s in seqs]
        self.new_slots = [
            slots_for(s.block_table, p, block) for s, p in zip(seqs, self.q_pos, strict=False)
        ]
        self.all_slots = [
            slots_for(s.block_table, p, block) for s, p in zip(seqs, all_pos, strict=False)
        ]
        self.all_pos = all_pos

    def __call__(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        self.record_sliding(layer_id, k, v)
        outs = []
        for i, seq in enumerate(self.seqs):
            lo, hi = self.offsets[i], self.offsets[i + 1]
            if self.layer_kind[layer_id] == FULL:
                f = self.full_index[layer_id]
                self.pool.write(f, self.new_slots[i], k[lo:hi], v[lo:hi])
                keys, values = self.pool.gather(f, self.all_slots[i])
                k_pos = self.all_pos[i]
            else:
                w = seq.window.kv[self.sliding_index[layer_id]]
                keys = torch.cat((w[0].to(k.dtype), k[lo:hi]))
                values = torch.cat((w[1].to(v.dtype), v[lo:hi]))
                k_pos = torch.arange(seq.window.start_position, seq.start_position + seq.num_tokens)
            mask = visible(self.q_pos[i], k_pos, self.window_for(layer_id))
            outs.append(attend(q[lo:hi], keys.to(q.dtype), values.to(q.dtype), mask))
        return torch.cat(outs)


class DecodeAttention(_Backend):
    """One new token per sequence; keys padded to the longest sequence, one attention call."""

    def __init__(self, config: ModelConfig, pool: PagedKVPool, seqs: list[SeqInput]) -> None:
        super().__init__(config, [1] * len(seqs))
        self.pool = pool
        block = pool.layout.block_size_tokens
        q_pos = torch.tensor([s.start_position for s in seqs])
        self.q_pos = q_pos[:, None]  # [B, 1]
        self.new_slots = (
            torch.stack([s.block_table[p // block] for s, p in zip(seqs, q_pos, strict=False)]),
            q_pos % block,
        )
        # Full layers: keys 0..q_pos, padded to the longest; pads point at slot 0, masked.
        k_pos = torch.arange(int(q_pos.max()) + 1)[None, :].expand(len(seqs), -1)
        self.full_valid = k_pos <= self.q_pos
        tables = [s.block_table[torch.clamp(k_pos[0], max=s.start_position) // block] for s in seqs]
        self.full_slots = (torch.stack(tables) * self.full_valid, (k_pos % block))
        self.full_k_pos = k_pos
        # Sliding layers: the window buffer, left-padded to the longest, then the new token.
        if config.num_sliding_layers:
            width = max(s.window.num_tokens for s in seqs)
            shape = (
                len(seqs),
                config.num_sliding_layers,
                2,
                width,
                config.num_kv_heads,
                config.head_dim,
            )
            self.window_kv = torch.zeros(shape, dtype=seqs[0].window.kv.dtype)
            w_pos = torch.full((len(seqs), width), -1, dtype=torch.long)
            for b, s in enumerate(seqs):
                n = s.window.num_tokens
                if n:
                    self.window_kv[b, :, :, width - n :] = s.window.kv
                    w_pos[b, width - n :] = torch.arange(
                        s.window.start_position, s.window.end_position
                    )
            self.win_k_pos = torch.cat((w_pos, q_pos[:, None]), dim=1)
            self.win_valid = self.win_k_pos >= 0

    def __call__(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        self.record_sliding(layer_id, k, v)
        if self.layer_kind[layer_id] == FULL:
            f = self.full_index[layer_id]
            self.pool.write(f, self.new_slots, k, v)
            keys, values = self.pool.gather(f, self.full_slots)  # [B, L, H, D]
            mask = self.full_valid
        else:
            s = self.sliding_index[layer_id]
            w = self.window_kv[:, s].to(k.dtype)  # [B, 2, width, H, D]
            keys = torch.cat((w[:, 0], k[:, None]), dim=1)
            values = torch.cat((w[:, 1], v[:, None]), dim=1)
            mask = self.win_valid & visible(
                self.q_pos, self.win_k_pos, self.config.sliding_window
            ).squeeze(1)
        out = attend(q[:, None], keys.to(q.dtype), values.to(q.dtype), mask[:, None, :])
        return out[:, 0]
