"""A vllm-worker's requests: the router's `DecodeJob` in, vLLM's tokens out on the request's
stream, usage into the durable outbox -- the same messages as a decode worker's, over a vLLM
engine that prefills and decodes the job itself (an aggregated worker: no prefill job, no
KV handoff).

Per job: the same checks as a decode worker (`checked_prompt`: model, block size, chain,
room to generate), then a task streams the completion from vLLM's HTTP API
(vllm_client.py), handing the connector the prompt's chain and the router's kv-index match
in `kv_transfer_params` (it neither hashes the prompt nor asks kv-index again), and sends
each step's ids with their text (our detokenizer, so text and stop strings behave as on
kvfabric's engine; a matched stop string closes vLLM's stream). Cancellation
(`CancelRequest`), the request's deadline and a worker shutdown cancel the task: the closed
HTTP stream makes vLLM abort the request and free its blocks. The final chunk carries the
usage vLLM reports (cached tokens: its own prefix cache plus what the connector loaded from
the store); a request that ends without vLLM's usage (cancelled, failed) is billed with the
prompt tokens the router found cached. Every request accepted leaves one usage record,
published as decode's (`usage.decode`): billing takes the engine's own count over the
caller's estimate. The request's state, its cancel and deadline, the final chunk and the usage
record are decode's own (worker/serving/lifecycle.py): one life for every streamed request.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import aiohttp
from opentelemetry.trace import StatusCode
from tokenizers import Tokenizer

from services.vllm_worker.config import VllmWorkerConfig
from services.vllm_worker.connector.params import RoutedPrefix, to_kv_transfer_params
from services.vllm_worker.metrics import VllmWorkerMetrics
from services.vllm_worker.vllm_client import VllmClient, VllmError, completion_body
from shared import telemetry
from shared.bus import Bus, Context
from shared.logging import get_logger
from shared.metrics import tier_label
from shared.schema import (
    BadRequest,
    CancelRequest,
    DecodeJob,
    InternalError,
    JobAccepted,
    Overloaded,
    Unavailable,
)
from shared.streams import StreamWriter
from shared.usage_outbox import UsageOutbox
from worker.serving.checks import checked_prompt
from worker.serving.lifecycle import (
    StreamedRequest,
    end_request,
    send_tokens,
    stream_detokenizer,
)

log = get_logger(__name__)


def routed_prefix(job: DecodeJob) -> dict[str, str]:
    """The prompt's chain and the router's kv-index match, as `kv_transfer_params`: with them
    the connector neither hashes the prompt nor asks kv-index again."""
    prefix = RoutedPrefix(block_hashes=job.request.block_hashes, cached_blocks=job.cached_blocks)
    return to_kv_transfer_params(prefix)


@dataclass(eq=False)
class VllmRequest(StreamedRequest):
    num_vllm_cached_tokens: int | None = None  # vLLM's count, from its usage
    finish_reason: str | None = None
    # The ids and text of the step a stop string ended: they go in the final chunk.
    held: tuple[list[int], str] = ([], "")
    task: asyncio.Task[None] | None = None

    @property
    def cached_tokens(self) -> int:
        """vLLM's count when it gave one, else what the router found on the store."""
        if self.num_vllm_cached_tokens is not None:
            return self.num_vllm_cached_tokens
        return self.job.decision.num_cached_tokens


