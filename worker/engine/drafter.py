"""Prompt-lookup drafts for speculative decoding, with a per-request adaptive draft length.

A coding agent re-emits code it has seen (the file it edits, a function it calls), so the
draft is copied from the request's own context: find the most recent earlier occurrence of
the longest n-gram (max_ngram down to min_ngram) that ends the sequence, and propose the
tokens that followed it. No draft model, no extra forward pass.

- `PromptLookup` keeps an index n-gram -> end of its most recent occurrence, extended as
  tokens append: O(max_ngram - min_ngram + 1) dict writes per token, so a request of T
  tokens costs O(T) in total, never a rescan per step (which would be O(T^2)).
- `DraftLength` picks each step's draft length from the request's recent acceptance: an EMA
  over verifications of the per-token acceptance probability `a`, and a cost model
  (`SpecDecodeConfig`) of what k draft tokens add to the step of a batch of b sequences; k
  tokens yield (1 - a^(k+1)) / (1 - a) tokens on average. It proposes the k that gives
  the batch the most tokens per unit of time, 0 (plain decode) when no k beats plain
  decode, so a request whose drafts keep failing pays almost nothing; a probe of one token
  every `probe_interval_steps` steps lets it notice when copying starts again.
- `verify_lookup_draft` checks a draft against the target's logits in one pass.
- `SpecStats` counts what was proposed and accepted, per request and engine-wide.
"""

from __future__ import annotations

from collections.abc import Collection
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from worker.engine.errors import EngineError
from worker.engine.sampler import SampleOutput, SamplingParams, sample_one


class SpecDecodeConfigError(EngineError):
    """A speculative-decoding setting is out of range."""


@dataclass(frozen=True)
class SpecDecodeConfig:
    enabled: bool = True
    # Draft only while at most this many sequences decode. On this CPU, scoring drafts beside
    # a decode of 8 costs a second forward's fixed overhead and lost more than it saved
    # (bench_engine with tiny-coder: 1.94x over transformers at batch 1 with drafts, 0.99x
    # at 8 and 0.84x at 32 against 1.05-1.26x without; bench_spec_decode: 0.79x at 8).
    # A batched multi-token decode path would lift this.
    max_batch_size: int = 4
    min_ngram: int = 2  # 1-grams of BPE code tokens ("(", ".") match almost anywhere
    max_ngram: int = 6
    max_draft_tokens: int = 16
    # Cost model, in units of one decode step of a lone sequence. A decode step of b
    # sequences costs D(b) = 1 + decode_cost_per_seq * (b - 1). Drafting k tokens adds:
    #   alone (b = 1): verify_overhead + draft_token_cost * k (score_drafts replaces decode)
    #   in a batch: extra_forward_cost / n + verify_cost_per_seq + draft_token_cost * k, the
    #   score_drafts call runs beside the decode call, shared by the n sequences drafting.
    # Measured with tiny-coder (CPU, 1 thread; loadtest/bench_spec_decode.py): decode 7-8 ms
    # at b = 1, 14-19 ms at b = 5-8; score_drafts of 1.4 sequences 14.7 ms beside a decode
    # of 5 (a whole forward's fixed cost, ~10 ms of per-layer op overhead; the calibrated
    # 1.2 still let batch 8 draft at a loss, hence 2.0); scoring 1 + k tokens alone 1.15-1.7
    # + 0.03-0.06 k decode steps. A batch then drafts for one sequence only above ~0.98
    # estimated acceptance, for all 8 above ~0.85; alone above ~0.4.
    # A GPU (or a batched score path) wants other numbers.
    decode_cost_per_seq: float = 0.12
    verify_overhead: float = 0.4
    extra_forward_cost: float = 2.0
    verify_cost_per_seq: float = 0.35
    draft_token_cost: float = 0.04
    prior_acceptance: float = 0.7  # a new request drafts ~5 tokens even at batch 8
    ema_decay: float = 0.5  # weight of the history per verification (~2 of memory)
    probe_interval_steps: int = 4

    def __post_init__(self) -> None:
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise SpecDecodeConfigError(
                f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram}, {self.max_ngram}"
            )
        if self.max_draft_tokens < 0:
            raise SpecDecodeConfigError(
                f"max_draft_tokens must be >= 0, got {self.max_draft_tokens}"
            )
        costs = (
            self.decode_cost_per_seq,
            self.verify_overhead,
            self.extra_forward_cost,
            self.verify_cost_per_seq,
            self.draft_token_cost,
        )
        if min(costs) < 0:
            raise SpecDecodeConfigError(f"cost model terms must be >= 0, got {costs}")
        if not 0 <= self.prior_acceptance <= 1 or not 0 <= self.ema_decay < 1:
            raise SpecDecodeConfigError(
                f"need prior_acceptance in [0, 1] and ema_decay in [0, 1), got "
                f"{self.prior_acceptance}, {self.ema_decay}"
            )
        if self.probe_interval_steps <= 0:
            raise SpecDecodeConfigError(
                f"probe_interval_steps must be positive, got {self.probe_interval_steps}"
            )


