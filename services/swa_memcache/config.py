from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from shared.config import ConfigError, ServiceConfig


@dataclass(frozen=True, kw_only=True)
class SwaMemcacheConfig(ServiceConfig):
    """Environment prefix KVF_SWA_MEMCACHE_; the fields every service has are in ServiceConfig."""

    env_prefix: ClassVar[str] = "KVF_SWA_MEMCACHE_"

    capacity_bytes: int = 8 << 30  # one NIXL-registered buffer, mapped lazily
    # Seconds a snapshot is held after its put (gets do not extend it), then dropped.
    ttl_s: float = 180.0
    # Seconds between sweeps that free expired snapshots and ended leases and tell the
    # routers what is held (a batch even when nothing changed).
    expire_interval_s: float = 10.0
    # Snapshots above this move over NIXL; at or below it they ride inline in NATS messages
    # (NATS' default max payload is 1 MiB, and a few MB there would stall other traffic).
    inline_max_bytes: int = 256 << 10
    lease_s: float = 5.0  # how long a large snapshot stays pinned for its reader's pull
    transfer_timeout_s: float = 5.0  # a put's pull from the caller's region

    def validate(self) -> None:
        super().validate()
        for name in (
            "capacity_bytes",
            "ttl_s",
            "expire_interval_s",
            "lease_s",
            "transfer_timeout_s",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0")
        if self.inline_max_bytes < 0:
            raise ConfigError("inline_max_bytes must be >= 0")
