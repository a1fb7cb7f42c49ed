"""Attention backends: where K/V come from and which keys each query may see.

The model computes q/k/v for the packed tokens of a batch and hands them to one backend:

- DenseAttention: no cache, every sequence starts at position 0 (the contiguous reference).
- PrefillAttention: variable-length chunks, each resuming after a prefix whose full-layer K/V
  is in the paged pool and whose sliding-layer K/V is in a window buffer. Full layers in
  float32 read the pool in place through shared/kernels/cpu/paged_attention.c where it is built
  (`paged_attention`), else go through SDPA.
- DecodeAttention: one token per sequence, batched into one padded attention call.

Masks follow transformers: causal is `key_pos <= query_pos`; a sliding layer of window W adds
`key_pos > query_pos - W`, so a query sees itself and the W-1 tokens before it.
Sliding-layer K/V of the new tokens is recorded, not committed: the runner appends to the
window only what it accepts (all of a prefill, the accepted prefix of a speculative draft).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch.nn import functional as F

from shared.kernels import cpu as cpu_kernels
from worker.engine.config import FULL, ModelConfig
from worker.engine.kv_cache import PagedKVPool, SlidingWindowState, slots_for


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


def attend_grouped(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """`attend` for q: [B, Tq, Hq, D], k, v: [B, Tk, Hkv, D], mask: [B, Tq, Tk], without
    copying K/V per query head.

    The n_rep query heads that share a KV head are folded into the query axis, so SDPA sees
    Hkv heads of n_rep * Tq queries. Measured against `attend` (repeat_interleave copies
    every key n_rep times): decode, batch 32 x 256 keys, 3.1 ms -> 0.74 ms per layer;
    prefill, 320 queries x 8K keys, 138 ms -> 61 ms.
    """
    batch, num_q, num_heads, dim = q.shape
    num_kv_heads = k.shape[2]
    n_rep = num_heads // num_kv_heads
    # [B, Tq, Hkv, n_rep, D] -> [B, Hkv, n_rep * Tq, D]; query head h = kv_head * n_rep + r.
    qg = q.view(batch, num_q, num_kv_heads, n_rep, dim).permute(0, 2, 3, 1, 4)
    qg = qg.reshape(batch, num_kv_heads, n_rep * num_q, dim)
    if n_rep > 1 and num_q > 1:  # one query per head (decode): the mask broadcasts
        mask = mask.repeat(1, n_rep, 1)
    out = F.scaled_dot_product_attention(
        qg, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask[:, None], scale=dim**-0.5
    )
    out = out.view(batch, num_kv_heads, n_rep, num_q, dim).permute(0, 3, 1, 2, 4)
    return out.reshape(batch, num_q, num_heads, dim)


# SDPA's CPU flash kernel, which also returns each row's log-sum-exp: what merging two partial
# attentions over disjoint keys needs. Absent from a torch without it: the masked path serves.
_flash_with_lse = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def attend_causal(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """A chunk attending to itself causally, with no mask (SDPA's `is_causal` skips the
    masked half); K/V repeated per query head (Tq rows: cheap). q: [Tq, H, D], k, v:
    [Tq, Hkv, D] -> the output [Tq, H, D] and each row's log-sum-exp [Tq, H]."""
    n_rep = q.shape[1] // k.shape[1]
    out, lse = _flash_with_lse(
        q.transpose(0, 1)[None],
        k.repeat_interleave(n_rep, dim=1).transpose(0, 1)[None],
        v.repeat_interleave(n_rep, dim=1).transpose(0, 1)[None],
        is_causal=True,
        scale=q.shape[-1] ** -0.5,
    )[:2]
    return out[0].transpose(0, 1), lse[0].transpose(0, 1)


