"""The end of a decode request: the store, swa-memcache, the stream's last chunk, usage.

Order matters: the finished sequence's complete blocks (prompt tail + output) are written
and logged for kv-index, its window at the last block boundary is put into swa-memcache,
and a heartbeat with its pages free goes out, all *before* the final chunk -- an agent's
next step follows the final chunk at once and must find its own answer cached and room for
it. Usage goes into the worker's durable outbox (shared.usage) just before the final chunk,
so a worker killed at any point has either not answered or kept the record; the outbox
publishes it to JetStream with the request id as message id until the log has it.
Each ending runs as its own task so the batch loop keeps stepping the other sequences.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from opentelemetry.trace import StatusCode

from services.decode.metrics import DecodeMetrics
from services.decode.state import DecodeRequest, Finished
from shared import telemetry
from shared.bus import Bus
from shared.logging import get_logger
from shared.metrics import Metrics, tier_label
from shared.schema import ServiceError
from shared.subjects import DECODE
from shared.usage_outbox import UsageOutbox
from worker.kvstore.store import KvStore
from worker.kvstore.writer import KvEventPublisher
from worker.serving.kv_io import store_payloads
from worker.serving.lifecycle import end_request
from worker.swa_client import SwaClient

log = get_logger(__name__)


class Finisher:
    def __init__(
        self,
        bus: Bus,
        store: KvStore,
        publisher: KvEventPublisher,
        swa: SwaClient | None,
        outbox: UsageOutbox,
        *,
        report_load: Callable[[], Awaitable[None]] | None = None,
        metrics: Metrics | None = None,  # the process's (a test's own when None)
    ) -> None:
        self.bus = bus
        self.store = store
        self.publisher = publisher
        self.swa = swa
        self.outbox = outbox  # every record is on disk before we count it, until JetStream has it
        # A heartbeat before the stream ends: the sequence's pages are free by then, and the
        # caller's next request (an agent's next turn follows at once) must not be routed on
        # a report that still counts them (it was refused OVERLOADED before this).
        self.report_load = report_load
        # The worker's metrics (its jobs count into the same): one set per decode worker.
        self.counts = DecodeMetrics(metrics or Metrics(DECODE, bus.instance_id))
        self._tasks: set[asyncio.Task[None]] = set()

    async def end(
        self,
        state: DecodeRequest,
        finished: Finished | None,
        error: ServiceError | None,
        token_ids: list[int] | None = None,
        text: str = "",
    ) -> None:
        task = asyncio.create_task(self._end(state, finished, error, token_ids or [], text))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def write_through(
        self,
        state: DecodeRequest,
        token_ids: list[int],
        blocks: list[tuple[int, bytes]],
        snapshot: bytes | None,
    ) -> None:
        """Write blocks the sequence filled while it decodes (and their boundary window);
        the request's end waits for them before its final chunk."""
        finished = Finished("", token_ids, blocks, snapshot)
        task = asyncio.create_task(self._write(state, finished))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        state.writes = [t for t in state.writes if not t.done()] + [task]

    async def _write(self, state: DecodeRequest, finished: Finished) -> None:
        try:
            await self._persist(state, finished)
        except Exception:  # a later failover recomputes from the last block written
            log.exception("writing decoded blocks failed", request_id=state.request_id)

    async def drain(self) -> None:
        await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def _end(
        self,
        state: DecodeRequest,
        finished: Finished | None,
        error: ServiceError | None,
        token_ids: list[int],
        text: str,
    ) -> None:
        state.error = error  # what the stream ends with (None: its reason)
        _end_generate_span(state, finished, error)
        with telemetry.span("decode finish", parent=state.span):
            await self._finish(state, finished, token_ids, text)

    async def _finish(
        self,
        state: DecodeRequest,
        finished: Finished | None,
        token_ids: list[int],
        text: str,
    ) -> None:
        if state.writes:  # the blocks written through go before the final chunk too
            await asyncio.gather(*state.writes, return_exceptions=True)
        if finished is not None:
            try:
                await self._persist(state, finished)
            except Exception:  # the answer still goes out; only the next turn's hit suffers
                log.exception("writing finished blocks failed", request_id=state.request_id)
        if self.report_load is not None:
            try:
                await self.report_load()
            except Exception:  # a late heartbeat costs a retry, never the answer
                log.exception("load report before the final chunk failed")
        status, reason = await end_request(
            state,
            finished.reason if finished is not None else None,
            outbox=self.outbox,
            counts=self.counts,
            hit_tokens={tier_label(state.job.cached_blocks.tier): state.num_cached_tokens},
            decode_worker_id=self.bus.instance_id,
            prefill_worker_id=state.job.decision.prefill_worker_id,
            last_token_ids=token_ids,
            last_text=text,
        )
        span = telemetry.current_span()  # decode finish
        if span.is_recording():
            span.set_attributes(
                {"kvfabric.usage_status": str(status), "kvfabric.finish_reason": reason}
            )

    async def _persist(self, state: DecodeRequest, finished: Finished) -> None:
        if not finished.blocks:
            return
        blocks = state.blocks
        first, end_block = finished.blocks[0][0], finished.blocks[-1][0] + 1
        payloads = [payload for _, payload in finished.blocks]  # blocks first..end_block-1
        num_stored = await store_payloads(
            self.publisher, finished.token_ids, blocks, first, payloads
        )
        self.counts.blocks_stored.inc(num_stored)
        span = telemetry.current_span()  # decode finish
        if span.is_recording():
            nbytes = num_stored * len(payloads[0])  # every block is the same size
            span.set_attributes({"kvfabric.num_blocks": num_stored, "kvfabric.bytes": nbytes})
        if self.swa is None or finished.boundary_snapshot is None:
            return
        try:
            boundary_hash = blocks.extend(finished.token_ids, end_block)[-1]
            if await self.swa.put(boundary_hash, finished.boundary_snapshot):
                self.counts.snapshots_put.inc()
        except ServiceError as exc:
            log.warning("sliding-window snapshot not kept", error=str(exc))


def _end_generate_span(
    state: DecodeRequest, finished: Finished | None, error: ServiceError | None
) -> None:
    """The generation's span ends with the request's last step (or its failure)."""
    span = state.generate_span
    if span.is_recording():
        span.set_attributes(
            {
                "kvfabric.num_output_tokens": len(state.output_ids),
                "kvfabric.num_forward_passes": state.num_forward_passes,
                "kvfabric.num_draft_tokens": state.num_draft_tokens,
                "kvfabric.num_accepted_draft_tokens": state.num_accepted_draft_tokens,
                "kvfabric.finish_reason": finished.reason if finished is not None else "cancelled",
            }
        )
        if error is not None:
            span.set_status(StatusCode.ERROR, f"{error.code.value}: {error.message}")
    span.end()
