from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from shared.config import ServiceConfig


@dataclass(frozen=True, kw_only=True)
class SwaMemcacheConfig(ServiceConfig):
    """Environment prefix KVF_SWA_MEMCACHE_; the fields every service has are in ServiceConfig."""

    env_prefix: ClassVar[str] = "KVF_SWA_MEMCACHE_"
