"""The request path: ingress -> router -> prefill -> decode -> stream back to ingress."""

from __future__ import annotations

import msgspec
import numpy as np

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


class Resume(msgspec.Struct, frozen=True, kw_only=True):
    """A request continued after its decode worker died mid-stream (docs/design.md,
    "Decode failover"): its prompt is the original prompt and the tokens already delivered,
    its `max_tokens` what is left. What was delivered is billed once, in this request's
    record: prompt, hits and output counted as the original would have counted them."""

    num_prompt_tokens: int  # the original prompt's
    num_cached_tokens: int  # the original's hits, as billed
    num_output_tokens: int  # delivered before the failover (the prompt's last ones)
    num_output_chars: int = 0  # of text delivered (the detokenizer resumes there)
    attempt: int = 1  # 1 for the first continuation


class Eviction(msgspec.Struct, frozen=True, kw_only=True):
    """A block kv-index evicted (its tombstone, services/kv_index/tombstones.py): from which
    tier, why, when, and how long it had gone unused by then."""

    tier: str
    reason: str  # ttl | capacity | admin | removed (its writer logged the removal)
    evicted_ms: int  # epoch ms
    idle_s: float  # unused this long when evicted


class Pin(msgspec.Struct, frozen=True, array_like=True):
    """A prefix the client pinned (a `cache_control` breakpoint): its first `num_tokens`
    stay in the store for `ttl_s` seconds from when the request stored them."""

    num_tokens: int
    ttl_s: int


class CacheProbe(msgspec.Struct, frozen=True, kw_only=True):
    """ingress -> whoever writes the request's usage record: why its prompt will miss the
    cache, as far as that is known before it runs (services/ingress/diagnosis.py). A `cause`
    is a change against the session's previous turn, or `never_seen`; without one the prompt
    extends that turn, and whether all it sent came from the cache (`none`) or not
    (`not_cached`) waits for the count of the hit (`cause_for`)."""

    cause: str = ""
    part: str = ""  # where the prompt changed: system | tools | message:<i>
    span: str = ""  # for volatile_span: the kinds of span that changed (timestamp, nonce...)
    expected_cached_tokens: int = 0  # of the previous turn's, what could come from the cache
    # The router's: the tombstone of the prompt's first block the store lacked, if evicted.
    eviction: Eviction | None = None
    # Of the previous turn's prompt, the tokens a pin of it keeps in the store still.
    pinned_tokens: int = 0

    def cause_for(self, num_cached_tokens: int, window_replayed: bool = False) -> str:
        """`window_replayed`: prefill recomputed the sliding window at the cached prefix's end
        (no snapshot of it in reach): every token hit, yet the window's state had expired."""
        if self.cause:
            return self.cause
        if num_cached_tokens >= self.expected_cached_tokens:
            return "window_expired" if window_replayed and num_cached_tokens else "none"
        return "evicted" if self.eviction is not None else "not_cached"


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
    account: str = ""  # who is billed (ingress maps the API key to it)
    cache_salt: str = ""  # tenant namespace of the block hashes
    arrival_ms: int = 0
    deadline_ms: int | None = None  # absolute epoch ms
    priority: int = 0
    resume: Resume | None = None  # set on a continuation after a failover
    cache_probe: CacheProbe | None = None  # the cache-miss diagnosis, for the usage record
    pins: tuple[Pin, ...] = ()  # prefixes to keep in the store (cache_control), longest last
    # The caller's agent session, hashed with the account (`shared.client.session_digest`;
    # never the raw id): what the router's fair queueing charges a request's work to.
    session: str = ""

    @property
    def failover_attempt(self) -> int:
        """0 for a request, N for its Nth continuation after a decode failover."""
        return self.resume.attempt if self.resume is not None else 0


class StageRequest(Message, tag="stage_request"):
    """ingress -> the prefill worker that served a turn ending in a tool call (no reply):
    keep the session's blocks in the host tier, and its window at their end in the node's
    memcache, for `hold_s` (services/ingress/staging.py)."""

    request_id: str
    block_hashes: bytes  # packed u64: the turn's prompt, in order
    hold_s: float


