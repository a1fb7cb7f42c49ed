from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from shared.config import EngineWorkerConfig


@dataclass(frozen=True, kw_only=True)
class DecodeConfig(EngineWorkerConfig):
    """Environment prefix KVF_DECODE_; model and KV pool fields are in EngineWorkerConfig."""

    env_prefix: ClassVar[str] = "KVF_DECODE_"
