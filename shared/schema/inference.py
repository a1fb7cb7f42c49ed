"""The request path: ingress -> router -> prefill -> decode -> stream back to ingress."""

from __future__ import annotations

import msgspec

from shared.schema.base import Message


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    num_top_logprobs: int = 0


class GenerateRequest(Message, tag="generate_request"):
    """ingress -> router. Tokenized, block-hashed, with the inbox its stream goes to."""

    request_id: str
    model: str
    prompt_token_ids: bytes  # packed u32, see shared.schema.tokens
    block_hashes: bytes = b""  # packed u64, one per complete block of the prompt
    block_size_tokens: int = 64
    sampling: SamplingParams = SamplingParams()
    stream_inbox: str = ""
    api_key_id: str = ""
    cache_salt: str = ""  # tenant namespace of the block hashes
    arrival_ms: int = 0
    deadline_ms: int | None = None  # absolute epoch ms
    priority: int = 0


class RouteDecision(Message, tag="route_decision"):
    """router's choice for one request, kept in the jobs it forwards."""

    request_id: str
    prefill_worker_id: str
    decode_worker_id: str
    num_prompt_tokens: int
    num_cached_tokens: int
    has_swa_snapshot: bool = False
    estimated_ttft_ms: float = 0.0


class BlockLocation(msgspec.Struct, frozen=True, array_like=True):
    """Where one cached block lives. array_like: 1,200 of these ride in a 77K-token job."""

    block_hash: int
    tier: str
    file_id: int
    slot: int
    generation: int
    writer_id: str = ""  # whose files hold the slot (each writer owns its own files)
    num_bytes: int = 0


class PrefillJob(Message, tag="prefill_job"):
    """router -> the chosen prefill worker."""

    request: GenerateRequest
    decision: RouteDecision
    cached_blocks: tuple[BlockLocation, ...] = ()
    attempt: int = 0


class KvTransfer(msgspec.Struct, frozen=True, kw_only=True):
    """How the suffix KV and sliding-window state reach decode out of band (NIXL)."""

    agent_name: str
    num_tokens: int
    num_bytes: int
    descriptor: bytes = b""  # serialized NIXL transfer descriptors


class DecodeJob(Message, tag="decode_job"):
    """prefill (or router) -> the chosen decode worker."""

    request: GenerateRequest
    decision: RouteDecision
    cached_blocks: tuple[BlockLocation, ...] = ()
    first_token_id: int | None = None
    kv_transfer: KvTransfer | None = None


class TokenUsage(msgspec.Struct, frozen=True, kw_only=True):
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int


class TokenChunk(Message, tag="token_chunk"):
    """decode -> the caller's inbox. `seq` counts from 0; the last chunk has `final`."""

    request_id: str
    seq: int
    token_ids: bytes = b""  # packed u32
    text: str = ""  # incrementally detokenized delta
    logprobs: tuple[float, ...] = ()
    final: bool = False
    finish_reason: str | None = None  # stop | length | cancelled | error
    usage: TokenUsage | None = None
