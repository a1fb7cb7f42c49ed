"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds, stop ids, logprobs.

Order of the filters is temperature -> top-k -> top-p, as vLLM applies them. Each request
owns a torch.Generator made from its seed, so its draws do not depend on which other
requests share the batch; the same seed gives the same tokens.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from worker.engine.errors import SamplingParamsError

# Temperatures below this are greedy (their limit): dividing logits by 1e-304 overflows them
# to infinities, whose softmax is NaN (found by fuzzing the HTTP API). vLLM draws the same line.
GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 (or below GREEDY_BELOW) means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k filter
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    max_new_tokens: int = 16
    # None: no logprobs; 0: the sampled token's; k > 0: also the k most likely tokens'.
    num_logprobs: int | None = None
    ignore_eos: bool = False  # generate through end-of-sequence tokens (benchmarks, tests)

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise SamplingParamsError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise SamplingParamsError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise SamplingParamsError(f"top_k must be >= 0, got {self.top_k}")
        if self.max_new_tokens < 0:
            raise SamplingParamsError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if self.num_logprobs is not None and self.num_logprobs < 0:
            raise SamplingParamsError(f"num_logprobs must be >= 0, got {self.num_logprobs}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


@dataclass(frozen=True)
class SampleOutput:
    token_id: int
    # Under the model's raw distribution (temperature 1, no filters), as vLLM reports them.
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] | None = None


def make_generator(seed: int | None) -> torch.Generator:
    generator = torch.Generator()
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)  # torch takes 64 bits; any int maps
    return generator


def generator_state(generator: torch.Generator | None) -> bytes:
    """A generator's state as bytes (b"" for none: greedy), to resume its draws elsewhere."""
    return b"" if generator is None else generator.get_state().numpy().tobytes()


def generator_from_state(state: bytes) -> torch.Generator:
    """The generator `generator_state` saved, ready for the next draw."""
    generator = torch.Generator()
    generator.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))
    return generator


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution tokens are drawn from, [..., vocab]; one-hot argmax when greedy."""
    logits = logits.float()
    if params.is_greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        # Keep the smallest head whose mass reaches top_p; the first token always stays.
        keep_sorted = mass_before < params.top_p
        # Even where top_p is below float32's smallest number (it compares as 0 there).
        keep_sorted[..., 0] = True
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        probs = probs * keep
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample_one(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> SampleOutput:
    """logits: [vocab] for one request."""
    if params.is_greedy:
        token_id = int(logits.argmax())
    else:
        probs = target_probs(logits, params)
        token_id = int(torch.multinomial(probs, 1, generator=generator))
    if params.num_logprobs is None:
        return SampleOutput(token_id)
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    top = ()
    if params.num_logprobs:
        values, ids = torch.topk(logprobs, params.num_logprobs)
        top = tuple(zip(ids.tolist(), values.tolist(), strict=True))
    return SampleOutput(token_id, float(logprobs[token_id]), top)


def sample(
    logits: torch.Tensor, params: Seq[SamplingParams], generators: Seq[torch.Generator | None]
) -> list[SampleOutput]:
    """logits: [batch, vocab]; one params and one generator per row."""
    return [sample_one(row, p, g) for row, p, g in zip(logits, params, generators, strict=True)]


def is_stop(token_id: int, params: SamplingParams, eos_token_ids: Seq[int] = ()) -> bool:
    return token_id in params.stop_token_ids or token_id in eos_token_ids
