"""Engine: continuous batching over one ModelRunner.

    engine = Engine(runner)
    seq_id = engine.add_request(prompt_ids, SamplingParams(temperature=0, max_new_tokens=64))
    while engine.has_unfinished():
        for out in engine.step():  # new tokens of every sequence that advanced
            ...

Each `step` runs at most three model calls: one decode over the decoding sequences without
a draft, one `score_drafts` over those with a speculative draft (drafter.py: prompt lookup,
adaptive length; on by default, `SpecDecodeConfig(enabled=False)` turns it off), and one
packed prefill over the chunks the scheduler picked. A request can start after a cached
prefix (full-layer blocks already in the pool + the sliding window state at the prefix end,
the runner's `attach_prefix` path); its prefill then computes only the suffix.

Drafts are verified by `verify_lookup_draft` (drafter.py): the target's distribution is
kept exactly, and a seeded request gives the same tokens with or without speculation.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from worker.engine.drafter import (
    RequestDrafter,
    SpecDecodeConfig,
    SpecStats,
    num_accepted,
    verify_lookup_draft,
)
from worker.engine.errors import EngineError, OutOfBlocksError
from worker.engine.kv_cache import SlidingWindowState
from worker.engine.outputs import FinishReason
from worker.engine.runner import DraftScore, ModelRunner
from worker.engine.sampler import (
    SampleOutput,
    SamplingParams,
    generator_from_state,
    make_generator,
    sample,
)
from worker.engine.scheduler import Scheduler, SchedulerConfig
from worker.engine.sequence import Sequence


class RequestError(EngineError):
    """A request cannot be served as given: empty prompt, or longer than the engine allows."""


@dataclass(frozen=True)
class StepOutput:
    seq_id: int
    new_token_ids: tuple[int, ...]
    finished: bool
    finish_reason: FinishReason | None = None
    new_samples: tuple[SampleOutput, ...] = ()  # with logprobs when the request asked
    spec_stats: SpecStats | None = None  # the request's draft counters, once finished


@dataclass(frozen=True)
class RequestOutput:
    seq_id: int
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    finish_reason: FinishReason
    spec_stats: SpecStats | None = None


class Engine:
    def __init__(
        self,
        runner: ModelRunner,
        config: SchedulerConfig | None = None,
        eos_token_ids: Iterable[int] | None = None,
        max_model_len: int | None = None,
        spec_decode: SpecDecodeConfig | None = None,
        track_block_boundaries: bool = False,
        on_finish: Callable[[Sequence, FinishReason], None] | None = None,
    ) -> None:
        self.runner = runner
        # Keep each sequence's window at the last block boundary it reached (what swa-memcache
        # stores for the next turn). Drafts are then cut so no step jumps over a boundary.
        self.track_block_boundaries = track_block_boundaries
        # Called with a finished or aborted sequence while its pages still hold its K/V
        # (in the thread running `step`, or in `abort`'s caller), just before they are freed.
        self.on_finish = on_finish
        self.spec_decode = spec_decode or SpecDecodeConfig()
        propose = self._propose if self.spec_decode.enabled else None
        self.scheduler = Scheduler(runner.block_manager, config or SchedulerConfig(), propose)
        model_eos = runner.config.eos_token_ids
        self.eos_token_ids = frozenset(model_eos if eos_token_ids is None else eos_token_ids)
        # A sequence must always fit the pool alone, or preemption could not make room.
        capacity = runner.pool.num_blocks * runner.layout.block_size_tokens
        self.max_model_len = min(max_model_len or runner.config.max_position_embeddings, capacity)
        self._seqs: dict[int, Sequence] = {}
        self._pending: list[StepOutput] = []  # finished outside a step: abort, 0 new tokens
        self._next_seq_id = 0
        self._drafters: dict[int, RequestDrafter] = {}
        self._num_drafted = 0  # sequences that drafted in the last step
        self.spec_stats = SpecStats()  # engine-wide, over every request so far

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    def has_unfinished(self) -> bool:
        return bool(self._seqs) or bool(self._pending)

    def add_request(
        self,
        token_ids: Seq[int],
        params: SamplingParams | None = None,
        *,
        prefix_block_ids: Seq[int] | None = None,
        prefix_window: SlidingWindowState | None = None,
        num_prefix_tokens: int | None = None,
        first_token_id: int | None = None,
        sampler_state: bytes = b"",
    ) -> int:
        """Queue a request; with a prefix, its blocks gain this sequence as an owner.

        The prefix is `num_prefix_tokens` long (default: its blocks' whole length); a partly
        filled last block must belong to this sequence alone (it is written on).

        `first_token_id`: the first output token, already sampled from the last prompt
        token's logits (prefill computed the whole prompt: the prefix must cover it).
        `sampler_state` is the generator's state after that draw (`generator_state`), so
        a seeded request draws the same tokens as if this engine had sampled it. The token
        is this request's first output (`take_pending`, or the next step's); it may already
        end the request.
        """
        params = params or SamplingParams()
        if not token_ids:
            raise RequestError("prompt is empty")
        if len(token_ids) >= self.max_model_len:
            raise RequestError(
                f"prompt of {len(token_ids)} tokens leaves no room to generate "
                f"(max_model_len {self.max_model_len})"
            )
        if (prefix_block_ids is None) != (prefix_window is None):
            raise RequestError("a cached prefix needs both its block ids and its window state")
        if first_token_id is not None and (
            prefix_block_ids is None or num_prefix_tokens != len(token_ids)
        ):
            raise RequestError(
                f"a first token sampled elsewhere needs the whole prompt computed: prefix of "
                f"{num_prefix_tokens} tokens, prompt of {len(token_ids)}"
            )
        if first_token_id is not None and not 0 <= first_token_id < self.runner.config.vocab_size:
            raise RequestError(f"first token id {first_token_id} is outside the vocabulary")
        seq = Sequence(self._next_seq_id, list(token_ids), params)
        self._next_seq_id += 1
        if params.max_new_tokens == 0:
            self._pending.append(StepOutput(seq.seq_id, (), True, FinishReason.LENGTH))
            return seq.seq_id
        if not params.is_greedy:
            try:
                seq.generator = (
                    generator_from_state(sampler_state)
                    if sampler_state
                    else make_generator(params.seed)
                )
            except RuntimeError as exc:  # torch refuses a state of the wrong size or kind
                raise RequestError(f"sampler state not usable: {exc}") from exc
        if first_token_id is not None:
            seq.append(first_token_id)  # still a prompt of len(token_ids): now decoding
        if prefix_block_ids is not None:
            self.runner.block_manager.attach_prefix(
                seq, list(prefix_block_ids), prefix_window, num_prefix_tokens
            )
            self._note_boundary(seq)
        self._seqs[seq.seq_id] = seq
        self._drafters[seq.seq_id] = RequestDrafter(self.spec_decode)
        self.scheduler.add(seq)
        if first_token_id is not None:
            self._pending.append(self._advance(seq, [SampleOutput(first_token_id)], 0))
        return seq.seq_id

    def take_pending(self) -> list[StepOutput]:
        """Outputs no step has returned yet (first tokens sampled elsewhere, aborts,
        requests of 0 tokens), now rather than after the next step's forward."""
        outputs, self._pending = self._pending, []
        return outputs

    def sequence(self, seq_id: int) -> Sequence | None:
        """An unfinished request's state (read it between steps only)."""
        return self._seqs.get(seq_id)

    def _note_boundary(self, seq: Sequence) -> None:
        window = seq.window
        block_size = self.runner.layout.block_size_tokens
        if (
            self.track_block_boundaries
            and window is not None
            and window.end_position % block_size == 0
        ):
            seq.boundary_window = window

    def request_spec_stats(self, seq_id: int) -> SpecStats | None:
        """Draft counters of an unfinished request (finished ones report them in outputs)."""
        drafter = self._drafters.get(seq_id)
        return None if drafter is None else drafter.stats

    def abort(self, seq_id: int) -> bool:
        """Stop a request and free its blocks; False if it is unknown or already finished."""
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            return False
        if self.on_finish is not None:
            self.on_finish(seq, FinishReason.ABORT)
        self.scheduler.remove(seq)
        stats = self._drafters.pop(seq_id).stats
        self._pending.append(StepOutput(seq_id, (), True, FinishReason.ABORT, spec_stats=stats))
        return True

    def step(self) -> list[StepOutput]:
        outputs, self._pending = self._pending, []
        batch = self.scheduler.schedule()
        if batch.is_empty:
            if self._seqs:
                raise OutOfBlocksError(
                    f"{len(self._seqs)} requests wait but none can be scheduled: "
                    f"{self.runner.allocator.num_free_blocks} blocks free"
                )
            return outputs
        ready: list[Sequence] = []
        rows: list[torch.Tensor] = []
        drafts = batch.draft_token_ids
        drafted = [s for s in batch.decode_seqs if s.seq_id in drafts]
        self._num_drafted = len(drafted)
        plain = [s for s in batch.decode_seqs if s.seq_id not in drafts]
        if drafted:
            scores = self.runner.score_drafts(drafted, [drafts[s.seq_id] for s in drafted])
            outputs.extend(self._verify(s, sc) for s, sc in zip(drafted, scores, strict=True))
        if plain:
            ready.extend(plain)
            rows.append(self.runner.decode(plain))
        if batch.prefill_seqs:
            logits = self.runner.prefill(
                batch.prefill_seqs, num_new_tokens=batch.prefill_num_tokens
            )
            for seq, row in zip(batch.prefill_seqs, logits, strict=True):
                if seq.num_computed_tokens == seq.num_tokens:  # last chunk: predict a token
                    ready.append(seq)
                    rows.append(row[None])
        if ready:
            samples = self._sample(ready, torch.cat(rows) if len(rows) > 1 else rows[0])
            for seq, sampled in zip(ready, samples, strict=True):
                seq.append(sampled.token_id)
                outputs.append(self._advance(seq, [sampled], 0))
        return outputs

    def _num_tokens_left(self, seq: Sequence) -> int:
        """How many more tokens `seq` may emit before max_new_tokens or max_model_len."""
        num_generated = seq.num_tokens - seq.num_prompt_tokens
        return min(seq.params.max_new_tokens - num_generated, self.max_model_len - seq.num_tokens)

    def _propose(self, seq: Sequence, max_tokens: int) -> list[int]:
        # One token is always emitted, so a draft of k can yield k + 1.
        limit = min(max_tokens, self._num_tokens_left(seq) - 1)
        if self.track_block_boundaries:  # the step computes 1 + draft tokens: stop at the edge
            block_size = self.runner.layout.block_size_tokens
            edge = (seq.num_computed_tokens // block_size + 1) * block_size
            limit = min(limit, edge - seq.num_computed_tokens - 1)
        num_seqs = len(self.scheduler.running)  # an upper bound on those decoding
        if num_seqs > self.spec_decode.max_batch_size:
            return []
        # Last step's drafters: who will likely share this step's score_drafts call.
        drafter = self._drafters[seq.seq_id]
        return drafter.propose(seq.token_ids, limit, num_seqs, self._num_drafted + 1)

    def _verify(self, seq: Sequence, score: DraftScore) -> StepOutput:
        draft = score.draft_token_ids
        samples = verify_lookup_draft(
            draft,
            score.logits,
            seq.params,
            seq.generator,
            self._num_tokens_left(seq),
            self._eos_for(seq.params),
        )
        self.runner.accept_draft(seq, score, [s.token_id for s in samples])
        self.scheduler.trim(seq)
        return self._advance(seq, samples, len(draft), num_accepted(draft, samples))

    def _eos_for(self, params: SamplingParams) -> frozenset[int]:
        return frozenset() if params.ignore_eos else self.eos_token_ids

    def _is_stop(self, token_id: int, params: SamplingParams) -> bool:
        return token_id in params.stop_token_ids or token_id in self._eos_for(params)

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor) -> list[SampleOutput]:
        # Greedy without logprobs: one argmax over the batch (batch 32: 0.26 ms, the per-row
        # sampler 0.42 ms).
        if all(s.params.is_greedy and s.params.num_logprobs is None for s in seqs):
            return [SampleOutput(t) for t in logits.argmax(-1).tolist()]
        return sample(logits, [s.params for s in seqs], [s.generator for s in seqs])

    def _advance(
        self,
        seq: Sequence,
        samples: list[SampleOutput],
        num_draft_tokens: int,
        num_accepted: int = 0,
    ) -> StepOutput:
        """`samples` are already appended to `seq`; only the last can end it."""
        self._note_boundary(seq)
        drafter = self._drafters[seq.seq_id]
        drafter.length.record(num_draft_tokens, num_accepted)
        drafter.stats.add(num_draft_tokens, num_accepted, len(samples))
        self.spec_stats.add(num_draft_tokens, num_accepted, len(samples))
        last = samples[-1].token_id
        reason = None
        if self._is_stop(last, seq.params):
            reason = FinishReason.STOP
        elif self._num_tokens_left(seq) <= 0:
            reason = FinishReason.LENGTH
        stats = None
        if reason is not None:
            if self.on_finish is not None:
                self.on_finish(seq, reason)
            del self._seqs[seq.seq_id]
            stats = self._drafters.pop(seq.seq_id).stats
            self.scheduler.remove(seq)
        token_ids = tuple(s.token_id for s in samples)
        return StepOutput(seq.seq_id, token_ids, reason is not None, reason, tuple(samples), stats)

    def generate(
        self,
        prompts: Seq[Seq[int]],
        params: SamplingParams | Seq[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run `prompts` to completion (alongside any requests already queued)."""
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        seq_ids = [self.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
        tokens: dict[int, list[int]] = {i: [] for i in seq_ids}
        finished: dict[int, StepOutput] = {}
        while len(finished) < len(seq_ids):
            for out in self.step():
                if out.seq_id in tokens:
                    tokens[out.seq_id].extend(out.new_token_ids)
                    if out.finished:
                        finished[out.seq_id] = out
        return [
            RequestOutput(i, list(p), tokens[i], finished[i].finish_reason, finished[i].spec_stats)
            for i, p in zip(seq_ids, prompts, strict=True)
        ]
