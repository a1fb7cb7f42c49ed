from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from shared.config import ConfigError, ServiceConfig


@dataclass(frozen=True, kw_only=True)
class IngressConfig(ServiceConfig):
    """Environment prefix KVF_INGRESS_; the fields every service has are in ServiceConfig."""

    env_prefix: ClassVar[str] = "KVF_INGRESS_"

    # Address the HTTP API listens on: 127.0.0.1 this host only, 0.0.0.0 every interface.
    http_host: str = "127.0.0.1"
    http_port: int = 8000  # 0: any free port (the bound URL is published in discovery)
    # Keys: every request presents one (`kvfabric keys create`), or this dev key (account
    # "dev"); require_api_key=false serves anyone (account "anonymous").
    require_api_key: bool = True
    # The dev key (at least 8 characters), accepted beside created keys; None: no dev key.
    dev_api_key: str | None = None
    max_body_bytes: int = 32 << 20  # 413 past this; a 200K-token context is ~1 MB of JSON
    # A body not all in this long after the request began: 408 (a client trickling it).
    body_timeout_s: float = 30.0
    # A stream write that has not gone out this long (the client stopped reading): the
    # stream ends as at a disconnect, the request is cancelled and billed for what it made.
    stream_write_timeout_s: float = 60.0
    # The rate limits' sliding window ("per minute"); shorter only for tests and demos.
    limit_window_s: float = 60.0
    default_max_tokens: int = 1024  # when the request names none (capped by the context)
    keepalive_s: float = 10.0  # an SSE comment (Anthropic: ping) after this much silence
    responses_ttl_s: float = 7 * 86400.0  # stored Responses, for previous_response_id
    # A session's latest turn (hashes only), kept this long for the cache-miss diagnosis of
    # its next turn: longer than an agent's longest tool call.
    session_ttl_s: float = 3600.0
    # A turn ending in a tool call has its session's KV kept on the prefill worker that
    # served it until the tool is expected back (services/ingress/staging.py): for this long
    # after a tool the session never called before, at most `stage_max_s` (0: no staging).
    stage_default_s: float = 120.0
    # The longest a session is staged over a tool call, however long its tools took before.
    stage_max_s: float = 1800.0
    # Each request's cache-miss diagnosis, kept this long for `kvfabric cache explain`.
    explain_ttl_s: float = 86400.0
    segment_cache_tokens: int = 4_000_000  # tokenized segments kept, per model
    # A stream whose decode worker dies is billed from here until JetStream has it.
    usage_outbox_dir: Path = Path("/tmp/kvfabric/outbox")

    def validate(self) -> None:
        super().validate()
        if not 0 <= self.http_port <= 65535:
            raise ConfigError(f"http_port must be in [0, 65535], got {self.http_port}")
        for name in ("max_body_bytes", "default_max_tokens", "segment_cache_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in (
            "keepalive_s",
            "responses_ttl_s",
            "session_ttl_s",
            "explain_ttl_s",
            "limit_window_s",
            "body_timeout_s",
            "stream_write_timeout_s",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.dev_api_key is not None and len(self.dev_api_key) < 8:
            raise ConfigError("dev_api_key must be at least 8 characters")
