"""kv_connector_extra_config, checked when vLLM builds the connector (no vLLM import here:
the tests and the vllm-worker read it too). The fields: connector.py's docstring."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.subjects import DEFAULT_ROOT


class ConnectorConfigError(ValueError):
    """kv_connector_extra_config is missing a field or has a bad one (raised at start)."""


@dataclass(frozen=True)
class ConnectorConfig:
    nats_url: str
    model: str
    store_dir: Path
    writer_id: str
    root: str = DEFAULT_ROOT
    block_size_tokens: int = 64
    store_capacity_bytes: int = 64 << 30
    store_file_nbytes: int = 1 << 30
    store_backend: str = "aiofiles"
    kv_index_shards: int = 1
    match_timeout_s: float = 0.5
    load: bool = True
    save: bool = True
    log_level: str = "info"  # the connector's own lines, in vLLM's log
    # How long vLLM's model process busy-polls for its next step (vLLM: 1 s); None: vLLM's.
    idle_spin_s: float | None = 0.05

    @classmethod
    def from_extra(cls, extra: dict[str, Any]) -> ConnectorConfig:
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ConnectorConfigError(
                f"kv_connector_extra_config: unknown {', '.join(unknown)}; known: "
                f"{', '.join(sorted(known))}"
            )
        missing = [k for k in ("nats_url", "model", "store_dir", "writer_id") if not extra.get(k)]
        if missing:
            raise ConnectorConfigError(f"kv_connector_extra_config needs {', '.join(missing)}")
        values = dict(extra)
        values["store_dir"] = Path(values["store_dir"])
        config = cls(**values)
        if config.block_size_tokens <= 0 or config.kv_index_shards <= 0:
            raise ConnectorConfigError("block_size_tokens and kv_index_shards must be positive")
        if config.idle_spin_s is not None and not 0 <= config.idle_spin_s <= 10:
            raise ConnectorConfigError(f"idle_spin_s must be 0-10 s, got {config.idle_spin_s}")
        return config
