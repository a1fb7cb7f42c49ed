"""billing: consumes usage records, prices them and keeps the ledger. DESIGN.md
sections 1 and 6.

Runs today: registration, `$SRV` discovery, `LoadReport` heartbeats on
`<root>.load.<service>.<instance_id>`, drain on SIGTERM. Its request endpoints are wired here
as they land.
"""

from __future__ import annotations

from services.billing.config import BillingConfig
from shared.runtime import ServiceRuntime, service_main
from shared.subjects import BILLING


async def setup(runtime: ServiceRuntime) -> None:
    """No request endpoints yet: the shared runtime registers, heartbeats and drains."""


def main(argv: list[str] | None = None) -> int:
    return service_main(BILLING, BillingConfig, setup, argv, description=__doc__ or "")