class VllmWorker:
    def __init__(
        self,
        bus: Bus,
        client: VllmClient,
        tokenizer: Tokenizer,
        outbox: UsageOutbox,
        config: VllmWorkerConfig,
        metrics: VllmWorkerMetrics,
    ) -> None:
        self.bus = bus
        self.client = client
        self.tokenizer = tokenizer
        self.outbox = outbox
        self.config = config
        self.counts = metrics
        self.model_name = config.model_name
        self.requests: dict[str, VllmRequest] = {}
        self.num_kv_pages_total = 0  # vLLM's KV blocks, from its /metrics
        self.kv_cache_usage = 0.0

    # -- load ----------------------------------------------------------------------------
    async def poll_load(self) -> None:
        """vLLM's KV blocks in all and in use (periodic, like a heartbeat)."""
        load = await self.client.load()
        self.num_kv_pages_total = load.num_kv_blocks_total
        self.kv_cache_usage = load.kv_cache_usage

    def load_fields(self) -> dict[str, int | str]:
        waiting = [r for r in self.requests.values() if r.first_token_s is None]
        queued_tokens = sum(len(r.token_ids) - r.job.decision.num_cached_tokens for r in waiting)
        total = self.num_kv_pages_total
        used = round(total * self.kv_cache_usage)
        # What accepted requests not yet running will take (their prompt's pages at least).
        pending = sum(-(-len(r.token_ids) // self.config.kv_block_size_tokens) for r in waiting)
        return {
            "num_queued": len(waiting),
            "num_queued_tokens": queued_tokens,
            "num_running": len(self.requests) - len(waiting),
            "num_kv_pages_total": total,
            "num_kv_pages_free": max(total - used - pending, 0),
            "model": self.model_name,
            "num_devices": 1,
        }

    # -- DecodeJob -----------------------------------------------------------------------
    async def handle_job(self, job: DecodeJob, ctx: Context) -> JobAccepted:
        request = job.request
        token_ids, _ = checked_prompt(
            request,
            model_name=self.model_name,
            block_size_tokens=self.config.kv_block_size_tokens,
            max_model_len=self.config.max_model_len,
        )
        if not request.stream_inbox:
            raise BadRequest("stream_inbox is required")
        if request.request_id in self.requests:
            raise BadRequest(f"request {request.request_id} is already running here")
        sampling = request.sampling
        if sampling.logprobs:
            raise BadRequest("logprobs are not served by vllm-worker yet")
        if len(self.requests) >= self.config.max_num_seqs:
            raise Overloaded(
                f"{len(self.requests)} requests running (max_num_seqs {self.config.max_num_seqs})",
                retry_after_s=self.config.retry_after_s,
            )
        state = VllmRequest(
            job,
            token_ids,
            StreamWriter(self.bus, request.stream_inbox, request_id=request.request_id),
            stream_detokenizer(self.tokenizer, request, token_ids),
        )
        state.span = telemetry.current_span()
        self.requests[request.request_id] = state
        state.task = asyncio.create_task(self._run(state))
        return JobAccepted(request_id=request.request_id, instance_id=self.bus.instance_id)

    async def on_cancel(self, cancel: CancelRequest) -> None:
        state = self.requests.get(cancel.request_id)
        if state is None or state.task is None:
            return
        state.note_cancel(cancel)
        state.task.cancel()

    async def stop(self) -> None:
        for state in list(self.requests.values()):
            state.error = Unavailable("vllm worker stopping")
            if state.task is not None:
                state.task.cancel()
        await asyncio.gather(
            *(s.task for s in list(self.requests.values()) if s.task), return_exceptions=True
        )

    # -- one request ---------------------------------------------------------------------
    async def _run(self, state: VllmRequest) -> None:
        generate = telemetry.child_span(state.span, "vllm generate")
        try:
            async with asyncio.timeout(state.seconds_left()):
                await self._stream(state)
        except TimeoutError:
            state.expire("generating")
        except asyncio.CancelledError:  # cancelled or stopping: the state says why
            log.debug(
                "vllm request cancelled",
                request_id=state.request_id,
                reason=state.cancel_reason,
                error=str(state.error),
            )
        except VllmError as exc:
            log.warning("vLLM failed the request", request_id=state.request_id, error=str(exc))
            state.error = (
                BadRequest(str(exc)) if exc.status == 400 else InternalError("vLLM failed")
            )
        except (aiohttp.ClientError, ConnectionError) as exc:
            log.warning("vLLM unreachable", request_id=state.request_id, error=repr(exc))
            state.error = Unavailable("the vLLM engine is unreachable")
        except Exception:
            log.exception("vllm request failed", request_id=state.request_id)
            state.error = InternalError("generation failed")
        finally:
            if generate.is_recording():
                generate.set_attributes(
                    {
                        "kvfabric.num_output_tokens": len(state.output_ids),
                        "kvfabric.hit_tokens": state.cached_tokens,
                    }
                )
                if state.error is not None:
                    generate.set_status(StatusCode.ERROR, state.error.message)
            generate.end()
            self.requests.pop(state.request_id, None)
            # Shielded: a shutdown's cancel must not cut the final chunk or the usage record.
            await asyncio.shield(self._finish(state))

    async def _stream(self, state: VllmRequest) -> None:
        request = state.job.request
        body = completion_body(
            self.model_name,
            state.token_ids,
            request.sampling,
            request_id=request.request_id,
            cache_salt=request.cache_salt,
            # Nothing reads them without the connector.
            kv_transfer_params=routed_prefix(state.job) if self.config.connector else None,
        )
        async for delta in self.client.generate(body):
            if delta.num_cached_tokens is not None:
                state.num_vllm_cached_tokens = delta.num_cached_tokens
            if delta.finish_reason is not None:
                state.finish_reason = delta.finish_reason
            if not delta.token_ids:
                continue
            ids = list(delta.token_ids)
            first = state.first_token_s is None
            text = state.record_output(ids)
            if first:
                self.counts.ttft_seconds.observe(state.first_token_s - state.accepted_s)
            if state.detokenizer.stopped:
                state.finish_reason = "stop"
                state.held = (ids, text)
                return  # leaving the `async with` closes the stream: vLLM aborts it
            await send_tokens(state, ids, text)

    async def _finish(self, state: VllmRequest) -> None:
        with telemetry.span("vllm finish", parent=state.span):
            await self._end(state)

    async def _end(self, state: VllmRequest) -> None:
        last_ids, last_text = state.held
        # Up to what the router found on the store, the store's tier; beyond it, vLLM's own
        # prefix cache (device memory).
        stored = min(state.cached_tokens, state.job.decision.num_cached_tokens)
        hits = {
            tier_label(state.job.cached_blocks.tier): stored,
            "device": state.cached_tokens - stored,
        }
        await end_request(
            state,
            state.finish_reason,
            outbox=self.outbox,
            counts=self.counts,
            hit_tokens=hits,
            decode_worker_id=self.bus.instance_id,
            prefill_worker_id=self.bus.instance_id,
            last_token_ids=last_ids,
            last_text=last_text,
        )
