"""swa-memcache: node-local RAM cache of sliding-window snapshots (180 s TTL, LRU under a
capacity). DESIGN.md section 5. Never written to SSD. One instance per prefill node, named
`swa-memcache-<node>` so the node's prefill workers (and the router) address it directly.

Serves (pooled in queue group `swa-memcache`, and on `<subject>.<instance_id>`):
  <root>.swa-memcache.get        SwaGet -> SwaGetReply
  <root>.swa-memcache.put        SwaPut -> SwaPutReply
  <root>.swa-memcache.contains   SwaContains -> SwaContainsReply (no counting, no refresh)
Snapshots ride inline in the messages; the NIXL path for snapshots past a size threshold
comes with the transfer module.
"""

from __future__ import annotations

import time

from services.swa_memcache.cache import SnapshotCache
from services.swa_memcache.config import SwaMemcacheConfig
from shared.bus import Context, Endpoint
from shared.runtime import ServiceRuntime, service_main
from shared.schema import BadRequest, unpack_block_hashes
from shared.schema.swa import (
    SwaContains,
    SwaContainsReply,
    SwaGet,
    SwaGetReply,
    SwaPut,
    SwaPutReply,
)
from shared.subjects import SWA_MEMCACHE


async def setup(runtime: ServiceRuntime) -> None:
    config = runtime.config
    assert isinstance(config, SwaMemcacheConfig)  # service_main built it from SwaMemcacheConfig
    cache = SnapshotCache(config.capacity_bytes, config.ttl_s)

    async def handle_get(request: SwaGet, ctx: Context) -> SwaGetReply:
        data = cache.get(request.block_hash, time.monotonic())
        return SwaGetReply(found=data is not None, snapshot=data or b"")

    async def handle_put(request: SwaPut, ctx: Context) -> SwaPutReply:
        return SwaPutReply(stored=cache.put(request.block_hash, request.snapshot, time.monotonic()))

    async def handle_contains(request: SwaContains, ctx: Context) -> SwaContainsReply:
        try:
            hashes = unpack_block_hashes(request.block_hashes).tolist()
        except ValueError as exc:
            raise BadRequest(str(exc)) from exc
        now = time.monotonic()
        return SwaContainsReply(found=bytes(cache.contains(h, now) for h in hashes))

    async def expire() -> None:
        cache.expire(time.monotonic())

    subjects = runtime.bus.subjects
    await runtime.bus.serve(Endpoint("get", subjects.swa_get, SwaGet, handle_get))
    await runtime.bus.serve(Endpoint("put", subjects.swa_put, SwaPut, handle_put))
    await runtime.bus.serve(
        Endpoint("contains", subjects.swa_contains, SwaContains, handle_contains)
    )
    runtime.every(config.expire_interval_s, expire)
    runtime.counters = lambda: (
        vars(cache.counters)
        | {
            "num_entries": len(cache),
            "used_bytes": cache.used_bytes,
        }
    )


def main(argv: list[str] | None = None) -> int:
    return service_main(SWA_MEMCACHE, SwaMemcacheConfig, setup, argv, description=__doc__ or "")
