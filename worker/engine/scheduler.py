"""Scheduler: which sequences run in the next step, and how many tokens each computes.

Continuous batching with chunked prefill, as vLLM's v1 scheduler does it:

- `running` sequences are served oldest first: one token each when decoding, a chunk of
  their remaining prompt (at most what is left of the step's token budget) when prefilling.
- `waiting` sequences are admitted in arrival order while the budget, `max_num_seqs` and
  the free KV blocks allow; a long prompt is admitted with a first chunk only, so a cold
  8K-token prefill is computed as 16 chunks of 512 and never builds an 8K x 8K score matrix.
- When a running sequence needs a block and none is free, the youngest running sequence is
  preempted: its blocks are freed and it goes back to the front of `waiting`, to be
  recomputed from its tokens (prompt + what it generated so far) when it is admitted again.

Blocks are reserved here, before the runner is called, so the runner never runs out.

Speculative decoding: with a `propose` callback, each decoding sequence may carry a draft
(`batch.draft_token_ids`). Its tokens count against the step's budget and get blocks only if
they fit without preempting anyone: a draft is a guess and never worth evicting a sequence.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from worker.engine.block_manager import BlockManager
from worker.engine.errors import EngineError
from worker.engine.sequence import Sequence


class SchedulerConfigError(EngineError):
    """A scheduler limit is out of range."""


@dataclass(frozen=True)
class SchedulerConfig:
    # 512 tokens per step: on the tiny model (1 thread) a 512-token chunk takes 0.15-0.4 s
    # (1200-3200 prefill tok/s measured), about 4-8 batch-32 decode steps, so running
    # sequences stall at most that long while a long prompt is admitted.
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 32

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens <= 0:
            raise SchedulerConfigError(
                f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}"
            )
        if self.max_num_seqs <= 0:
            raise SchedulerConfigError(f"max_num_seqs must be positive, got {self.max_num_seqs}")


@dataclass
class ScheduledBatch:
    decode_seqs: list[Sequence] = field(default_factory=list)
    prefill_seqs: list[Sequence] = field(default_factory=list)
    prefill_num_tokens: list[int] = field(default_factory=list)
    preempted_seqs: list[Sequence] = field(default_factory=list)
    # seq_id -> draft of a decoding sequence (non-empty); those without one decode plainly.
    draft_token_ids: dict[int, list[int]] = field(default_factory=dict)

    @property
    def num_batched_tokens(self) -> int:
        num_draft = sum(len(d) for d in self.draft_token_ids.values())
        return len(self.decode_seqs) + num_draft + sum(self.prefill_num_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.decode_seqs and not self.prefill_seqs


def is_decoding(seq: Sequence) -> bool:
    """Exactly one uncomputed token (the one just sampled): a decode step computes it."""
    return seq.num_computed_tokens == seq.num_tokens - 1


# (sequence, most draft tokens the step can take) -> draft, possibly empty.
Proposer = Callable[[Sequence, int], list[int]]


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        config: SchedulerConfig,
        propose: Proposer | None = None,
    ) -> None:
        self.block_manager = block_manager
        self.config = config
        self.propose = propose
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def reorder(self, key: Callable[[Sequence], int]) -> None:
        """Serve sequences by `key` from the next `schedule` on, in place of arrival order (a
        prefill worker's fair queue): the waiting join the running (up to `max_num_seqs`), so
        a newcomer ranked first is served before those already running, its pages reserved as
        a running sequence's next chunk's are; the last running is the one preempted."""
        room = self.config.max_num_seqs - len(self.running)
        joining = sorted(self.waiting, key=key)[: max(room, 0)]
        for seq in joining:
            self.waiting.remove(seq)
        self.running = sorted([*self.running, *joining], key=key)

    def detach(self, seq: Sequence) -> None:
        """Take a running `seq` out of the queues with its blocks: a prefill worker's computed
        job, whose pages are handed off and stored before it frees them."""
        self.running.remove(seq)

    def remove(self, seq: Sequence) -> None:
        """Take `seq` out of the queues and free its blocks (finished or aborted)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        free_cache(self.block_manager, seq)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        for seq in list(self.running):
            if budget == 0:
                break
            if seq not in self.running:  # preempted while making room for an older one
                break
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self._make_room(seq, seq.num_computed_tokens + num_new, batch):
                break  # `seq` itself was the youngest and was preempted
            if is_decoding(seq):
                batch.decode_seqs.append(seq)
                # Leave a block for each later running sequence, which may need one.
                num_later = len(self.running) - self.running.index(seq) - 1
                budget -= self._add_draft(seq, budget - num_new, num_later, batch)
            else:
                batch.prefill_seqs.append(seq)
                batch.prefill_num_tokens.append(num_new)
            budget -= num_new
        # No admissions in a step that had to preempt: the pool is already short.
        while (
            self.waiting
            and budget > 0
            and not batch.preempted_seqs
            and len(self.running) < self.config.max_num_seqs
        ):
            seq = self.waiting[0]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self.block_manager.can_reserve(seq, seq.num_computed_tokens + num_new):
                break
            self.block_manager.reserve(seq, seq.num_computed_tokens + num_new)
            self.waiting.popleft()
            self.running.append(seq)
            batch.prefill_seqs.append(seq)
            batch.prefill_num_tokens.append(num_new)
            budget -= num_new
        return batch

    def _add_draft(
        self, seq: Sequence, max_tokens: int, num_blocks_kept: int, batch: ScheduledBatch
    ) -> int:
        """Ask for a draft of at most `max_tokens`; keep what fits the spare blocks."""
        if self.propose is None or max_tokens <= 0:
            return 0
        draft = self.propose(seq, max_tokens)
        if not draft:
            return 0
        block = self.block_manager.block_size_tokens
        num_spare = max(self.block_manager.allocator.num_free_blocks - num_blocks_kept, 0)
        num_fit = (len(seq.block_table) + num_spare) * block - seq.num_tokens
        draft = draft[: max(num_fit, 0)]
        if not draft:
            return 0
        self.block_manager.reserve(seq, seq.num_tokens + len(draft))
        batch.draft_token_ids[seq.seq_id] = draft
        return len(draft)

    def trim(self, seq: Sequence) -> None:
        """Free blocks reserved for rejected draft tokens (the tail past `seq`'s tokens).

        Only the tail goes: shared prefix blocks lie below the computed tokens."""
        num_needed = self.block_manager.num_blocks_for(seq.num_tokens)
        if len(seq.block_table) > num_needed:
            self.block_manager.allocator.free(seq.block_table[num_needed:])
            del seq.block_table[num_needed:]

    def _make_room(self, seq: Sequence, num_tokens: int, batch: ScheduledBatch) -> bool:
        """Reserve blocks for `seq`, preempting the youngest running sequences if needed."""
        while not self.block_manager.can_reserve(seq, num_tokens):
            victim = self.running.pop()
            free_cache(self.block_manager, victim)
            self.waiting.appendleft(victim)
            batch.preempted_seqs.append(victim)
            self.num_preemptions += 1
            if victim is seq:
                return False
        self.block_manager.reserve(seq, num_tokens)
        return True


def free_cache(block_manager: BlockManager, seq: Sequence) -> None:
    """Drop every cached K/V of `seq`; it will be recomputed from its tokens if resumed."""
    block_manager.release(seq)
    seq.window = None
    seq.num_computed_tokens = 0
