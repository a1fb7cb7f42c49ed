"""ModelRunner: turns Sequences into model calls over the paged pool and window buffers.

Three entry points share one model:
- `prefill(seqs)`: the uncomputed tokens of each sequence (a whole prompt, or the suffix after
  a cached prefix), variable lengths in one packed batch.
- `decode(seqs)`: the one new token of each sequence, as one padded batch.
- `score_drafts(seqs, drafts)` + `accept_draft(...)`: a speculative draft scored in one pass;
  only the accepted prefix enters the window buffers.
`forward_dense` runs whole sequences without any cache: the contiguous reference path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from worker.engine.attention import (
    DecodeAttention,
    DenseAttention,
    PrefillAttention,
    SeqInput,
)
from worker.engine.block_allocator import BlockAllocator
from worker.engine.block_manager import BlockManager, block_table_tensor
from worker.engine.errors import DraftError, SequenceStateError
from worker.engine.host_tier import HostTier
from worker.engine.kv_cache import (
    DEFAULT_BLOCK_SIZE_TOKENS,
    KVBlockLayout,
    PagedKVPool,
    SlidingWindowState,
)
from worker.engine.model import LanguageModel
from worker.engine.sequence import Sequence


@dataclass
class DraftScore:
    """Logits for [last token] + draft, and the sliding K/V not yet committed."""

    draft_token_ids: list[int]
    logits: torch.Tensor  # [len(draft) + 1, vocab]
    pending_window_kv: torch.Tensor  # [num_sliding_layers, 2, len(draft) + 1, heads, dim]


class ModelRunner:
    def __init__(
        self,
        model: LanguageModel,
        num_blocks: int,
        block_size_tokens: int = DEFAULT_BLOCK_SIZE_TOKENS,
        kv_dtype: torch.dtype | None = None,
        paged_kernel: bool = True,
        host_tier_bytes: int = 0,
    ) -> None:
        """paged_kernel: full layers of a prefill read the pool in place through
        shared/kernels/cpu/paged_attention.c where it serves (False: always SDPA).
        host_tier_bytes: the host-memory tier behind the pool (0: none)."""
        self.model = model
        self.paged_kernel = paged_kernel
        self.config = model.config
        self.dtype = kv_dtype or model.dtype
        self.layout = KVBlockLayout.for_model(self.config, block_size_tokens, self.dtype)
        self.pool = PagedKVPool(self.layout, num_blocks)
        self.host_tier = HostTier(self.pool, host_tier_bytes)
        self.allocator = BlockAllocator(
            num_blocks, on_evict=self.host_tier.save if host_tier_bytes else None
        )
        self.block_manager = BlockManager(self.allocator, block_size_tokens)
        self._last_stack: tuple[list[SlidingWindowState], torch.Tensor] | None = None

    def empty_window(self, end_position: int = 0) -> SlidingWindowState:
        return SlidingWindowState.empty(self.config, end_position, self.dtype)

    def _inputs(self, seqs: list[Sequence], chunks: list[list[int]]):
        inputs, token_ids, positions = [], [], []
        for seq, chunk in zip(seqs, chunks, strict=True):
            start = seq.num_computed_tokens
            if seq.window is None:
                seq.window = self.empty_window(start) if start == 0 else None
            if seq.window is None or seq.window.end_position != start:
                raise SequenceStateError(
                    f"sequence {seq.seq_id}: {start} tokens computed but the window buffer "
                    f"ends at {None if seq.window is None else seq.window.end_position}"
                )
            self.block_manager.reserve(seq, start + len(chunk))
            inputs.append(SeqInput(start, len(chunk), block_table_tensor(seq), seq.window))
            token_ids.extend(chunk)
            positions.extend(range(start, start + len(chunk)))
        return inputs, torch.tensor(token_ids), torch.tensor(positions)

    def _keep_boundary_window(self, seq: Sequence, new_kv: torch.Tensor) -> None:
        start, block_size = seq.num_computed_tokens, self.layout.block_size_tokens
        # A cache hit never covers the last token, so no later turn restores past it.
        end = min(start + new_kv.shape[2], seq.num_tokens - 1)
        boundary = end // block_size * block_size
        if boundary > start and seq.window is not None:
            seq.boundary_window = seq.window.appended(new_kv[:, :, : boundary - start])

    def _commit(self, seq: Sequence, new_kv: torch.Tensor) -> None:
        seq.window = seq.window.appended(new_kv)
        seq.num_computed_tokens += new_kv.shape[2]

    @torch.inference_mode()
    def prefill(
        self,
        seqs: list[Sequence],
        return_all_logits: bool = False,
        num_new_tokens: list[int] | None = None,
        keep_boundary_window: bool = False,
    ) -> list[torch.Tensor]:
        """Per sequence: logits of the last token [vocab], or of every new token [n, vocab].

        `num_new_tokens[i]` caps the chunk of sequence i (chunked prefill); by default every
        uncomputed token is computed. The logits are those of the chunk's last token.
        `keep_boundary_window`: when a chunk crosses a block boundary before the sequence's
        last token, set the sequence's `boundary_window` to its window at the last one
        crossed (what swa-memcache keeps for the next turn, whose cache hit stops before its
        last token), so no chunk has to stop there.
        """
        if num_new_tokens is None:
            chunks = [seq.token_ids[seq.num_computed_tokens :] for seq in seqs]
        else:
            chunks = [
                seq.token_ids[seq.num_computed_tokens : seq.num_computed_tokens + n]
                for seq, n in zip(seqs, num_new_tokens, strict=True)
            ]
        for seq, chunk in zip(seqs, chunks, strict=True):
            if not chunk:
                raise SequenceStateError(
                    f"sequence {seq.seq_id}: all {seq.num_tokens} tokens are cached; leave at "
                    f"least the last one uncomputed so there is a token to predict from"
                )
        inputs, token_ids, positions = self._inputs(seqs, chunks)
        backend = PrefillAttention(self.config, self.pool, inputs, self.paged_kernel)
        hidden = self.model(token_ids, positions, backend)
        out = []
        for i, seq in enumerate(seqs):
            lo, hi = backend.offsets[i], backend.offsets[i + 1]
            if return_all_logits:
                out.append(self.model.compute_logits(hidden[lo:hi]))
            else:  # one row, as a [1, hidden] batch: the block kernel takes it (12 -> 1 ms)
                out.append(self.model.compute_logits(hidden[hi - 1 : hi])[0])
            new_kv = backend.new_window_kv(i)
            if keep_boundary_window:
                self._keep_boundary_window(seq, new_kv)
            self._commit(seq, new_kv)
        return out

    @torch.inference_mode()
    def decode(self, seqs: list[Sequence]) -> torch.Tensor:
        """Logits [batch, vocab] after each sequence's last (just sampled) token."""
        for seq in seqs:
            if seq.num_computed_tokens != seq.num_tokens - 1:
                raise SequenceStateError(
                    f"sequence {seq.seq_id}: decode needs exactly one uncomputed token, "
                    f"has {seq.num_tokens - seq.num_computed_tokens}"
                )
        inputs, token_ids, positions = self._inputs(seqs, [[s.last_token_id] for s in seqs])
        backend = DecodeAttention(self.config, self.pool, inputs, self._reusable_stack(seqs))
        logits = self.model.compute_logits(self.model(token_ids, positions, backend))
        windows, stacked = backend.appended_windows()
        for seq, window in zip(seqs, windows, strict=True):
            seq.window = window
            seq.num_computed_tokens += 1
        self._last_stack = (windows, stacked) if stacked is not None else None
        return logits

    def _reusable_stack(self, seqs: list[Sequence]) -> torch.Tensor | None:
        """Last step's stacked windows, if this batch is the same sequences in the same order
        and none of their windows changed since (identity, not equality: O(batch))."""
        if self._last_stack is None:
            return None
        windows, stacked = self._last_stack
        if len(windows) != len(seqs) or any(
            s.window is not w for s, w in zip(seqs, windows, strict=True)
        ):
            return None
        return stacked

    @torch.inference_mode()
    def score_drafts(self, seqs: list[Sequence], drafts: list[list[int]]) -> list[DraftScore]:
        """Score [last token] + draft per sequence; nothing is committed to the window yet."""
        chunks = [[seq.last_token_id, *draft] for seq, draft in zip(seqs, drafts, strict=True)]
        inputs, token_ids, positions = self._inputs(seqs, chunks)
        backend = PrefillAttention(self.config, self.pool, inputs, self.paged_kernel)
        hidden = self.model(token_ids, positions, backend)
        return [
            DraftScore(
                list(draft),
                self.model.compute_logits(hidden[backend.offsets[i] : backend.offsets[i + 1]]),
                backend.new_window_kv(i),
            )
            for i, draft in enumerate(drafts)
        ]

    def accept_draft(self, seq: Sequence, score: DraftScore, accepted_token_ids: list[int]) -> None:
        """Append the verifier's output (accepted draft prefix + one token) to `seq`."""
        num_accepted = len(accepted_token_ids) - 1
        if num_accepted < 0 or accepted_token_ids[:-1] != score.draft_token_ids[:num_accepted]:
            raise DraftError(f"sequence {seq.seq_id}: accepted tokens are not a draft prefix")
        # The last token and the accepted draft tokens now have K/V; the final output token
        # does not. Full-layer K/V of rejected tokens stays in the pages, unreferenced, and is
        # overwritten when those positions are computed again.
        self._commit(seq, score.pending_window_kv[:, :, : 1 + num_accepted])
        seq.token_ids.extend(accepted_token_ids)

    @torch.inference_mode()
    def forward_dense(self, token_ids: list[list[int]]) -> list[torch.Tensor]:
        """Logits [n, vocab] of every position, each sequence from scratch, no cache."""
        backend = DenseAttention(self.config, [len(t) for t in token_ids])
        flat = torch.tensor([t for ids in token_ids for t in ids])
        positions = torch.cat([torch.arange(len(t)) for t in token_ids])
        logits = self.model.compute_logits(self.model(flat, positions, backend))
        return list(torch.split(logits, [len(t) for t in token_ids]))

    def release(self, seq: Sequence) -> None:
        self.block_manager.release(seq)
        seq.window = None
        seq.num_computed_tokens = 0
