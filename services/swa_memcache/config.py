from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from shared.config import ConfigError, ServiceConfig


@dataclass(frozen=True, kw_only=True)
class SwaMemcacheConfig(ServiceConfig):
    """Environment prefix KVF_SWA_MEMCACHE_; the fields every service has are in ServiceConfig."""

    env_prefix: ClassVar[str] = "KVF_SWA_MEMCACHE_"

    capacity_bytes: int = 8 << 30
    ttl_s: float = 180.0
    expire_interval_s: float = 10.0

    def validate(self) -> None:
        super().validate()
        for name in ("capacity_bytes", "ttl_s", "expire_interval_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0")
