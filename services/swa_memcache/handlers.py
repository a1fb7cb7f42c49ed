"""swa-memcache's endpoints: thin over `SnapshotCache`, plus the NIXL leg of large snapshots.

A put naming a `source` region is pulled from the caller's agent into a reservation, checked
against its XXH3-64 and only then committed: a failed pull (dead or stuck caller, UCX error),
a timeout or a mismatch leaves nothing stored and answers `stored=False` with the reason. A
get of a large snapshot pins it for `lease_s` and answers where it lies in our region.
"""

from __future__ import annotations

import time

from services.swa_memcache.cache import SnapshotCache, checksum
from services.swa_memcache.config import SwaMemcacheConfig
from services.swa_memcache.metrics import SwaMemcacheMetrics
from shared.bus import Context
from shared.logging import get_logger
from shared.schema import BadRequest, unpack_block_hashes
from shared.schema.swa import (
    SwaContains,
    SwaContainsReply,
    SwaGet,
    SwaGetReply,
    SwaHold,
    SwaNixlRef,
    SwaPut,
    SwaPutReply,
    SwaRelease,
)
from shared.subjects import SWA_MEMCACHE
from worker.swa_client import read_snapshot
from worker.transfer import KvTransferAgent, TransferError

log = get_logger(__name__)

# Room left in a NATS message for the envelope and headers of an inline reply.
_ENVELOPE_BYTES = 4096


class SwaHandlers:
    def __init__(
        self,
        cache: SnapshotCache,
        config: SwaMemcacheConfig,
        *,
        instance_id: str,
        agent: KvTransferAgent | None,
        max_payload_bytes: int,
        counts: SwaMemcacheMetrics,
    ) -> None:
        self.cache = cache
        self.config = config
        self.instance_id = instance_id
        self.agent = agent  # None: NIXL unavailable here, every snapshot rides inline
        self.max_inline_reply_bytes = max_payload_bytes - _ENVELOPE_BYTES
        self.counts = counts

    async def get(self, request: SwaGet, ctx: Context) -> SwaGetReply:
        now = time.monotonic()
        snapshot = self.cache.find(request.block_hash, now)
        if snapshot is None:
            return SwaGetReply(found=False)
        if (
            snapshot.nbytes <= self.config.inline_max_bytes
            or not request.can_read_nixl
            or self.agent is None
        ):
            if snapshot.nbytes > self.max_inline_reply_bytes:
                self.counts.too_large_inline.inc()
                return SwaGetReply(found=False)
            return SwaGetReply(found=True, snapshot=self.cache.view(snapshot).tobytes())
        lease_id = self.cache.pin(snapshot, now, self.config.lease_s)
        self.agent.expect_traffic(self.config.lease_s)  # the reader pulls during the lease
        self.counts.leased_gets.inc()
        location = SwaNixlRef(
            SWA_MEMCACHE, self.instance_id, snapshot.offset, snapshot.nbytes, snapshot.checksum
        )
        return SwaGetReply(
            found=True, location=location, lease_id=lease_id, lease_s=self.config.lease_s
        )

    async def release(self, request: SwaRelease, ctx: Context) -> None:
        if self.cache.release(request.lease_id, time.monotonic()):
            self.counts.released.inc()

    async def hold(self, request: SwaHold, ctx: Context) -> None:
        """Keep these snapshots past their TTL (a session staged over a tool call)."""
        now = time.monotonic()
        until = now + max(request.until_ms / 1000 - time.time(), 0.0)
        for key in unpack_block_hashes(request.block_hashes).tolist():
            self.cache.hold(key, until, now)

    async def put(self, request: SwaPut, ctx: Context) -> SwaPutReply:
        source = request.source
        if source is None:
            stored = self.cache.put(request.block_hash, request.snapshot, time.monotonic())
            return SwaPutReply(
                stored=stored, reason="" if stored else self._no_room(len(request.snapshot))
            )
        if source.nbytes <= 0 or source.offset < 0:
            raise BadRequest(
                f"a NIXL put needs a non-empty range, got {source.offset}+{source.nbytes}"
            )
        if self.agent is None:
            return SwaPutReply(stored=False, reason="this memcache has no NIXL agent")
        region = self.cache.reserve(source.nbytes, time.monotonic())
        if region is None:
            return SwaPutReply(stored=False, reason=self._no_room(source.nbytes))
        try:
            started = time.perf_counter()
            try:
                await read_snapshot(
                    self.agent, source, region.offset, timeout_s=self.config.transfer_timeout_s
                )
            except TransferError as exc:
                self.counts.pull_failed.inc()
                log.warning("snapshot pull failed", source=source.instance_id, error=exc.message)
                return SwaPutReply(stored=False, reason=f"pull failed: {exc.message}")
            except ValueError as exc:  # the range lies outside the caller's region
                raise BadRequest(str(exc)) from exc
            self.counts.pull_seconds.observe(time.perf_counter() - started)
            self.counts.pulled_bytes.inc(source.nbytes)
            if checksum(self.cache.view(region)) != source.checksum:
                self.counts.pull_mismatched.inc()
                return SwaPutReply(stored=False, reason="checksum mismatch")
            self.cache.commit(request.block_hash, region, source.checksum, time.monotonic())
            region = None
            self.counts.pulled.inc()
            return SwaPutReply(stored=True)
        finally:
            if region is not None:  # failed, or cancelled at the request's deadline
                self.cache.abort(region)

    async def contains(self, request: SwaContains, ctx: Context) -> SwaContainsReply:
        try:
            hashes = unpack_block_hashes(request.block_hashes).tolist()
        except ValueError as exc:
            raise BadRequest(str(exc)) from exc
        now = time.monotonic()
        return SwaContainsReply(found=bytes(self.cache.contains(h, now) for h in hashes))

    async def expire(self) -> None:
        self.cache.expire(time.monotonic())

    def _no_room(self, nbytes: int) -> str:
        if nbytes > self.cache.capacity_bytes:
            return f"{nbytes} bytes is more than the whole capacity"
        return "no room: every entry that would make room is pinned by a reader"
