"""The one place NIXL is imported (lazily: only the processes that move KV load it), shared
by the store's file backend (`worker.kvstore.nixl_files`) and the KV transfer agent
(`worker.transfer`)."""

from __future__ import annotations

import logging
import os
from typing import Any

from shared.logging import get_logger
from shared.schema import Unavailable

log = get_logger(__name__)


class NixlUnavailable(Unavailable):
    """The nixl package cannot be imported here."""


def import_nixl() -> tuple[Any, Any]:
    """(nixl_agent, nixl_agent_config); `NixlUnavailable` when NIXL is not installed."""
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError as exc:
        raise NixlUnavailable(f"NIXL is not installed: {exc}") from exc
    # NIXL's Python logger writes INFO lines to stdout (one per agent and backend); keep
    # stdout for the service unless the operator asks for them with NIXL_LOG_LEVEL.
    if not os.environ.get("NIXL_LOG_LEVEL"):
        logging.getLogger("nixl").setLevel(logging.WARNING)
    return nixl_agent, nixl_agent_config


def release_handle(handle: object) -> None:
    """Release a transfer request. NIXL cancels one still in flight; if it cannot, the handle
    stays alive (its finaliser retries) and the failure is logged, not raised over the error
    that brought us here (a timeout)."""
    try:
        handle.release()  # type: ignore[attr-defined]
    except Exception as exc:  # nixlBind errors share no importable base class
        log.warning("NIXL transfer request not released", error=str(exc))
