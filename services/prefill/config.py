from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from shared.config import EngineWorkerConfig


@dataclass(frozen=True, kw_only=True)
class PrefillConfig(EngineWorkerConfig):
    """Environment prefix KVF_PREFILL_; model and KV pool fields are in EngineWorkerConfig."""

    env_prefix: ClassVar[str] = "KVF_PREFILL_"
