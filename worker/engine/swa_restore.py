"""Sliding-window state at a cached boundary (docs/design.md, 'Sliding-window state'), rebuilt
three ways.

A cached prefix of P tokens brings the full-attention layers' K/V (pages from the store) but
not the sliding layers' last-W-tokens state, which lives only in the producing node's RAM
(swa-memcache). To resume a sequence at P the engine needs that state back:

- SNAPSHOT: the `SlidingWindowState` kept at P (swa-memcache hit). Exact, free.
- EXACT replay: recompute tokens [P - R, P) with R = k x W, k the number of sliding layers up
  to the last one. Each sliding layer widens the receptive field by one window, so k windows
  of history reproduce every sliding layer's K/V over the last W tokens exactly.
- BOUNDED replay: recompute only the last R < k x W tokens, starting from an empty window
  before them. Approximate and cheap (R = 128 in the reference deployment).

Replay computes the sliding layers' K/V only: it runs the model up to the last sliding layer,
and full-attention layers met on the way attend to the loaded prefix in the pages (exact
keys, never overwritten: the replayed hidden states are approximate under bounded replay).
"""

from __future__ import annotations

from enum import StrEnum

import torch

from worker.engine.attention import _Backend, attend, visible
from worker.engine.config import FULL, ModelConfig
from worker.engine.errors import SequenceStateError
from worker.engine.kv_cache import PagedKVPool, SlidingWindowState, slots_for
from worker.engine.model import LanguageModel

SNAPSHOT_MAGIC = b"KVFSWA1\0"
SNAPSHOT_HEADER_NBYTES = len(SNAPSHOT_MAGIC) + 24 + 16  # magic, 3 u64 fields, dtype name


class RestoreMode(StrEnum):
    SNAPSHOT = "snapshot"
    EXACT = "exact"
    BOUNDED = "bounded"


def exact_replay_tokens(config: ModelConfig) -> int:
    """k x W: the history that reproduces the sliding state exactly (0 if nothing slides).

    Full layers between sliding ones widen nothing: they read exact K/V from the pages."""
    if not config.sliding_layer_ids or not config.sliding_window:
        return 0
    return len(config.sliding_layer_ids) * config.sliding_window


class ReplayAttention(_Backend):
    """One sequence's tokens [start, end) replayed over a prefix that is already in the pool.

    Full layers: queries at the replayed positions, keys and values of positions [0, end)
    read from the pages (read only). Sliding layers: an empty window before `start`.
    """

    def __init__(
        self,
        config: ModelConfig,
        pool: PagedKVPool,
        block_table: torch.Tensor,
        start: int,
        end: int,
    ) -> None:
        super().__init__(config, [end - start])
        self.pool = pool
        self.q_pos = torch.arange(start, end)
        self.k_pos_full = torch.arange(end)
        self.full_slots = slots_for(block_table, self.k_pos_full, pool.layout.block_size_tokens)

    def store(self, layer_id: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Record the sliding K/V only: the pages hold the prefix already (read only)."""
        self.record_sliding(layer_id, k, v)

    def __call__(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        self.record_sliding(layer_id, k, v)
        if self.layer_kind[layer_id] == FULL:
            keys, values = self.pool.gather(self.full_index[layer_id], self.full_slots)
            mask = visible(self.q_pos, self.k_pos_full, None)
            return attend(q, keys.to(q.dtype), values.to(q.dtype), mask)
        mask = visible(self.q_pos, self.q_pos, self.config.sliding_window)
        return attend(q, k, v, mask)


@torch.no_grad()
def replay_window(
    model: LanguageModel,
    pool: PagedKVPool,
    block_table: list[int],
    token_ids: list[int],
    boundary: int,
    num_replay_tokens: int,
    dtype: torch.dtype | None = None,
) -> SlidingWindowState:
    """The sliding state at `boundary` from the last `num_replay_tokens` tokens before it.

    `token_ids` must cover [0, boundary) and the pool must hold the full layers' K/V of those
    positions in `block_table`. Exact when `num_replay_tokens >= exact_replay_tokens(config)`.
    """
    config = model.config
    dtype = dtype or pool.layout.dtype
    if boundary > len(token_ids):
        raise SequenceStateError(f"boundary {boundary} is past the {len(token_ids)} tokens given")
    block_size = pool.layout.block_size_tokens
    if len(block_table) * block_size < boundary:
        raise SequenceStateError(
            f"block table covers {len(block_table) * block_size} tokens, boundary is {boundary}"
        )
    if num_replay_tokens < 0:
        raise SequenceStateError(f"num_replay_tokens must be >= 0, got {num_replay_tokens}")
    start = max(0, boundary - num_replay_tokens)
    empty = SlidingWindowState.empty(config, start, dtype)
    if start == boundary or not config.sliding_layer_ids:
        return SlidingWindowState.empty(config, boundary, dtype)
    backend = ReplayAttention(config, pool, torch.tensor(block_table), start, boundary)
    model.replay(torch.tensor(token_ids[start:boundary]), torch.arange(start, boundary), backend)
    return empty.appended(backend.new_window_kv(0))


def snapshot_to_bytes(window: SlidingWindowState) -> bytes:
    """What swa-memcache stores: magic, end position, token count, dtype, then raw K/V."""
    header = SNAPSHOT_MAGIC + b"".join(
        int(v).to_bytes(8, "little")
        for v in (window.end_position, window.num_tokens, window.window_tokens)
    )
    dtype_name = str(window.kv.dtype).removeprefix("torch.").encode().ljust(16, b"\0")
    payload = window.kv.contiguous().view(torch.uint8).numpy().tobytes()
    return header + dtype_name + payload


def snapshot_from_bytes(config: ModelConfig, data: bytes) -> SlidingWindowState:
    """Inverse of `snapshot_to_bytes`; a malformed snapshot raises (the caller replays)."""
    fixed = SNAPSHOT_HEADER_NBYTES
    if len(data) < fixed or not data.startswith(SNAPSHOT_MAGIC):
        raise SequenceStateError("not a sliding-window snapshot")
    fields = data[len(SNAPSHOT_MAGIC) : len(SNAPSHOT_MAGIC) + 24]
    end_position, num_tokens, window_tokens = (
        int.from_bytes(fields[i : i + 8], "little") for i in (0, 8, 16)
    )
    dtype = getattr(torch, data[fixed - 16 : fixed].rstrip(b"\0").decode(), None)
    if not isinstance(dtype, torch.dtype):
        raise SequenceStateError("snapshot names an unknown dtype")
    shape = (config.num_sliding_layers, 2, num_tokens, config.num_kv_heads, config.head_dim)
    numel = 1
    for dim in shape:
        numel *= dim
    expected = numel * torch.empty((), dtype=dtype).element_size()
    if len(data) - fixed != expected or window_tokens != (config.sliding_window or 0):
        raise SequenceStateError(
            f"snapshot holds {len(data) - fixed} bytes for window {window_tokens}; this model "
            f"needs {expected} bytes for window {config.sliding_window}"
        )
    if numel == 0:  # no sliding layers: an empty window (frombuffer refuses b"")
        return SlidingWindowState(torch.zeros(shape, dtype=dtype), end_position, window_tokens)
    raw = torch.frombuffer(bytearray(data[fixed:]), dtype=torch.uint8)
    return SlidingWindowState(raw.view(dtype).view(shape), end_position, window_tokens)
