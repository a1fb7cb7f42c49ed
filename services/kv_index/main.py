"""kv-index: the global prefix index (block hash -> KV location), longest-prefix match,
LRU/TTL/capacity eviction. DESIGN.md section 4.

Runs today: registration, `$SRV` discovery, `LoadReport` heartbeats on
`<root>.load.<service>.<instance_id>`, drain on SIGTERM. Its request endpoints are wired here
as they land.
"""

from __future__ import annotations

from services.kv_index.config import KvIndexConfig
from shared.runtime import ServiceRuntime, service_main
from shared.subjects import KV_INDEX


async def setup(runtime: ServiceRuntime) -> None:
    """No request endpoints yet: the shared runtime registers, heartbeats and drains."""


def main(argv: list[str] | None = None) -> int:
    return service_main(KV_INDEX, KvIndexConfig, setup, argv, description=__doc__ or "")
