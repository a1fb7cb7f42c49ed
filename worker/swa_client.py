"""The caller's side of swa-memcache (a prefill worker): put and get sliding-window snapshots,
inline when small, over NIXL when larger than `inline_max_bytes`.

The worker's `KvTransferAgent` must already serve its metadata (`agent.serve()`): for a large
put the memcache pulls the bytes from our region, so they are staged in a slice of the
agent's buffer (`staging_offset`, `staging_nbytes`) and stay there until the memcache replied.
For a large get the memcache answers where the bytes lie in its region, pinned for a lease;
we pull them into the staging slice, check their XXH3-64 and send `SwaRelease`. A pull that
fails, finishes past the lease, or reads bytes that do not match is a miss, never a wrong
snapshot. One staging slice serves one transfer at a time (a lock): a 2 MB pull takes ~1 ms
(loadtest/bench_kv.py measured 2 GB/s on a 2-core host), far below a prefill step.

NATS-level failures (no memcache, no reply in time) raise the bus's typed errors.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import numpy as np
import xxhash

from shared.bus import Bus
from shared.logging import get_logger
from shared.schema import pack_block_hashes
from shared.schema.swa import (
    SwaGet,
    SwaGetReply,
    SwaHold,
    SwaNixlRef,
    SwaPut,
    SwaPutReply,
    SwaRelease,
)
from worker.transfer import ByteRange, KvTransferAgent, TransferError, TransferTimeout

log = get_logger(__name__)

DEFAULT_INLINE_MAX_BYTES = 256 << 10  # swa-memcache's default `inline_max_bytes`


async def read_snapshot(
    agent: KvTransferAgent, where: SwaNixlRef, local_offset: int, *, timeout_s: float
) -> None:
    """Pull `where` into our region at `local_offset`; raises `TransferError`.

    A peer that restarted under the same instance id (memcaches and workers keep theirs)
    leaves stale metadata cached: the first read fails at once with a disconnect and the
    agent forgets the peer, so one more try asks for fresh metadata. A dead peer fails the
    second try at once too (no responder); a timeout is not retried."""
    deadline = time.monotonic() + timeout_s
    pull = [ByteRange(local_offset, where.offset, where.nbytes)]
    try:
        await agent.read(where.service, where.instance_id, pull, timeout_s=timeout_s)
    except TransferTimeout:
        raise
    except TransferError:
        remaining_s = deadline - time.monotonic()
        if remaining_s <= 0:
            raise
        await agent.read(where.service, where.instance_id, pull, timeout_s=remaining_s)


@dataclass(frozen=True, slots=True)
class SwaLease:
    """A large snapshot pinned for us in a memcache's region until `deadline` (monotonic)."""

    location: SwaNixlRef
    lease_id: int
    deadline: float


