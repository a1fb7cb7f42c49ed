from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from shared.config import ServiceConfig


@dataclass(frozen=True, kw_only=True)
class RouterConfig(ServiceConfig):
    """Environment prefix KVF_ROUTER_; the fields every service has are in ServiceConfig."""

    env_prefix: ClassVar[str] = "KVF_ROUTER_"
