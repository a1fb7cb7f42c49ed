from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from shared.config import ConfigError, ServiceConfig


@dataclass(frozen=True, kw_only=True)
class IngressConfig(ServiceConfig):
    """Environment prefix KVF_INGRESS_; the fields every service has are in ServiceConfig."""

    env_prefix: ClassVar[str] = "KVF_INGRESS_"

    http_host: str = "127.0.0.1"
    http_port: int = 8000  # 0: any free port (the bound URL is published in discovery)

    def validate(self) -> None:
        super().validate()
        if not 0 <= self.http_port <= 65535:
            raise ConfigError(f"http_port must be in [0, 65535], got {self.http_port}")
