"""The end of a decode request: the store, swa-memcache, the stream's last chunk, usage.

Order matters: the finished sequence's complete blocks (prompt tail + output) are written
and logged for kv-index, and its window at the last block boundary is put into
swa-memcache, *before* the final chunk -- an agent's next step follows the final chunk at
once and must find its own answer cached. Usage goes to JetStream last, with the request id
as message id, retried until stored (billing must not lose it). Each ending runs as its own
task so the batch loop keeps stepping the other sequences meanwhile.
"""

from __future__ import annotations

import asyncio
from collections import Counter

from services.decode.state import DecodeRequest, Finished
from shared.bus import Bus
from shared.kvstore.store import KvStore
from shared.kvstore.writer import KvEventPublisher
from shared.logging import get_logger
from shared.schema import ServiceError, TokenChunk, UsageStatus, pack_token_ids
from shared.serving.kv_io import store_payloads
from shared.subjects import DECODE
from shared.swa_client import SwaClient

log = get_logger(__name__)

USAGE_PUBLISH_ATTEMPTS = 5


class Finisher:
    def __init__(
        self, bus: Bus, store: KvStore, publisher: KvEventPublisher, swa: SwaClient | None
    ) -> None:
        self.bus = bus
        self.store = store
        self.publisher = publisher
        self.swa = swa
        self.counts: Counter[str] = Counter()
        self._tasks: set[asyncio.Task[None]] = set()

    async def send(self, state: DecodeRequest, token_ids: list[int], text: str) -> None:
        chunk = TokenChunk(
            request_id=state.request_id,
            seq=state.stream.num_sent,
            token_ids=pack_token_ids(token_ids),
            text=text,
        )
        await state.stream.send(chunk)

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
        if finished is not None:
            try:
                await self._persist(state, finished)
            except Exception:  # the answer still goes out; only the next turn's hit suffers
                log.exception("writing finished blocks failed", request_id=state.request_id)
        reason = finished.reason if finished is not None else "cancelled"
        try:
            if error is not None:
                self.counts["num_failed"] += 1
                await state.stream.fail(error)
            else:
                self.counts[f"num_finished.{reason}"] += 1
                chunk = TokenChunk(
                    request_id=state.request_id, seq=state.stream.num_sent,
                    token_ids=pack_token_ids(token_ids), text=text + state.detokenizer.flush(),
                    final=True, finish_reason=reason, usage=state.usage(), stats=state.stats(),
                )  # fmt: skip
                await state.stream.send(chunk, final=True)
        except Exception:
            log.exception("ending the stream failed", request_id=state.request_id)
        if error is not None:
            status, reason = UsageStatus.FAILED, "error"
        elif reason == "cancelled":
            status = UsageStatus.CANCELLED
        else:
            status = UsageStatus.COMPLETED
        await self._publish_usage(state, status, reason)

    async def _persist(self, state: DecodeRequest, finished: Finished) -> None:
        if not finished.blocks:
            return
        blocks = state.blocks
        first, end_block = finished.blocks[0][0], finished.blocks[-1][0] + 1
        payloads = [payload for _, payload in finished.blocks]  # blocks first..end_block-1
        self.counts["num_blocks_stored"] += await store_payloads(
            self.publisher, finished.token_ids, blocks, first, payloads
        )
        if self.swa is None or finished.boundary_snapshot is None:
            return
        try:
            boundary_hash = blocks.extend(finished.token_ids, end_block)[-1]
            if await self.swa.put(boundary_hash, finished.boundary_snapshot):
                self.counts["num_snapshots_put"] += 1
        except ServiceError as exc:
            log.warning("sliding-window snapshot not kept", error=str(exc))

    async def _publish_usage(self, state: DecodeRequest, status: UsageStatus, reason: str) -> None:
        record = state.usage_record(status, reason, self.bus.instance_id)
        subject = self.bus.subjects.usage(DECODE)
        for attempt in range(USAGE_PUBLISH_ATTEMPTS):
            try:
                await self.bus.js.publish(subject, record, msg_id=state.request_id)
                self.counts["num_usage_records"] += 1
                return
            except ServiceError as exc:
                log.warning("usage record not stored yet", request_id=state.request_id,
                            attempt=attempt + 1, error=str(exc))  # fmt: skip
                await asyncio.sleep(0.2 * 2**attempt)
        self.counts["num_usage_lost"] += 1
        log.error("usage record lost", request_id=state.request_id, record=str(record))
