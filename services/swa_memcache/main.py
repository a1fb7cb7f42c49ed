"""swa-memcache: node-local RAM cache of sliding-window snapshots (180 s TTL, LRU under a
capacity). docs/design.md, 'Sliding-window state'. Never written to SSD. One instance per
prefill node, named `swa-memcache-<node>` so the node's prefill workers (and the router)
address it directly.

Serves (pooled in queue group `swa-memcache`, and on `<subject>.<instance_id>`):
  <root>.swa-memcache.get            SwaGet -> SwaGetReply
  <root>.swa-memcache.put            SwaPut -> SwaPutReply
  <root>.swa-memcache.release        SwaRelease (published, no reply): a reader's lease ends
  <root>.swa-memcache.hold           SwaHold (published, no reply): keep snapshots past TTL
  <root>.swa-memcache.contains       SwaContains -> SwaContainsReply (no counting, no refresh;
                                     for operators and tests: routers use our events)
  <root>.swa-memcache.nixl-metadata  NixlMetadataRequest -> NixlAgentInfo (our NIXL agent)
Publishes (core NATS, `events.py`):
  <root>.swa-memcache.events.<id>    SwaHeld: the hashes we started or stopped holding, after
                                     each put, get (lazy expiry) and sweep; seq-numbered from
                                     the clock; our full state at start, on request, and an
                                     empty one at shutdown. The routers' map of who holds what.
Listens:
  <root>.swa-memcache.resync         SwaResync (broadcast): one naming us or every memcache
                                     ("") is answered with our full state on our events subject

Snapshots up to `inline_max_bytes` (256 KiB) ride inline in the messages. Larger ones move
over NIXL (UCX) in and out of one registered buffer of `capacity_bytes` that holds every
entry (`SnapshotCache` over `Arena`):
- put: the caller's `SwaPut.source` names the range in its own registered region; we reserve
  room, pull it (`KvTransferAgent.read`), check its XXH3-64, then commit and reply
  stored=True. A pull that fails or times out (`transfer_timeout_s`) or a mismatch stores
  nothing and replies stored=False with the reason.
- get (`SwaGet.can_read_nixl`): we pin the entry for `lease_s` (5 s) and reply its range in
  our region; the reader pulls and checks it, then publishes `SwaRelease`. A pinned entry is
  never evicted or overwritten; a reader that finishes past its lease treats it as a miss.
`worker.swa_client.SwaClient` is the caller's side. Where NIXL cannot start, the
memcache serves inline only (large puts refused, large gets inline while NATS carries them).
"""

from __future__ import annotations

from services.swa_memcache.cache import SnapshotCache
from services.swa_memcache.config import SwaMemcacheConfig
from services.swa_memcache.events import SwaEventPublisher
from services.swa_memcache.handlers import SwaHandlers
from services.swa_memcache.metrics import SwaMemcacheMetrics
from shared.bus import Endpoint
from shared.logging import get_logger
from shared.runtime import ServiceRuntime, service_main
from shared.schema.swa import SwaContains, SwaGet, SwaHold, SwaPut, SwaRelease
from shared.subjects import SWA_MEMCACHE
from worker.transfer import KvTransferAgent, TransferError

log = get_logger(__name__)


async def setup(runtime: ServiceRuntime) -> None:
    config = runtime.config
    assert isinstance(config, SwaMemcacheConfig)  # service_main built it from SwaMemcacheConfig
    cache = SnapshotCache(config.capacity_bytes, config.ttl_s)
    bus = runtime.bus
    agent: KvTransferAgent | None = None
    try:
        agent = KvTransferAgent(bus, cache.buffer, service=SWA_MEMCACHE)
    except TransferError as exc:
        log.warning("NIXL unavailable: every snapshot rides inline", error=str(exc))
    counts = SwaMemcacheMetrics(runtime.metrics)
    handlers = SwaHandlers(
        cache,
        config,
        instance_id=runtime.instance_id,
        agent=agent,
        max_payload_bytes=bus.max_payload_bytes,
        counts=counts,
    )

    events = SwaEventPublisher(bus, cache, node_id=config.node_id)
    counts.observe(cache, events)
    await events.start()
    runtime.on_stop(events.stop)

    subjects = bus.subjects
    # Every handler that can change what we hold is followed by a batch of the change.
    await bus.serve(Endpoint("get", subjects.swa_get, SwaGet, events.tracked(handlers.get)))
    await bus.serve(Endpoint("put", subjects.swa_put, SwaPut, events.tracked(handlers.put)))
    await bus.serve(Endpoint("release", subjects.swa_release, SwaRelease, handlers.release))
    await bus.serve(Endpoint("hold", subjects.swa_hold, SwaHold, handlers.hold))
    await bus.serve(Endpoint("contains", subjects.swa_contains, SwaContains, handlers.contains))
    if agent is not None:
        await agent.serve()
        close = agent.close

        async def close_agent() -> None:
            close()

        runtime.on_stop(close_agent)
    runtime.every(config.expire_interval_s, events.tracked(handlers.expire, confirm=True))


def main(argv: list[str] | None = None) -> int:
    return service_main(SWA_MEMCACHE, SwaMemcacheConfig, setup, argv, description=__doc__ or "")
