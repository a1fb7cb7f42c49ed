from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from shared.config import ConfigError, ServiceConfig


@dataclass(frozen=True, kw_only=True)
class BillingConfig(ServiceConfig):
    """Environment prefix KVF_BILLING_; the fields every service has are in ServiceConfig."""

    env_prefix: ClassVar[str] = "KVF_BILLING_"

    # sqlite:///PATH (embedded, WAL) or postgresql://USER@HOST:PORT/DB (production); every
    # billing replica of a cluster must name the same PostgreSQL database.
    ledger_url: str = "sqlite:////tmp/kvfabric/billing/ledger.db"
    pricing_file: Path | None = None  # TOML (services/billing/pricing.py); default prices without
    batch_size: int = 500  # usage records per fetch and per ledger transaction
    # Seconds a fetch waits to fill a batch: under light traffic a record waits up to this
    # long before it is priced and committed.
    fetch_timeout_s: float = 1.0
    # A record a replica took but never acknowledged (killed mid-batch) goes to another after
    # this long; longer than a batch's commit ever takes, or batches are delivered twice.
    ack_wait_s: float = 30.0

    def validate(self) -> None:
        super().validate()
        if not self.ledger_url.startswith(("sqlite:///", "postgresql://", "postgres://")):
            raise ConfigError(
                f"ledger_url {self.ledger_url!r} must start with sqlite:/// or postgresql://"
            )
        if self.batch_size < 1:
            raise ConfigError(f"batch_size must be at least 1, got {self.batch_size}")
        if self.fetch_timeout_s <= 0:
            raise ConfigError(f"fetch_timeout_s must be positive, got {self.fetch_timeout_s}")
        if self.ack_wait_s <= 0:
            raise ConfigError(f"ack_wait_s must be positive, got {self.ack_wait_s}")
        if self.pricing_file is not None and not self.pricing_file.is_file():
            raise ConfigError(f"pricing_file {self.pricing_file}: no such file")