class RouteDecision(Message, tag="route_decision"):
    """router's choice for one request, kept in the jobs it forwards."""

    request_id: str
    prefill_worker_id: str
    decode_worker_id: str
    num_prompt_tokens: int
    # The cached prefix the jobs restore, in whole blocks of `block_size_tokens` (never the
    # block holding the prompt's last token: see `RequestBlocks.num_prefill_blocks`).
    num_cached_blocks: int
    block_size_tokens: int = 64
    has_swa_snapshot: bool = False
    estimated_ttft_ms: float = 0.0
    # One worker does both (a vLLM worker): prefill_worker_id == decode_worker_id, and the
    # job goes to it whole, with no prefill job and no KV handoff.
    aggregated: bool = False
    # The tombstone of the prompt's first block no tier held, when kv-index evicted it.
    eviction: Eviction | None = None

    @property
    def num_cached_tokens(self) -> int:
        """The cached prefix in tokens (for usage and estimates; the workers count blocks)."""
        return self.num_cached_blocks * self.block_size_tokens


class BlockLocation(msgspec.Struct, frozen=True, array_like=True):
    """Where one cached block lives (one row of `BlockLocations`)."""

    block_hash: int
    tier: str
    file_id: int
    slot: int
    generation: int
    writer_id: str = ""  # whose files hold the slot (each writer owns its own files)
    num_bytes: int = 0


class BlockLocations(msgspec.Struct, frozen=True, kw_only=True):
    """Where each block of a cached prefix lives, as packed little-endian columns.

    Columns, not a struct per block: a 77K-token prompt has 1,200 blocks, and building or
    decoding 1,200 Python objects cost the kv-index ~1 ms per match (measured); packed
    columns are ~34 bytes a block on the wire and numpy views on arrival.
    """

    tier: str = "ssd"
    block_hashes: bytes = b""  # u64
    writer_ids: tuple[str, ...] = ()  # the writers `writers` points into
    writers: bytes = b""  # u16 index into writer_ids
    file_ids: bytes = b""  # u32
    slots: bytes = b""  # u32
    generations: bytes = b""  # u32
    num_bytes: bytes = b""  # u32

    def __len__(self) -> int:
        return len(self.block_hashes) // 8

    def columns(self) -> dict[str, np.ndarray]:
        return {
            "block_hash": np.frombuffer(self.block_hashes, "<u8"),
            "writer": np.frombuffer(self.writers, "<u2"),
            "file_id": np.frombuffer(self.file_ids, "<u4"),
            "slot": np.frombuffer(self.slots, "<u4"),
            "generation": np.frombuffer(self.generations, "<u4"),
            "num_bytes": np.frombuffer(self.num_bytes, "<u4"),
        }

    def rows(self) -> list[BlockLocation]:
        c = self.columns()
        return [
            BlockLocation(h, self.tier, f, s, g, self.writer_ids[w], n)
            for h, w, f, s, g, n in zip(
                c["block_hash"].tolist(),
                c["writer"].tolist(),
                c["file_id"].tolist(),
                c["slot"].tolist(),
                c["generation"].tolist(),
                c["num_bytes"].tolist(),
                strict=True,
            )
        ]

    @classmethod
    def from_columns(
        cls, tier: str, writer_ids: tuple[str, ...], columns: dict[str, np.ndarray]
    ) -> BlockLocations:
        return cls(
            tier=tier,
            block_hashes=columns["block_hash"].astype("<u8").tobytes(),
            writer_ids=writer_ids,
            writers=columns["writer"].astype("<u2").tobytes(),
            file_ids=columns["file_id"].astype("<u4").tobytes(),
            slots=columns["slot"].astype("<u4").tobytes(),
            generations=columns["generation"].astype("<u4").tobytes(),
            num_bytes=columns["num_bytes"].astype("<u4").tobytes(),
        )