def attend_after_prefix(
    q: torch.Tensor,
    prefix_k: torch.Tensor,
    prefix_v: torch.Tensor,
    new_k: torch.Tensor,
    new_v: torch.Tensor,
) -> torch.Tensor:
    """Causal attention of a chunk that follows a cached prefix, without a mask.

    q, new_k, new_v: [Tq, H*, D], the chunk's own queries and keys; prefix_k, prefix_v:
    [P, Hkv, D], every key before it. Every query sees the whole prefix (no mask: the
    GQA-folded queries of `attend_grouped` in one call) and the chunk causally (SDPA's
    `is_causal`, which skips the masked half); the two partial results are merged by their
    log-sum-exp. Measured against one masked call over all P + Tq keys (SmolLM2, 256 queries
    after 1,856 cached keys, 2 threads): 8.7 ms -> 6.7 ms per layer.
    """
    num_q, num_heads, dim = q.shape
    num_kv_heads = new_k.shape[1]
    n_rep = num_heads // num_kv_heads
    scale = dim**-0.5
    # Prefix: [1, Hkv, n_rep * Tq, D] queries against [1, Hkv, P, D] keys.
    qg = (
        q.view(num_q, num_kv_heads, n_rep, dim)
        .permute(1, 2, 0, 3)
        .reshape(1, num_kv_heads, -1, dim)
    )
    out_p, lse_p = _flash_with_lse(
        qg, prefix_k.transpose(0, 1)[None], prefix_v.transpose(0, 1)[None], scale=scale
    )[:2]
    out_p = out_p.reshape(num_kv_heads, n_rep, num_q, dim).permute(2, 0, 1, 3)
    lse_p = lse_p.reshape(num_kv_heads, n_rep, num_q).permute(2, 0, 1)
    out_n, lse_n = attend_causal(q, new_k, new_v)
    out_n = out_n.reshape(num_q, num_kv_heads, n_rep, dim)
    lse_n = lse_n.reshape(num_q, num_kv_heads, n_rep)
    # softmax over both key sets = a weighted mean of the two, weights from the sums' ratio.
    # The log-sum-exps are float32 whatever q's dtype; so is the merge (no-op casts in float32).
    weight = torch.sigmoid(lse_p - lse_n).unsqueeze(-1)
    out = torch.lerp(out_n.float(), out_p.float(), weight)
    return out.to(q.dtype).reshape(num_q, num_heads, dim)


@functools.cache
def _attention_kernel():
    try:
        lib = cpu_kernels.library()
    except cpu_kernels.KernelUnavailable:
        return None
    return lib if lib.kvf_attention_simd() else None


def paged_attention_serves(pool: PagedKVPool) -> bool:
    """Whether `paged_attention` takes this pool's full layers: float32 on the CPU, 64-token
    blocks, head_dim a multiple of 64 (up to 256), and a kernel build with AVX-512F."""
    layout = pool.layout
    return (
        pool.kv.dtype == torch.float32
        and pool.kv.device.type == "cpu"
        and layout.block_size_tokens == 64
        and layout.head_dim % 64 == 0
        and layout.head_dim <= 256
        and _attention_kernel() is not None
    )