class PromptLookup:
    """Incremental n-gram index over one request's tokens (prompt + output so far)."""

    def __init__(self, min_ngram: int, max_ngram: int) -> None:
        self.min_ngram = min_ngram
        self.max_ngram = max_ngram
        # n-gram -> index just past its most recent occurrence that is not the sequence's
        # suffix; keys of different n differ in length, so one dict holds every n.
        self._next_index: dict[tuple[int, ...], int] = {}
        self._num_indexed = 0  # n-grams ending before this index are in the dict

    def _index_up_to(self, token_ids: list[int], end: int) -> None:
        for stop in range(self._num_indexed + 1, end + 1):
            for n in range(self.min_ngram, min(self.max_ngram, stop) + 1):
                self._next_index[tuple(token_ids[stop - n : stop])] = stop
        self._num_indexed = max(self._num_indexed, end)

    def propose(self, token_ids: list[int], max_tokens: int) -> list[int]:
        """Up to `max_tokens` tokens that followed the longest, most recent suffix match."""
        num_tokens = len(token_ids)
        # Everything but the final n-grams: those are the query, not a match of themselves.
        self._index_up_to(token_ids, num_tokens - 1)
        if max_tokens <= 0:
            return []
        for n in range(min(self.max_ngram, num_tokens - 1), self.min_ngram - 1, -1):
            start = self._next_index.get(tuple(token_ids[num_tokens - n :]))
            if start is None:
                continue
            # Copy forward from the match; past the sequence's end keep copying from the
            # draft itself, so a repeating pattern yields a full-length draft.
            draft: list[int] = []
            for j in range(max_tokens):
                i = start + j
                draft.append(token_ids[i] if i < num_tokens else draft[i - num_tokens])
            return draft
        return []


def expected_tokens(acceptance: float, num_draft_tokens: int) -> float:
    """Mean tokens one verification emits: accepted prefix + the one sampled token."""
    if acceptance >= 1.0:
        return float(num_draft_tokens + 1)
    return (1.0 - acceptance ** (num_draft_tokens + 1)) / (1.0 - acceptance)


class DraftLength:
    """Per-request draft length from an EMA of its per-token acceptance.

    Each verification gives one estimate, accepted / decided draft tokens (the first
    rejection is the only failure; tokens after it were never tried), and the EMA weighs
    verifications alike: after a fully accepted run of 16, a draft rejected at its first
    token takes the estimate from 1.0 to 0.7 (k 16 -> 9 with the default costs), three in a
    row to 0.34 (k 1), six to 0.12 (k 0). Weighing by tokens instead would let one long run
    outvote a dozen failures.
    """

    def __init__(self, config: SpecDecodeConfig) -> None:
        self.config = config
        self.acceptance = config.prior_acceptance
        self._num_idle_steps = 0
        self._memo: tuple[tuple[float, int, int, int], int] | None = None

    def best_length(self, max_tokens: int, num_seqs: int = 1, num_sharing: int = 1) -> int:
        """The k in 0..max_tokens that gives a batch of `num_seqs` decoding sequences the
        most tokens per unit of time (the others taken to emit one token each), the
        score_drafts call being shared by `num_sharing` drafting sequences."""
        key = (self.acceptance, max_tokens, num_seqs, num_sharing)
        if self._memo is not None and self._memo[0] == key:
            return self._memo[1]  # unchanged since the last step: skip the scan
        cfg = self.config
        decode_cost = 1 + cfg.decode_cost_per_seq * (num_seqs - 1)
        if num_seqs == 1:
            fixed = cfg.verify_overhead
        else:
            fixed = cfg.extra_forward_cost / max(num_sharing, 1) + cfg.verify_cost_per_seq
        best_k, best_rate = 0, num_seqs / decode_cost
        for k in range(1, max_tokens + 1):
            num_tokens = num_seqs - 1 + expected_tokens(self.acceptance, k)
            rate = num_tokens / (decode_cost + fixed + cfg.draft_token_cost * k)
            if rate > best_rate:
                best_k, best_rate = k, rate
        self._memo = (key, best_k)
        return best_k

    def next_length(self, max_tokens: int, num_seqs: int = 1, num_sharing: int = 1) -> int:
        """Draft length for this step; 1 every `probe_interval_steps` idle steps."""
        max_tokens = min(max_tokens, self.config.max_draft_tokens)
        k = self.best_length(max_tokens, num_seqs, num_sharing)
        if k == 0 and max_tokens > 0:
            self._num_idle_steps += 1
            if self._num_idle_steps >= self.config.probe_interval_steps:
                self._num_idle_steps = 0
                return 1
        return k

    def record(self, num_proposed: int, num_accepted: int) -> None:
        """One verification of `num_proposed` draft tokens."""
        if num_proposed == 0:
            return
        num_decided = num_accepted + (1 if num_accepted < num_proposed else 0)
        decay = self.config.ema_decay
        self.acceptance = decay * self.acceptance + (1 - decay) * num_accepted / num_decided
        self._num_idle_steps = 0