class PrefillJob(Message, tag="prefill_job"):
    """router -> the chosen prefill worker."""

    request: GenerateRequest
    decision: RouteDecision
    cached_blocks: BlockLocations = BlockLocations()
    attempt: int = 0
    # The router's priority class for the job, 0 first (services/router/sessions.py): what
    # a worker with `--queue-policy fair` orders its queue by.
    queue_level: int = 0


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
    cached_blocks: BlockLocations = BlockLocations()
    # Not set by any sender: the router sends this job before prefill runs, so the first
    # token and the KV reach decode in `SuffixReady`. Kept for the wire's sake.
    first_token_id: int | None = None
    kv_transfer: KvTransfer | None = None


class JobAccepted(Message, tag="job_accepted"):
    """prefill or decode -> router: the job is queued on this worker."""

    request_id: str
    instance_id: str


class PrefillTimings(msgspec.Struct, frozen=True, kw_only=True):
    """Where one request's prefill time went (milliseconds), reported back to the caller."""

    queue_ms: float = 0.0  # accepted -> first chunk computed
    load_ms: float = 0.0  # the cached prefix's full-layer KV read from the store
    restore_ms: float = 0.0  # the sliding-window state: memcache get, or replay
    swa_restore: str = ""  # snapshot | exact | bounded | none (nothing cached)
    num_replay_tokens: int = 0
    compute_ms: float = 0.0  # the uncached suffix
    store_ms: float = 0.0  # new complete blocks written to the store
    transfer_ms: float = 0.0  # staged for decode -> decode pulled it (NIXL)
    # Of the cached prefix's blocks, the leading ones prefill's own pool still held from an
    # earlier job (the device tier): not read from the store.
    num_local_blocks: int = 0


class SuffixReady(Message, tag="suffix_ready"):
    """prefill -> the decode worker holding the job: the suffix KV lies staged in prefill's
    NIXL region; decode pulls it and replies `JobAccepted`, after which prefill reuses the
    staging. The staged bytes are `num_blocks` whole pages (blocks `first_block_index`..) of
    `block_nbytes` each, then the sliding-window snapshot (`window_nbytes`) at
    `num_computed_tokens`.

    The model's prefill computes the whole prompt and samples the first output token from
    the last token's logits (`first_token_id`; `sampler_state`: its torch generator's state
    after that draw, empty when greedy), so decode streams that token as soon as it holds
    the pages and its first step is already a decode step. Without `first_token_id` (the
    mock prefill) `num_computed_tokens` is every prompt token but the last, which decode
    computes."""

    request_id: str
    attempt: int
    prefill_worker_id: str
    num_computed_tokens: int
    first_block_index: int
    num_blocks: int
    block_nbytes: int
    region_offset: int
    window_nbytes: int
    timings: PrefillTimings = PrefillTimings()
    first_token_id: int | None = None
    sampler_state: bytes = b""


class PrefillDone(Message, tag="prefill_done"):
    """prefill -> router, once decode holds the suffix: the router's retry window closes."""

    request_id: str
    timings: PrefillTimings = PrefillTimings()


class CancelRequest(Message, tag="cancel_request"):
    """Anyone -> every worker (broadcast): stop work on this request. With `error_code` the
    decode worker ends the stream with that error instead of finish_reason "cancelled"."""

    request_id: str
    reason: str = "cancelled"
    error_code: str = ""
    error_message: str = ""


class TokenUsage(msgspec.Struct, frozen=True, kw_only=True):
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int


class DecodeStats(msgspec.Struct, frozen=True, kw_only=True):
    """The final chunk's account of one request's decode (milliseconds)."""

    prefill: PrefillTimings = PrefillTimings()
    prefix_load_ms: float = 0.0  # decode's own read of the cached prefix from the store
    ttft_ms: float = 0.0  # decode accepted the job -> first token sent
    decode_ms: float = 0.0  # first token -> last token
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    num_forward_passes: int = 0


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
    stats: DecodeStats | None = None  # on the final chunk
    stop_sequence: str | None = None  # final chunk: the stop string that ended the output
