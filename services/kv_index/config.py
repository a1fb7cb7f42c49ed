from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from shared.config import ServiceConfig


@dataclass(frozen=True, kw_only=True)
class KvIndexConfig(ServiceConfig):
    """Environment prefix KVF_KV_INDEX_; the fields every service has are in ServiceConfig."""

    env_prefix: ClassVar[str] = "KVF_KV_INDEX_"
