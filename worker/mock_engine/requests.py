"""The mock engine's request-side types: params, outputs, usage, and its fake tokens.

Shaped like `worker.engine`'s (`SamplingParams`, `StepOutput`; `FinishReason` is the model
engine's own, from its torch-free `outputs` module) so a service handles both engines alike,
without importing torch (2 s) for a mock.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Protocol

import xxhash

from shared.schema.tokens import pack_token_ids
from worker.engine.outputs import FinishReason


class MockRequestError(ValueError):
    """A request the mock cannot serve: empty, too long, a cached prefix that is not whole
    blocks of the prompt, a block layout of another block size, or more pages than the
    engine has."""


class SamplingLike(Protocol):
    """What the mock reads of a request's params (worker.engine SamplingParams has it)."""

    @property
    def max_new_tokens(self) -> int: ...
    @property
    def stop_token_ids(self) -> tuple[int, ...]: ...
    @property
    def seed(self) -> int | None: ...


@dataclass(frozen=True)
class MockSamplingParams:
    max_new_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None


@dataclass(frozen=True)
class MockUsage:
    """What the request is billed for, named as in `UsageRecord`."""

    num_cache_hit_tokens: int
    num_cache_miss_tokens: int
    num_output_tokens: int


@dataclass(frozen=True)
class MockStepOutput:
    """`worker.engine.StepOutput`'s fields, plus the blocks computed and the final usage."""

    seq_id: int
    new_token_ids: tuple[int, ...]
    finished: bool
    finish_reason: FinishReason | None = None
    new_samples: tuple[()] = ()
    new_block_hashes: tuple[int, ...] = ()  # complete blocks computed this step, in order
    usage: MockUsage | None = None  # on the finishing output
    spec_stats: None = None  # the real engine's draft counters; the mock never drafts


def fake_tokens(
    prompt_token_ids: Seq[int], num_tokens: int, seed: int, vocab_size: int
) -> list[int]:
    """The mock's output for a prompt: token k = XXH3-64(prompt digest, k) mod vocab_size."""
    digest = prompt_digest(prompt_token_ids, seed)
    return [fake_token(digest, k, seed, vocab_size) for k in range(num_tokens)]


def prompt_digest(prompt_token_ids: Seq[int], seed: int) -> int:
    return xxhash.xxh3_64_intdigest(pack_token_ids(prompt_token_ids), seed=seed)


def fake_token(digest: int, k: int, seed: int, vocab_size: int) -> int:
    key = digest.to_bytes(8, "little") + k.to_bytes(4, "little")
    return xxhash.xxh3_64_intdigest(key, seed=seed) % vocab_size
