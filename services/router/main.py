"""router: picks a prefill and a decode worker for each request (cache-, load- and
SLO-aware) and forwards the job. DESIGN.md sections 1 and 3.

Runs today: registration, `$SRV` discovery, `LoadReport` heartbeats on
`<root>.load.<service>.<instance_id>`, drain on SIGTERM. Its request endpoints are wired here
as they land.
"""

from __future__ import annotations

from services.router.config import RouterConfig
from shared.runtime import ServiceRuntime, service_main
from shared.subjects import ROUTER


async def setup(runtime: ServiceRuntime) -> None:
    """No request endpoints yet: the shared runtime registers, heartbeats and drains."""


def main(argv: list[str] | None = None) -> int:
    return service_main(ROUTER, RouterConfig, setup, argv, description=__doc__ or "")
