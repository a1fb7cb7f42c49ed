from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from shared.config import ConfigError, EngineWorkerConfig


@dataclass(frozen=True, kw_only=True)
class DecodeConfig(EngineWorkerConfig):
    """Environment prefix KVF_DECODE_; model, KV pool and store fields are in
    EngineWorkerConfig."""

    env_prefix: ClassVar[str] = "KVF_DECODE_"

    max_num_seqs: int = 32  # sequences in the running batch
    max_batch_tokens: int = 512  # tokens per step (a preempted sequence's recompute chunks)
    # Prompt-lookup drafts (on: agents re-emit code they have seen); drafting is off above
    # spec_max_batch_size running sequences, where it measured slower.
    spec_decode: bool = True
    # Running sequences above which no drafts are proposed (see spec_decode above).
    spec_max_batch_size: int = 4
    # Each block a sequence fills goes to the store (its window to swa-memcache) at once, not
    # at the end: a request whose worker dies continues elsewhere from there (failover).
    write_through: bool = True
    suffix_timeout_s: float = 600.0  # a job waits this long for its prefill's SuffixReady
    retry_after_s: float = 5.0  # OVERLOADED's hint when the pool cannot take a prompt
    pull_timeout_s: float = 30.0  # the NIXL read of a staged suffix
    # Usage records wait here (<dir>/<instance_id>.usage, fsync'd) until JetStream has them;
    # a restarted worker with the same instance id replays what it left.
    usage_outbox_dir: Path = Path("/tmp/kvfabric/outbox")

    def validate(self) -> None:
        super().validate()
        for name in ("max_num_seqs", "max_batch_tokens", "spec_max_batch_size"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0")
        for name in ("suffix_timeout_s", "retry_after_s", "pull_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0")
