from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from shared.config import ConfigError, ServiceConfig, check_dtype
from shared.models import ModelError, model_path, served_name


@dataclass(frozen=True, kw_only=True)
class VllmWorkerConfig(ServiceConfig):
    """Environment prefix KVF_VLLM_WORKER_. What the vLLM engine serves and how it starts, its
    KV connector's store, and the worker's own limits. (The vLLM server's port is any free one.)"""

    env_prefix: ClassVar[str] = "KVF_VLLM_WORKER_"

    # A model's name (`kvfabric models list`) or a path; vLLM loads its HF export (the GGUF's
    # own weights, vllm_env.export_checkpoint) under the model's served name, which is
    # also the block-hash namespace, so its blocks and a kvfabric engine's are the same.
    model: str = "SmolLM2-135M-Instruct"
    kv_block_size_tokens: int = 64  # vLLM's --block-size: the store's blocks
    # vLLM's --max-model-len: the longest sequence, prompt and output, in tokens (a prompt
    # of this many or more is refused).
    max_model_len: int = 8192
    # vLLM's --dtype, and its pages': float32 or bfloat16. The workers of one model -- vLLM's
    # and the kvfabric engine's (its --dtype) -- must agree to share blocks (docs/vllm.md).
    dtype: str = "float32"
    max_num_seqs: int = 32  # requests this worker holds at once (more: OVERLOADED)
    # Seconds OVERLOADED's Retry-After says when max_num_seqs requests are running.
    retry_after_s: float = 5.0
    # The KV connector (connector/, beside this file): kvfabric's SSD tier and kv-index under
    # vLLM's prefix cache. Off: vLLM with its own prefix caching only (what a plain vLLM does).
    connector: bool = True
    # The SSD tier's directory, shared with the engine workers; this one writes its own
    # subdirectory (its instance id) and reads everyone's.
    store_dir: Path = Path("/tmp/kvfabric/kvstore")
    # Bytes of the store this worker may fill (its share).
    store_capacity_bytes: int = 8 << 30
    # Bytes per store file: this worker's block slots are packed into files of this size.
    store_file_nbytes: int = 256 << 20
    store_backend: str = "aiofiles"  # vLLM's venv has no NIXL unless installed there
    # kv-index shards the connector's matches ask: must equal kv-index's num_shards.
    kv_index_shards: int = 1
    # vLLM itself: its venv's python (default: vllm_env.py builds one on first use),
    # its HTTP port (0: any free one), start-up and eager mode (no torch.compile: starts in
    # half the time, steps slower), its KV cache's size.
    vllm_python: Path | None = None
    # Seconds vLLM has to start answering once launched; past it the worker fails to start.
    vllm_startup_timeout_s: float = 900.0
    # vLLM's --enforce-eager: no torch.compile (faster start, slower steps).
    enforce_eager: bool = False
    kv_cache_bytes: int = 2 << 30  # vLLM's KV cache (--kv-cache-memory-bytes)
    # A prompt of this many tokens sent to vLLM once it answers and before the worker joins
    # discovery (0: none): a fresh vLLM's first long prompt, and its connector's first load,
    # cost more than the same ones later (docs/vllm.md); paid here instead of by the first
    # request routed to it.
    warmup_tokens: int = 1024
    # Usage records wait here until JetStream has them; vLLM's own log goes to logs/ beside it.
    usage_outbox_dir: Path = Path("/tmp/kvfabric/outbox")

    def validate(self) -> None:
        super().validate()
        try:
            model_path(self.model)
        except ModelError as exc:
            raise ConfigError(str(exc)) from exc
        check_dtype(self.dtype)
        for name in (
            "kv_block_size_tokens",
            "max_model_len",
            "max_num_seqs",
            "kv_cache_bytes",
            "store_capacity_bytes",
            "store_file_nbytes",
            "kv_index_shards",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.kv_block_size_tokens % 32:
            raise ConfigError(
                f"kv_block_size_tokens must be a multiple of 32 (vLLM's CPU attention), got "
                f"{self.kv_block_size_tokens}"
            )
        if not 0 <= self.warmup_tokens < self.max_model_len:
            raise ConfigError(
                f"warmup_tokens must be >= 0 and below max_model_len ({self.max_model_len}), "
                f"got {self.warmup_tokens}"
            )
        for name in ("retry_after_s", "vllm_startup_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0")

    @property
    def model_name(self) -> str:
        """What requests name: the model's served name (its namespace in the block hashes)."""
        return served_name(self.model)