class SwaClient:
    def __init__(
        self,
        bus: Bus,
        agent: KvTransferAgent | None,
        *,
        memcache_instance_id: str | None = None,
        inline_max_bytes: int = DEFAULT_INLINE_MAX_BYTES,
        staging_offset: int = 0,
        staging_nbytes: int | None = None,
        timeout_s: float = 5.0,
        transfer_timeout_s: float = 5.0,
    ) -> None:
        self.bus = bus
        self.agent = agent  # None: inline only (snapshots must then fit in a NATS message)
        self.memcache_instance_id = memcache_instance_id  # None: any instance (pooled)
        self.inline_max_bytes = inline_max_bytes
        # The agent's whole registered buffer as bytes, whatever its dtype and shape.
        self._bytes = (
            agent.buffer.reshape(-1).view(np.uint8) if agent is not None else np.empty(0, np.uint8)
        )
        buffer_nbytes = self._bytes.nbytes
        self.staging_offset = staging_offset
        self.staging_nbytes = (
            buffer_nbytes - staging_offset if staging_nbytes is None else staging_nbytes
        )
        if staging_offset < 0 or staging_offset + self.staging_nbytes > buffer_nbytes:
            raise ValueError("the staging slice must lie inside the agent's buffer")
        self.timeout_s = timeout_s
        self.transfer_timeout_s = transfer_timeout_s
        self._staging_lock = asyncio.Lock()

    # -- put -----------------------------------------------------------------------------
    async def put(self, block_hash: int, data: bytes) -> bool:
        """Store `data`; False (reason logged) when the memcache did not store it."""
        if len(data) <= self.inline_max_bytes or self.agent is None:
            return await self._put(SwaPut(block_hash=block_hash, snapshot=data))
        if len(data) > self.staging_nbytes:
            raise ValueError(f"a {len(data)}-byte snapshot exceeds the staging slice")
        async with self._staging_lock:
            self._staging(len(data))[:] = np.frombuffer(data, dtype=np.uint8)
            return await self.put_from(block_hash, self.staging_offset, len(data))

    async def put_from(self, block_hash: int, offset: int, nbytes: int) -> bool:
        """Store the `nbytes` already at `offset` in the agent's registered buffer (no copy);
        they must stay unchanged until this returns."""
        if self.agent is None:
            raise ValueError("put_from needs a NIXL agent")
        if offset < 0 or nbytes <= 0 or offset + nbytes > self._bytes.nbytes:
            raise ValueError(f"range {offset}+{nbytes} is not inside the agent's buffer")
        data = self._bytes[offset : offset + nbytes]
        source = SwaNixlRef(
            self.agent.service,
            self.agent.bus.instance_id,
            offset,
            nbytes,
            xxhash.xxh3_64_intdigest(data),
        )
        # The memcache pulls before it replies: give it its whole pull timeout and some.
        timeout_s = self.timeout_s + self.transfer_timeout_s
        async with self.agent.busy():  # the memcache pulls from our region until it replies
            return await self._put(
                SwaPut(block_hash=block_hash, snapshot=b"", source=source), timeout_s
            )

    async def _put(self, message: SwaPut, timeout_s: float | None = None) -> bool:
        reply = await self.bus.request(
            self._subject(self.bus.subjects.swa_put),
            message,
            SwaPutReply,
            timeout_s=timeout_s or self.timeout_s,
        )
        if not reply.stored:
            log.info("snapshot not stored", block_hash=message.block_hash, reason=reply.reason)
        return reply.stored

    # -- get -----------------------------------------------------------------------------
    async def get(self, block_hash: int) -> bytes | None:
        found = await self.lookup(block_hash)
        return await self.pull(found) if isinstance(found, SwaLease) else found

    async def lookup(self, block_hash: int) -> bytes | SwaLease | None:
        """A small snapshot's bytes, a lease on a large one (`pull` it), or None (miss)."""
        asked_at = time.monotonic()  # before the memcache started the lease: conservative
        reply = await self.bus.request(
            self._subject(self.bus.subjects.swa_get),
            SwaGet(block_hash=block_hash, can_read_nixl=self.agent is not None),
            SwaGetReply,
            timeout_s=self.timeout_s,
        )
        if not reply.found:
            return None
        if reply.location is None:
            return reply.snapshot
        return SwaLease(reply.location, reply.lease_id, asked_at + reply.lease_s)

    async def pull(self, lease: SwaLease) -> bytes | None:
        """The leased bytes, or None when they cannot be trusted (a miss)."""
        where = lease.location
        try:
            if self.agent is None or where.nbytes > self.staging_nbytes:
                log.warning("leased snapshot does not fit the staging slice", nbytes=where.nbytes)
                return None
            async with self._staging_lock:
                remaining_s = min(self.transfer_timeout_s, lease.deadline - time.monotonic())
                if remaining_s <= 0:
                    return None
                try:
                    await read_snapshot(
                        self.agent, where, self.staging_offset, timeout_s=remaining_s
                    )
                except TransferError as exc:
                    log.warning("snapshot pull failed", source=where.instance_id, error=exc.message)
                    return None
                if time.monotonic() > lease.deadline:
                    return None  # the memcache may have reused the range while we read
                data = self._staging(where.nbytes)
                if xxhash.xxh3_64_intdigest(data) != where.checksum:
                    log.warning("leased snapshot failed its checksum", source=where.instance_id)
                    return None
                return data.tobytes()
        finally:
            await self.release(lease)

    async def release(self, lease: SwaLease) -> None:
        """Tell the memcache we are done with the lease (fire and forget; it also runs out)."""
        subject = self.bus.subjects.instance(
            self.bus.subjects.swa_release, lease.location.instance_id
        )
        await self.bus.publish(subject, SwaRelease(lease_id=lease.lease_id))

    async def hold(self, block_hashes: list[int], until_ms: int) -> None:
        """Ask the memcache to keep these snapshots until `until_ms` (fire and forget)."""
        request = SwaHold(block_hashes=pack_block_hashes(block_hashes), until_ms=until_ms)
        await self.bus.publish(self._subject(self.bus.subjects.swa_hold), request)

    # -- internals -----------------------------------------------------------------------
    def _subject(self, endpoint_subject: str) -> str:
        if self.memcache_instance_id is None:
            return endpoint_subject
        return self.bus.subjects.instance(endpoint_subject, self.memcache_instance_id)

    def _staging(self, nbytes: int) -> np.ndarray:
        return self._bytes[self.staging_offset : self.staging_offset + nbytes]
