"""decode: continuous batching over a paged KV pool, streams tokens, writes completed
blocks to the store and emits usage. DESIGN.md section 3.

Runs today: registration, `$SRV` discovery, `LoadReport` heartbeats on
`<root>.load.<service>.<instance_id>`, drain on SIGTERM. Its request endpoints are wired here
as they land.
"""

from __future__ import annotations

from services.decode.config import DecodeConfig
from shared.runtime import ServiceRuntime, service_main
from shared.subjects import DECODE


async def setup(runtime: ServiceRuntime) -> None:
    """No request endpoints yet: the shared runtime registers, heartbeats and drains."""


def main(argv: list[str] | None = None) -> int:
    return service_main(DECODE, DecodeConfig, setup, argv, description=__doc__ or "")
