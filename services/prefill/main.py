"""prefill: loads the cached prefix KV, restores the sliding-window state, computes the
uncached suffix and hands it to decode. DESIGN.md sections 3 and 5.

Runs today: registration, `$SRV` discovery, `LoadReport` heartbeats on
`<root>.load.<service>.<instance_id>`, drain on SIGTERM. Its request endpoints are wired here
as they land.
"""

from __future__ import annotations

from services.prefill.config import PrefillConfig
from shared.runtime import ServiceRuntime, service_main
from shared.subjects import PREFILL


async def setup(runtime: ServiceRuntime) -> None:
    """No request endpoints yet: the shared runtime registers, heartbeats and drains."""


def main(argv: list[str] | None = None) -> int:
    return service_main(PREFILL, PrefillConfig, setup, argv, description=__doc__ or "")