def paged_attention_scratch(pool: PagedKVPool, num_keys: int) -> torch.Tensor:
    """The kernel's buffer for K transposed per block and KV head, for up to num_keys keys."""
    layout = pool.layout
    num_blocks = -(-num_keys // layout.block_size_tokens)
    return torch.empty(layout.num_kv_heads * num_blocks * layout.head_dim * 64)


def paged_attention(
    pool: PagedKVPool,
    full_layer: int,
    block_table: torch.Tensor,
    start: int,
    q: torch.Tensor,
    scratch: torch.Tensor,
) -> torch.Tensor:
    """Causal attention of a chunk at positions start .. start + Tq - 1 whose own K/V is
    already in the pool: every key is read from the sequence's blocks in place (no gather, no
    per-head copy, no mask; see shared/kernels/cpu/paged_attention.c). q: float32 [Tq, H, D] ->
    [Tq, H, D]. Only where `paged_attention_serves(pool)`."""
    num_q, num_heads, dim = q.shape
    layout = pool.layout
    num_keys = start + num_q
    num_blocks = -(-num_keys // layout.block_size_tokens)
    if block_table.dtype != torch.int64 or block_table.numel() < num_blocks:
        raise ValueError(f"block table of {block_table.numel()} blocks for {num_keys} keys")
    if scratch.numel() < layout.num_kv_heads * num_blocks * dim * 64:
        raise ValueError(f"scratch of {scratch.numel()} floats is too small for {num_keys} keys")
    q = q.contiguous()
    table = block_table.contiguous()
    out = torch.empty_like(q)
    kv = pool.kv
    failed = _attention_kernel().kvf_paged_attention(
        q.data_ptr(),
        num_q,
        start,
        num_heads,
        layout.num_kv_heads,
        dim,
        kv.data_ptr(),
        kv[0].numel(),
        full_layer * kv[0, 0].numel(),
        layout.block_size_tokens,
        table.data_ptr(),
        dim**-0.5,
        out.data_ptr(),
        scratch.data_ptr(),
        torch.get_num_threads(),
    )
    if failed:
        raise ValueError(f"paged attention does not serve {list(q.shape)} over {layout}")
    return out


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

    def __init__(
        self,
        config: ModelConfig,
        pool: PagedKVPool,
        seqs: list[SeqInput],
        paged_kernel: bool = True,
    ) -> None:
        super().__init__(config, [s.num_tokens for s in seqs])
        self.pool = pool
        self.seqs = seqs
        # Full layers through shared/kernels/cpu/paged_attention.c where it serves (float32 pool,
        # AVX-512): measured in `kvfabric bench engine` against the SDPA path below.
        self.scratch = (
            paged_attention_scratch(pool, max(s.start_position + s.num_tokens for s in seqs))
            if paged_kernel and paged_attention_serves(pool)
            else None
        )
        block = pool.layout.block_size_tokens
        self.q_pos = [torch.arange(s.start_position, s.start_position + s.num_tokens) for s in seqs]
        all_pos = [torch.arange(s.start_position + s.num_tokens) for s in seqs]
        self.new_slots = [
            slots_for(s.block_table, p, block) for s, p in zip(seqs, self.q_pos, strict=False)
        ]
        self.all_pos = all_pos
        # Whole blocks covering each sequence's keys: one index_select per layer, not a
        # per-token gather (see gather_blocks).
        self.key_blocks = [
            s.block_table[: -(-(s.start_position + s.num_tokens) // block)] for s in seqs
        ]
        self.prefix_blocks = [s.block_table[: -(-s.start_position // block)] for s in seqs]
        # Masks depend only on positions: built once per call, shared by all layers.
        window = config.sliding_window
        # Full layers need none where SDPA's CPU flash kernel gives log-sum-exps.
        self.split_full = _flash_with_lse is not None and pool.kv.device.type == "cpu"
        self.full_masks = (
            []
            if self.split_full
            else [visible(q, k, None) for q, k in zip(self.q_pos, all_pos, strict=True)]
        )
        self.sliding_masks = [
            visible(
                q, torch.arange(s.window.start_position, s.start_position + s.num_tokens), window
            )
            if config.num_sliding_layers
            else None
            for s, q in zip(seqs, self.q_pos, strict=True)
        ]

    def store(self, layer_id: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write the chunk's K/V (the pool's pages, the window's new tokens) and attend to
        nothing: the simulated model's path (worker/mock_engine/), whose K/V is real bytes but
        whose attention output nobody reads."""
        self.record_sliding(layer_id, k, v)
        if self.layer_kind[layer_id] == FULL:
            f = self.full_index[layer_id]
            for i in range(len(self.seqs)):
                lo, hi = self.offsets[i], self.offsets[i + 1]
                self.pool.write(f, self.new_slots[i], k[lo:hi], v[lo:hi])

    def __call__(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        self.record_sliding(layer_id, k, v)
        outs = []
        for i, seq in enumerate(self.seqs):
            lo, hi = self.offsets[i], self.offsets[i + 1]
            num_keys = seq.start_position + seq.num_tokens
            if self.layer_kind[layer_id] == FULL:
                f = self.full_index[layer_id]
                self.pool.write(f, self.new_slots[i], k[lo:hi], v[lo:hi])
                if self.scratch is not None and q.dtype == torch.float32:
                    outs.append(
                        paged_attention(
                            self.pool,
                            f,
                            seq.block_table,
                            seq.start_position,
                            q[lo:hi],
                            self.scratch,
                        )
                    )
                    continue
                if self.split_full:
                    outs.append(self._after_prefix(f, i, q[lo:hi], k[lo:hi], v[lo:hi]))
                    continue
                keys, values = self.pool.gather_blocks(f, self.key_blocks[i])
                keys, values = keys[:num_keys], values[:num_keys]
                mask = self.full_masks[i]
            else:
                w = seq.window.kv[self.sliding_index[layer_id]]
                keys = torch.cat((w[0].to(k.dtype), k[lo:hi]))
                values = torch.cat((w[1].to(v.dtype), v[lo:hi]))
                mask = self.sliding_masks[i]
            out = attend_grouped(
                q[None, lo:hi], keys.to(q.dtype)[None], values.to(q.dtype)[None], mask[None]
            )
            outs.append(out[0])
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _after_prefix(
        self, full_layer: int, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """A full layer: the chunk's own K/V as computed, the prefix's from the pool."""
        start = self.seqs[i].start_position
        dtype = q.dtype
        if start == 0:
            return attend_causal(q, k.to(dtype), v.to(dtype))[0]
        keys, values = self.pool.gather_blocks(full_layer, self.prefix_blocks[i])
        return attend_after_prefix(
            q, keys[:start].to(dtype), values[:start].to(dtype), k.to(dtype), v.to(dtype)
        )


class DecodeAttention(_Backend):
    """One new token per sequence; keys padded to the longest sequence, one attention call.

    Everything that depends only on positions (slots, masks, the stacked window buffers) is
    built once per step here; each layer then does one pool write, one block gather and one
    SDPA call, whatever the batch size.
    """

    def __init__(
        self,
        config: ModelConfig,
        pool: PagedKVPool,
        seqs: list[SeqInput],
        stacked_windows: torch.Tensor | None = None,
    ) -> None:
        super().__init__(config, [1] * len(seqs))
        self.pool = pool
        self.seqs = seqs
        block = pool.layout.block_size_tokens
        batch = len(seqs)
        q_pos = torch.tensor([s.start_position for s in seqs])
        self.q_pos = q_pos[:, None]  # [B, 1]
        # Full layers: whole blocks covering 0..q_pos, padded to the longest with block 0
        # (masked); the new token's K/V is written to the pool before the gather.
        num_key_blocks = int(q_pos.max()) // block + 1
        tables = torch.nn.utils.rnn.pad_sequence(
            [s.block_table[:num_key_blocks] for s in seqs], batch_first=True
        )
        if tables.shape[1] < num_key_blocks:  # only if no table reaches the longest position
            tables = F.pad(tables, (0, num_key_blocks - tables.shape[1]))
        self.key_blocks = tables.flatten()
        self.num_keys = num_key_blocks * block
        self.new_slots = (tables[torch.arange(batch), q_pos // block], q_pos % block)
        k_pos = torch.arange(self.num_keys)
        self.full_valid = k_pos[None, :] <= self.q_pos  # [B, L]
        self.full_k_pos = k_pos[None, :].expand(batch, -1)
        self._window_uniform = False
        if config.num_sliding_layers:
            self._init_windows(config, seqs, q_pos, stacked_windows)

    def _init_windows(self, config, seqs, q_pos, stacked_windows) -> None:
        windows = [s.window for s in seqs]
        width = max(w.num_tokens for w in windows)
        # After W decoded tokens every window is full: one stack instead of a padded copy
        # per sequence (batch 32, W = 64, 3 sliding layers: 0.37 ms vs 0.93 ms per step).
        self._window_uniform = all(w.num_tokens == width for w in windows)
        if stacked_windows is not None:
            self.window_kv = stacked_windows
        elif self._window_uniform:
            self.window_kv = torch.stack([w.kv for w in windows])
        else:
            shape = (len(seqs), config.num_sliding_layers, 2, width)
            shape += (config.num_kv_heads, config.head_dim)
            self.window_kv = torch.zeros(shape, dtype=windows[0].kv.dtype)
            for b, w in enumerate(windows):
                if w.num_tokens:
                    self.window_kv[b, :, :, width - w.num_tokens :] = w.kv
        starts = torch.tensor([w.end_position - width for w in windows])
        w_pos = starts[:, None] + torch.arange(width)[None, :]
        num_real = torch.tensor([w.num_tokens for w in windows])
        w_pos = torch.where(torch.arange(width)[None, :] >= width - num_real[:, None], w_pos, -1)
        self.win_k_pos = torch.cat((w_pos, q_pos[:, None]), dim=1)
        self.win_valid = (self.win_k_pos >= 0) & visible(
            self.q_pos, self.win_k_pos, config.sliding_window
        ).squeeze(1)

    def store(self, layer_id: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write the step's K/V and attend to nothing (see `PrefillAttention.store`)."""
        self.record_sliding(layer_id, k, v)
        if self.layer_kind[layer_id] == FULL:
            self.pool.write(self.full_index[layer_id], self.new_slots, k, v)

    def __call__(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        self.record_sliding(layer_id, k, v)
        batch = q.shape[0]
        if self.layer_kind[layer_id] == FULL:
            f = self.full_index[layer_id]
            self.pool.write(f, self.new_slots, k, v)
            keys, values = self.pool.gather_blocks(f, self.key_blocks)
            keys = keys.view(batch, self.num_keys, *keys.shape[1:])
            values = values.view(batch, self.num_keys, *values.shape[1:])
            mask = self.full_valid
        else:
            s = self.sliding_index[layer_id]
            w = self.window_kv[:, s].to(k.dtype)  # [B, 2, width, H, D]
            keys = torch.cat((w[:, 0], k[:, None]), dim=1)
            values = torch.cat((w[:, 1], v[:, None]), dim=1)
            mask = self.win_valid
        out = attend_grouped(q[:, None], keys.to(q.dtype), values.to(q.dtype), mask[:, None])
        return out[:, 0]

    def appended_windows(self) -> tuple[list[SlidingWindowState], torch.Tensor | None]:
        """Each sequence's window after this step, and their stack when it is uniform.

        With every window full, the new windows are one batched cat whose rows are the
        per-sequence states; passing that stack back as `stacked_windows` next step skips
        the re-stack while the batch stays the same.
        """
        if not self._window_uniform or not self._new_sliding_kv:
            states = [s.window.appended(self.new_window_kv(b)) for b, s in enumerate(self.seqs)]
            return states, None
        new = torch.stack(
            [torch.stack(self._new_sliding_kv[s]) for s in range(len(self._new_sliding_kv))],
            dim=1,
        )  # [2, S, B, H, D] -> below [B, S, 2, 1, H, D]
        new = new.permute(2, 1, 0, 3, 4).to(self.window_kv.dtype)  # [B, S, 2, H, D]
        width = self.window_kv.shape[3]
        num_kept = min(width + 1, self.seqs[0].window.window_tokens)
        # One copy into a fresh tensor (cat + slice + contiguous would make two). Never in
        # place: the old stack's rows may still be held as window snapshots.
        stacked = torch.empty(
            (*self.window_kv.shape[:3], num_kept, *self.window_kv.shape[4:]),
            dtype=self.window_kv.dtype,
        )
        if num_kept:
            stacked[:, :, :, : num_kept - 1] = self.window_kv[:, :, :, width + 1 - num_kept :]
            stacked[:, :, :, num_kept - 1] = new
        states = [
            SlidingWindowState(stacked[b], s.window.end_position + 1, s.window.window_tokens)
            for b, s in enumerate(self.seqs)
        ]
        return states, stacked
