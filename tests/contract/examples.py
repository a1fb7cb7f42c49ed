"""One fixed example of every wire message; their encodings are committed as golden bytes.

`python -m tests.contract.examples --write` rewrites tests/contract/golden/ after an
intentional, compatible schema change (new fields with defaults). Review the diff.
"""

from __future__ import annotations

import sys
from pathlib import Path

from shared.schema import (
    AllBlocksCleared,
    AuditRecord,
    BlockLocations,
    BlocksPinned,
    BlocksRemoved,
    BlocksStored,
    CacheCommand,
    CacheProbe,
    CacheStats,
    CancelRequest,
    DeadLetter,
    DecodeJob,
    DecodeStats,
    DrainAccepted,
    DrainRequest,
    ErrorCode,
    ErrorReply,
    Eviction,
    GenerateRequest,
    InflightNotice,
    InstanceState,
    JobAccepted,
    KvEventBatch,
    KvTransfer,
    LimitUse,
    LoadReport,
    MatchReply,
    MatchRequest,
    Message,
    OpenStreams,
    Pin,
    PrefillDone,
    PrefillJob,
    PrefillTimings,
    RebuildBatch,
    RebuildReply,
    Resume,
    ResyncRequest,
    RouteDecision,
    SamplingParams,
    StageRequest,
    StoredBlock,
    SuffixReady,
    SwaContains,
    SwaContainsReply,
    SwaGet,
    SwaGetReply,
    SwaHeld,
    SwaHold,
    SwaNixlRef,
    SwaPut,
    SwaPutReply,
    SwaRelease,
    SwaResync,
    TierMatch,
    TokenChunk,
    TokenUsage,
    UsageRecord,
    UsageStatus,
    encode,
    pack_block_hashes,
    pack_token_ids,
)
from shared.schema.kv_index import (
    HOLD_DEVICE,
    HOLD_HOST,
    HolderMatch,
    HoldingsSync,
    HoldingsUpdate,
)
from shared.schema.transfer import NixlAgentInfo, NixlMetadataRequest, NixlRegion

GOLDEN_DIR = Path(__file__).parent / "golden"

_request = GenerateRequest(
    request_id="req-0001",
    model="tiny-coder",
    prompt_token_ids=pack_token_ids([0, 1, 2, 65_535, 128_000]),
    block_hashes=pack_block_hashes([0x0123456789ABCDEF, 2**64 - 1]),
    block_size_tokens=64,
    sampling=SamplingParams(
        max_tokens=32,
        temperature=0.7,
        top_p=0.9,
        top_k=40,
        seed=7,
        stop_token_ids=(1,),
        stop=("\n\n",),
        logprobs=True,
        num_top_logprobs=2,
    ),
    stream_inbox="_INBOX.abc",
    api_key_id="key-1",
    account="acme",
    cache_salt="tenant-a",
    arrival_ms=1_790_000_000_000,
    deadline_ms=1_790_000_030_000,
    priority=1,
    resume=Resume(
        num_prompt_tokens=3, num_cached_tokens=0, num_output_tokens=2, num_output_chars=9
    ),
    cache_probe=CacheProbe(cause="earlier_turn_edited", part="message:3", pinned_tokens=64),
    pins=(Pin(128, 3600), Pin(320, 300)),
    session="5f2c8a1b9d3e4f60",
)
_eviction = Eviction(tier="ssd", reason="capacity", evicted_ms=1_789_999_000_000, idle_s=3600.5)
_decision = RouteDecision(
    request_id="req-0001",
    prefill_worker_id="prefill-0",
    decode_worker_id="decode-1",
    num_prompt_tokens=5,
    num_cached_blocks=0,
    has_swa_snapshot=True,
    estimated_ttft_ms=12.5,
    eviction=_eviction,
)
_blocks = BlockLocations(
    tier="ssd",
    block_hashes=pack_block_hashes([0x0123456789ABCDEF, 2]),
    writer_ids=("prefill-0", "decode-3"),
    writers=b"\x00\x00\x01\x00",
    file_ids=b"\x03\x00\x00\x00\x00\x00\x00\x00",
    slots=b"\x11\x00\x00\x00\x05\x00\x00\x00",
    generations=b"\x02\x00\x00\x00\x01\x00\x00\x00",
    num_bytes=b"\x00\x80\x01\x00\x00\x80\x01\x00",
)

_TIMINGS = PrefillTimings(
    queue_ms=1.0,
    load_ms=2.0,
    restore_ms=0.5,
    swa_restore="snapshot",
    num_replay_tokens=0,
    compute_ms=12.0,
    store_ms=3.0,
    transfer_ms=0.7,
)

