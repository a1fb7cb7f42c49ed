"""The mock decode worker (`--engine mock`): the real worker's endpoints, streams, store writes
and usage over shared.testing's MockEngine (docs/request-flow.md; shared/serving/mock.py).

`DecodeJob`: admit if the simulated pool has the pages the request can grow to (prompt +
max_tokens: what MockEngine reserves, so it never preempts), answer `JobAccepted`.
`SuffixReady`: nothing to pull (mock prefill stages no bytes); the sequence joins the engine
with the prompt's whole blocks up to token n - 1 counted as cached, so the engine charges
their load and the short tail, not the prefill the prefill worker already simulated.

The batch loop runs `MockEngine.step` on the event loop (pure bookkeeping: no thread and no
engine lock, unlike the model's) and sleeps the step's simulated duration before its tokens
go out, so a token leaves when the simulated step that made it ends. Tokens are the mock's
deterministic fake ids (`fake_tokens`), detokenized with the model's tokenizer so stop
strings behave as on the model. Endings go through the real `Finisher`: the complete blocks
(placeholder bytes) to the store and kv-index before the final chunk, then the `UsageRecord`
to JetStream -- completed, cancelled or failed, as on the model. Admission, cancellation,
deadlines and the stream's path are jobs.py's, shared with the model's worker.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from tokenizers import Tokenizer

from services.decode.config import DecodeConfig
from services.decode.finish import Finisher
from services.decode.jobs import DecodeJobsBase
from services.decode.state import DecodeRequest, Finished
from shared.bus import Bus
from shared.schema import BadRequest, SamplingParams, SuffixReady
from shared.serving.mock import MockModel, sleep_simulated
from shared.testing.mock_engine import (
    FinishReason,
    MockEngine,
    MockRequestError,
    MockSamplingParams,
    MockStepOutput,
)

_REASONS = {
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.ABORT: "cancelled",
}


class MockDecodeWorker(DecodeJobsBase[MockEngine, MockStepOutput]):
    def __init__(
        self,
        bus: Bus,
        engine: MockEngine,
        tokenizer: Tokenizer,
        finisher: Finisher,
        config: DecodeConfig,
        model: MockModel,
    ) -> None:
        super().__init__(
            bus, engine, tokenizer, finisher, model_name=model.name,
            max_model_len=model.max_model_len, block_size_tokens=engine.config.block_size_tokens,
            retry_after_s=config.retry_after_s, suffix_timeout_s=config.suffix_timeout_s,
        )  # fmt: skip
        self.config = config
        self.model = model
        self._pages: dict[str, int] = {}  # request id -> pages reserved when admitted
        self._payload = bytes(config.mock_block_nbytes)

    @property
    def num_kv_pages_free(self) -> int:
        return self.engine.config.num_kv_pages - sum(self._pages.values())

    def kv_pages(self) -> tuple[int, int]:
        return self.engine.config.num_kv_pages, self.num_kv_pages_free

    def counters(self) -> dict[str, float]:
        return self.finisher.counts | {"simulated_clock_s": round(self.engine.clock_s, 3)}

    # -- DecodeJob, SuffixReady -----------------------------------------------------------
    def _pages_to_admit(self, num_prompt_tokens: int, sampling: SamplingParams) -> int:
        """All the request can grow to: MockEngine reserves that much, so it never preempts."""
        max_len = min(num_prompt_tokens + sampling.max_tokens, self.model.max_model_len)
        return math.ceil(max_len / self.block_size)

    def _sampling_params(self, sampling: SamplingParams) -> MockSamplingParams:
        eos = () if sampling.ignore_eos else self.model.eos_token_ids
        return MockSamplingParams(
            max_new_tokens=sampling.max_tokens,
            stop_token_ids=(*sampling.stop_token_ids, *eos),
            seed=sampling.seed,
        )

    def _admit(self, state: DecodeRequest, num_pages: int) -> None:
        self._pages[state.request_id] = num_pages

    async def _join(self, state: DecodeRequest, ready: SuffixReady) -> int:
        """Nothing to pull: the prompt's whole blocks up to n - 1 count as cached."""
        state.prefill = ready.timings
        state.num_cached_tokens = ready.first_block_index * self.block_size
        num_ready = ready.num_computed_tokens // self.block_size * self.block_size
        try:
            return self.engine.add_request(
                state.token_ids, state.params, num_cached_tokens=num_ready, has_swa_snapshot=True
            )
        except MockRequestError as exc:
            raise BadRequest(str(exc)) from exc

    # -- cancellation, the batch loop ---------------------------------------------------
    async def _abort_seq(self, seq_id: int) -> None:
        self.engine.abort(seq_id)  # pure bookkeeping: no step runs meanwhile, no lock

    async def _release(self, state: DecodeRequest) -> None:
        self._pages.pop(state.request_id, None)

    async def _step(self) -> Sequence[MockStepOutput] | None:
        """Step, then sleep the step's simulated time, so its tokens leave when it ends."""
        outputs = self.engine.step()
        duration_s = self.engine.last_step_duration_s
        if not outputs and duration_s == 0:  # nothing can run until a request joins
            return None
        await sleep_simulated(duration_s, self.config.mock_speedup)
        return outputs

    def _take_finished(
        self, state: DecodeRequest, out: MockStepOutput, stopped_by_string: bool
    ) -> Finished:
        """Decode's blocks: from the one holding prompt token n - 1 (prefill wrote those
        before it) to the last complete one computed (the last sampled token's KV is not)."""
        self._pages.pop(state.request_id, None)
        # A finished output always carries its reason; STOP only satisfies the type.
        reason = "stop" if stopped_by_string else _REASONS[out.finish_reason or FinishReason.STOP]
        token_ids = state.token_ids + state.output_ids
        first = (state.num_prompt_tokens - 1) // self.block_size
        end = (len(token_ids) - 1) // self.block_size
        blocks = [(i, self._payload) for i in range(first, end)]
        return Finished(reason, token_ids, blocks, boundary_window=None)
