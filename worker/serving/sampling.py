"""A request's sampling parameters as the engine takes them, for the two workers that
sample: prefill (the first output token, from the last prompt token's logits) and decode
(every later one). One mapping, so both refuse the same parameters in the same words."""

from __future__ import annotations

from shared.schema import BadRequest, SamplingParams
from worker.engine.sampler import SamplingParams as EngineSampling
from worker.engine.sampler import SamplingParamsError


def engine_sampling(sampling: SamplingParams) -> EngineSampling:
    """`BadRequest` for parameters the engine cannot honour (a negative temperature...)."""
    try:
        return EngineSampling(
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k or 0,
            seed=sampling.seed,
            max_new_tokens=sampling.max_tokens,
            stop_token_ids=tuple(sampling.stop_token_ids),
            ignore_eos=sampling.ignore_eos,
        )
    except SamplingParamsError as exc:
        raise BadRequest(str(exc)) from exc