def verify_lookup_draft(
    draft_token_ids: Seq[int],
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
    max_tokens: int,
    eos_token_ids: Collection[int] = (),
) -> list[SampleOutput]:
    """Sample row by row as plain decode would; go on while the sample equals the draft.

    `logits`: [len(draft) + 1, vocab]. Stops after the first disagreement (that sample is the
    correction), after a stop or eos id, after `max_tokens` samples, or after the bonus row.

    For a deterministic draft x (q one-hot) this is the rejection rule of speculative.py:
    x is accepted with probability p(x), and on rejection the emitted token is p without x,
    normalised, which is max(0, p - q) normalised; every emitted token follows p. Unlike
    `verify_sampled` (one uniform per draft token, then a residual draw) it draws from the
    generator exactly what plain decode draws, one `sample_one` per emitted token, so a
    seeded request gives the same tokens with speculation on or off and whatever its batch
    neighbours, though its draft lengths depend on the step's budget and free blocks.
    Greedy: the longest agreeing prefix + one argmax token, as `verify_greedy`.
    """
    fast = params.is_greedy and params.num_logprobs is None
    best = logits.argmax(-1).tolist() if fast else None
    samples: list[SampleOutput] = []
    for i in range(len(draft_token_ids) + 1):
        if best is not None:
            sampled = SampleOutput(best[i])
        else:
            sampled = sample_one(logits[i], params, generator)
        samples.append(sampled)
        token_id = sampled.token_id
        if (
            i == len(draft_token_ids)
            or token_id != draft_token_ids[i]
            or token_id in params.stop_token_ids
            or token_id in eos_token_ids
            or len(samples) >= max_tokens
        ):
            break
    return samples


def num_accepted(draft_token_ids: Seq[int], samples: Seq[SampleOutput]) -> int:
    """Draft tokens the samples agree with, from the start."""
    count = 0
    for sampled, token_id in zip(samples, draft_token_ids, strict=False):
        if sampled.token_id != token_id:
            break
        count += 1
    return count


@dataclass
class SpecStats:
    """Counters of one request, or summed over the engine."""

    num_drafts: int = 0  # verifications with a non-empty draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_forwards: int = 0  # sequence-steps that emitted tokens (prefill's last chunk too)
    num_emitted_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def tokens_per_forward(self) -> float:
        return self.num_emitted_tokens / self.num_forwards if self.num_forwards else 0.0

    def add(self, num_draft_tokens: int, num_accepted: int, num_emitted: int) -> None:
        self.num_drafts += 1 if num_draft_tokens else 0
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        self.num_forwards += 1
        self.num_emitted_tokens += num_emitted


class RequestDrafter:
    """What the engine keeps per request: the lookup index, the length policy, counters."""

    def __init__(self, config: SpecDecodeConfig) -> None:
        self.lookup = PromptLookup(config.min_ngram, config.max_ngram)
        self.length = DraftLength(config)
        self.stats = SpecStats()

    def propose(
        self, token_ids: list[int], max_tokens: int, num_seqs: int = 1, num_sharing: int = 1
    ) -> list[int]:
        """A draft for this step (see `DraftLength.best_length` for the batch terms)."""
        num_tokens = self.length.next_length(max_tokens, num_seqs, num_sharing)
        if num_tokens == 0:
            return []
        return self.lookup.propose(token_ids, num_tokens)
