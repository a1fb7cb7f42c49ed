"""swa-memcache: node-local RAM cache of sliding-window snapshots (180 s TTL).
DESIGN.md section 5.

Runs today: registration, `$SRV` discovery, `LoadReport` heartbeats on
`<root>.load.<service>.<instance_id>`, drain on SIGTERM. Its request endpoints are wired here
as they land.
"""

from __future__ import annotations

from services.swa_memcache.config import SwaMemcacheConfig
from shared.runtime import ServiceRuntime, service_main
from shared.subjects import SWA_MEMCACHE


async def setup(runtime: ServiceRuntime) -> None:
    """No request endpoints yet: the shared runtime registers, heartbeats and drains."""


def main(argv: list[str] | None = None) -> int:
    return service_main(SWA_MEMCACHE, SwaMemcacheConfig, setup, argv, description=__doc__ or "")
