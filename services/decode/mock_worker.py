"""The mock decode worker (`--engine mock`): the real worker's endpoints, streams, store writes
and usage over `worker.mock_engine.MockEngine` (docs/request-flow.md).

`DecodeJob`: admit if the engine has the pages the request can grow to free (prompt +
max_tokens: what MockEngine holds, so it never preempts), reserve them in the engine (its
allocator's count of free pages is the one the heartbeats report), answer `JobAccepted`.
`SuffixReady`: nothing to pull (mock prefill stages no bytes, and leaves the last prompt
token to decode: it samples no first token); the sequence joins the engine with the prompt's
whole blocks up to token n - 1 counted as cached, so the engine charges their load and the
short tail, not the prefill the prefill worker already simulated.

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

from collections.abc import Sequence

from tokenizers import Tokenizer

from services.decode.config import DecodeConfig
from services.decode.finish import Finisher
from services.decode.jobs import DecodeJobsBase
from services.decode.state import STREAM_FINISH_REASONS, DecodeRequest, Finished
from shared.blocks import num_blocks_before_last
from shared.bus import Bus
from shared.schema import BadRequest, SamplingParams, SuffixReady
from worker.mock_engine import (
    FinishReason,
    MockEngine,
    MockModel,
    MockRequestError,
    MockSamplingParams,
    MockStepOutput,
    sleep_simulated,
)


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
            bus,
            engine,
            tokenizer,
            finisher,
            model_name=model.name,
            max_model_len=model.max_model_len,
            block_size_tokens=engine.config.block_size_tokens,
            retry_after_s=config.retry_after_s,
            suffix_timeout_s=config.suffix_timeout_s,
        )
        self.config = config
        self.model = model
        # request id -> pages reserved in the engine at admission, until the request joins it
        self._reserved: dict[str, list[int]] = {}
        self._payload = bytes(config.mock_block_nbytes)
        self.counts.metrics.gauge_from(
            "kvfabric_decode_mock_clock_seconds",
            "The mock engine's simulated time so far.",
            lambda: engine.clock_s,
        )

    def kv_pages(self) -> tuple[int, int]:
        """The engine's count: reservations of admitted requests and running sequences."""
        return self.engine.config.num_kv_pages, self.engine.num_kv_pages_free

    # -- DecodeJob, SuffixReady -----------------------------------------------------------
    def _pages_to_admit(self, num_prompt_tokens: int, sampling: SamplingParams) -> int:
        """All the request can grow to: MockEngine holds that much, so it never preempts."""
        return self.engine.pages_needed(num_prompt_tokens, sampling.max_tokens)

    def _sampling_params(self, sampling: SamplingParams) -> MockSamplingParams:
        eos = () if sampling.ignore_eos else self.model.eos_token_ids
        return MockSamplingParams(
            max_new_tokens=sampling.max_tokens,
            stop_token_ids=(*sampling.stop_token_ids, *eos),
            seed=sampling.seed,
        )

    def _admit(self, state: DecodeRequest, num_pages: int) -> None:
        """Reserve the pages in the engine now, so its count (and our heartbeats) hold them
        while prefill runs. `handle_job` checked they are free; nothing ran in between."""
        pages = self.engine.reserve_pages(num_pages)
        if pages is None:
            raise RuntimeError(f"{num_pages} pages were free a moment ago")
        self._reserved[state.request_id] = pages

    async def _join(self, state: DecodeRequest, ready: SuffixReady) -> int:
        """Nothing to pull: the prompt's whole blocks up to n - 1 count as cached."""
        if ready.first_token_id is not None:
            raise BadRequest("the mock decode worker computes the first token itself")
        state.prefill = ready.timings
        state.num_cached_tokens = ready.first_block_index * self.block_size
        num_ready = state.blocks.num_prefill_blocks * self.block_size
        try:
            seq_id = self.engine.add_request(
                state.token_ids,
                state.params,
                num_cached_tokens=num_ready,
                has_swa_snapshot=True,
                blocks=state.blocks,
                pages=self._reserved[state.request_id],
            )
        except MockRequestError as exc:
            raise BadRequest(str(exc)) from exc
        del self._reserved[state.request_id]  # the engine's sequence holds them now
        return seq_id

    # -- cancellation, the batch loop ---------------------------------------------------
    async def _abort_seq(self, seq_id: int) -> None:
        self.engine.abort(seq_id)  # pure bookkeeping: no step runs meanwhile, no lock

    async def _release(self, state: DecodeRequest) -> None:
        pages = self._reserved.pop(state.request_id, None)
        if pages is not None:  # never joined: the reservation is ours to give back
            self.engine.release_pages(pages)

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
        before it) to the last complete one computed (the last sampled token's KV is not).
        The engine freed the sequence's pages in the step that finished it."""
        # A finished output always carries its reason; STOP only satisfies the type.
        reason = out.finish_reason or FinishReason.STOP
        token_ids = state.token_ids + state.output_ids
        first = state.blocks.num_prefill_blocks
        end = num_blocks_before_last(len(token_ids), self.block_size)
        blocks = [(i, self._payload) for i in range(first, end)]
        return Finished(
            "stop" if stopped_by_string else STREAM_FINISH_REASONS[reason],
            token_ids,
            blocks,
            boundary_snapshot=None,
        )