EXAMPLES: dict[str, Message] = {
    "GenerateRequest": _request,
    "RouteDecision": _decision,
    "PrefillJob": PrefillJob(
        request=_request, decision=_decision, cached_blocks=_blocks, attempt=1, queue_level=2
    ),
    "DecodeJob": DecodeJob(
        request=_request,
        decision=_decision,
        cached_blocks=_blocks,
        first_token_id=42,
        kv_transfer=KvTransfer(
            agent_name="prefill-0", num_tokens=5, num_bytes=4096, descriptor=b"\x01\x02"
        ),
    ),
    "TokenChunk": TokenChunk(
        request_id="req-0001",
        seq=3,
        token_ids=pack_token_ids([42, 43]),
        text="def f",
        logprobs=(-0.25, -1.5),
        final=True,
        finish_reason="stop",
        usage=TokenUsage(num_prompt_tokens=5, num_cached_tokens=0, num_output_tokens=4),
        stats=DecodeStats(
            prefill=_TIMINGS,
            prefix_load_ms=1.5,
            ttft_ms=30.0,
            decode_ms=80.0,
            num_draft_tokens=6,
            num_accepted_draft_tokens=4,
            num_forward_passes=3,
        ),
    ),
    "InflightNotice": InflightNotice(
        router_id="router-0", instance_id="prefill-1", num_tokens=320, num_kv_pages=0, queue_level=1
    ),
    "JobAccepted": JobAccepted(request_id="req-0001", instance_id="decode-0"),
    "SuffixReady": SuffixReady(
        request_id="req-0001",
        attempt=1,
        prefill_worker_id="prefill-0",
        num_computed_tokens=130,
        first_block_index=1,
        num_blocks=2,
        block_nbytes=4096,
        region_offset=8192,
        window_nbytes=1024,
        timings=_TIMINGS,
        first_token_id=4021,
        sampler_state=b"\x07\x00\x00\x00",
    ),
    "PrefillDone": PrefillDone(request_id="req-0001", timings=_TIMINGS),
    "DrainRequest": DrainRequest(grace_s=30.0),
    "DrainAccepted": DrainAccepted(instance_id="decode-0", num_in_flight=3),
    "LimitUse": LimitUse(
        replica="ingress-0",
        uses=[
            ("key:key_0123456789ab", "requests", 1.0, 1767225600.25),
            ("account:acme", "output_tokens", -96.0, 1767225601.5),
        ],
    ),
    "OpenStreams": OpenStreams(replica="ingress-1", open={"account:acme": 3}),
    "AuditRecord": AuditRecord(
        ts_ms=1767225600250,
        actor="ops@ctl-1 (nkey UDXU4RCSJNZOIQHZNWXHXORDPRTGNJAHAHFRGZNEEJCPQTT2M7NLCNF4)",
        action="keys.revoke",
        target="key_0123456789ab",
        outcome="ok",
        detail={"account": "acme"},
    ),
    "CancelRequest": CancelRequest(
        request_id="req-0001",
        reason="decode worker lost",
        error_code="UNAVAILABLE",
        error_message="decode-0 stopped",
    ),
    "KvEventBatch": KvEventBatch(
        writer_id="prefill-0",
        seq=9,
        ts_ms=1_790_000_000_123,
        events=(
            BlocksStored(
                tier="ssd",
                blocks=(
                    StoredBlock(
                        block_hash=0x0123456789ABCDEF,
                        file_id=3,
                        slot=17,
                        generation=2,
                        num_bytes=65_536,
                    ),
                ),
                parent_block_hash=None,
            ),
            BlocksRemoved(tier="ssd", block_hashes=pack_block_hashes([5, 6]), reason="ttl"),
            AllBlocksCleared(tier="dram"),
            BlocksPinned(
                tier="ssd", block_hashes=pack_block_hashes([5]), until_ms=1_790_000_300_000
            ),
        ),
    ),
    "UsageRecord": UsageRecord(
        request_id="req-0001",
        api_key_id="key-1",
        model="tiny-coder",
        num_cache_hit_tokens=73_920,
        num_cache_miss_tokens=3_080,
        num_output_tokens=412,
        status=UsageStatus.CANCELLED,
        finish_reason="cancelled",
        started_ms=1_790_000_000_000,
        finished_ms=1_790_000_004_000,
        prefill_worker_id="prefill-0",
        decode_worker_id="decode-1",
        account="acme",
        cache_miss_cause="earlier_turn_edited",
        num_cache_write_tokens=2_048,
        pin_ttl_s=3600,
    ),
    "DeadLetter": DeadLetter(
        subject="kvf.v1.usage.decode",
        stream_seq=42,
        reason="not a UsageRecord: missing field `model`",
        data=b"\x81\xa4type\xacusage_record",
        dead_ms=1_790_000_005_000,
    ),
    "LoadReport": LoadReport(
        service="decode",
        instance_id="decode-1",
        seq=12,
        ts_ms=1_790_000_000_500,
        state=InstanceState.DRAINING,
        node_id="node-a",
        num_inflight=3,
        num_queued=2,
        num_queued_tokens=9000,
        num_running=8,
        num_kv_pages_total=4096,
        num_kv_pages_free=1024,
        model="SmolLM2-135M-Instruct",
        num_queued_tokens_by_level=(4000, 5000, 0, 0, 0),
    ),
    "StageRequest": StageRequest(
        request_id="req-0001", block_hashes=pack_block_hashes([1, 2**64 - 1]), hold_s=180.0
    ),
    "SwaHold": SwaHold(block_hashes=pack_block_hashes([7, 8]), until_ms=1_790_000_180_000),
    "MatchRequest": MatchRequest(block_hashes=pack_block_hashes([1, 2**64 - 1]), refresh=False),
    "MatchReply": MatchReply(
        shard_id=1,
        num_shards=2,
        tiers=(
            TierMatch(
                tier="ssd",
                first_miss_index=3,
                indices=pack_token_ids([1]),
                locations=_blocks,
                evicted=_eviction,
            ),
        ),
        first_owned_index=1,
        holders=(HolderMatch(holder="prefill-0", first_miss_index=3, first_device_miss_index=1),),
    ),
    "HoldingsUpdate": HoldingsUpdate(
        holder="prefill-0",
        epoch=1234,
        seq=7,
        block_hashes=pack_block_hashes([5, 2**64 - 1]),
        masks=bytes([HOLD_DEVICE, HOLD_DEVICE | HOLD_HOST]),
        digests={2: [(1, 5), (1, 9)]},
    ),
    "HoldingsSync": HoldingsSync(shard_id=1, num_shards=2),
    "RebuildBatch": RebuildBatch(
        tier="ssd",
        writer_id="prefill-3",
        blocks=(StoredBlock(block_hash=9, file_id=0, slot=4, generation=1 << 20, num_bytes=4096),),
        is_last=True,
    ),
    "RebuildReply": RebuildReply(num_indexed=1),
    "ResyncRequest": ResyncRequest(writer_id="prefill-0", expected_seq=10, received_seq=12),
    "CacheCommand": CacheCommand(action="evict", tier="ssd", fraction=0.25),
    "CacheStats": CacheStats(
        shard_id=0,
        instance_id="kv-index-0",
        tiers={"ssd": {"num_blocks": 12, "used_bytes": 1_179_648}},
        counters={"num_gaps": 1},
    ),
    "SwaGet": SwaGet(block_hash=2**64 - 1),
    "SwaGetReply": SwaGetReply(found=True, snapshot=b"KVFSWA1\x00..."),
    "SwaPut": SwaPut(block_hash=7, snapshot=b"\x00\x01"),
    "SwaPutReply": SwaPutReply(stored=False),
    "SwaGetNixl": SwaGet(block_hash=7, can_read_nixl=True),
    "SwaGetReplyLeased": SwaGetReply(
        found=True,
        location=SwaNixlRef("swa-memcache", "swa-memcache-node0", 1 << 21, 2_621_440, 2**64 - 3),
        lease_id=42,
        lease_s=5.0,
    ),
    "SwaPutNixl": SwaPut(
        block_hash=7,
        snapshot=b"",
        source=SwaNixlRef("prefill", "prefill-0", 0, 2_621_440, 0x0123456789ABCDEF),
    ),
    "SwaPutReplyRefused": SwaPutReply(stored=False, reason="checksum mismatch"),
    "SwaRelease": SwaRelease(lease_id=42),
    "SwaContains": SwaContains(block_hashes=pack_block_hashes([7, 8])),
    "SwaContainsReply": SwaContainsReply(found=b"\x01\x00"),
    "SwaHeld": SwaHeld(
        instance_id="swa-memcache-node0",
        node_id="node0",
        seq=1_733_040_000_000_001,
        added=pack_block_hashes([7, 2**64 - 1]),
        removed=pack_block_hashes([8]),
    ),
    "SwaHeldFull": SwaHeld(
        instance_id="swa-memcache-node0",
        node_id="node0",
        seq=1_733_040_000_000_002,
        is_full=True,
        added=pack_block_hashes([7]),
    ),
    "SwaResync": SwaResync(instance_id="swa-memcache-node0", reason="seq gap"),
    "SwaResyncAll": SwaResync(reason="router started"),
    "NixlMetadataRequest": NixlMetadataRequest(requester_agent="prefill-prefill-0"),
    "NixlAgentInfo": NixlAgentInfo(
        agent_name="decode-decode-0",
        metadata=b"\x00nixl-md",
        regions=(NixlRegion(addr=0x7F0000000000, num_bytes=1 << 30),),
    ),
    "ErrorReply": ErrorReply(
        code=ErrorCode.OVERLOADED, message="queues full", request_id="req-0001", retry_after_s=2.0
    ),
}


def write_golden() -> None:
    GOLDEN_DIR.mkdir(exist_ok=True)
    for name, message in EXAMPLES.items():
        (GOLDEN_DIR / f"{name}.msgpack").write_bytes(encode(message))


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python -m tests.contract.examples --write")
    write_golden()
