"""The shipped trace and its synthetic prompts (loadtest/trace/synth.py): loading with a
clear error per bad line, tokens from the hash id alone, prefix sharing exactly as the trace
says (in tokens and in kvfabric's 64-token block hashes), cutting and time scaling."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from loadtest.trace.synth import (
    DEFAULT_TRACE,
    TRACE_BLOCK_TOKENS,
    PromptHashes,
    TraceError,
    TraceRequest,
    arrivals_s,
    block_token_ids,
    load_trace,
    prompt_token_ids,
)
from shared.blocks import RequestBlocks
from shared.client import build_request
from shared.schema import unpack_block_hashes

MODEL = "tiny-coder"
VOCAB = 8192  # tiny-coder's
WIDE_VOCAB = 1 << 31  # two different ids' blocks never start with the same token by chance


@pytest.fixture(scope="module")
def trace() -> list[TraceRequest]:
    return load_trace(limit=2000)


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


def _shared_ids(a: TraceRequest, b: TraceRequest) -> int:
    k = 0
    while k < min(len(a.hash_ids), len(b.hash_ids)) and a.hash_ids[k] == b.hash_ids[k]:
        k += 1
    return k


def test_the_shipped_trace_is_whole_and_matches_its_readme() -> None:
    full = load_trace()
    assert len(full) == 12_031
    assert full[0] == TraceRequest(0, 0, 6758, 500, tuple(range(14)))
    assert [r.index for r in full[:5]] == [0, 1, 2, 3, 4]
    assert full[-1].timestamp_ms == 3_536_999
    # The README's figure: 36.6% of the input blocks repeat an earlier request's block.
    seen: set[int] = set()
    repeats = 0
    for r in full:
        repeats += sum(h in seen for h in r.hash_ids)
        seen.update(r.hash_ids)
    assert round(repeats / sum(len(r.hash_ids) for r in full), 3) == 0.366
    assert load_trace(limit=100) == full[:100]


def test_a_plain_jsonl_file_loads_like_the_gzipped_one(tmp_path: Path) -> None:
    with gzip.open(DEFAULT_TRACE, "rt") as f:
        lines = [next(f) for _ in range(50)]
    plain = tmp_path / "trace.jsonl"
    plain.write_text("".join(lines) + "\n")  # a trailing blank line is allowed
    assert load_trace(plain) == load_trace(limit=50)


GOOD = {"timestamp": 5, "input_length": 600, "output_length": 3, "hash_ids": [0, 1]}


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "not JSON"),
        ("[1, 2]", "expected a JSON object, got list"),
        (
            json.dumps({k: v for k, v in GOOD.items() if k != "hash_ids"}),
            "missing field(s) hash_ids",
        ),
        (json.dumps(GOOD | {"input_length": -1}), "input_length must be a non-negative integer"),
        (json.dumps(GOOD | {"input_length": 0}), "input_length must be > 0"),
        (json.dumps(GOOD | {"output_length": True}), "output_length must be a non-negative"),
        (json.dumps(GOOD | {"timestamp": 1.5}), "timestamp must be a non-negative integer"),
        (json.dumps(GOOD | {"hash_ids": [0, "1"]}), "hash_ids must be a list of integers"),
        (json.dumps(GOOD | {"hash_ids": [0]}), "1 hash_ids for input_length 600: expected 2"),
        (json.dumps(GOOD | {"timestamp": 4}), "timestamp 4 before the previous line's 5"),
        (json.dumps(GOOD | {"hash_ids": [7, 1]}), "hash id 1 at block 1 after 7"),
    ],
)
def test_a_bad_line_is_named_with_what_is_wrong(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(GOOD) + "\n" + line + "\n")
    with pytest.raises(TraceError) as caught:
        load_trace(path)
    assert message in str(caught.value)
    if "hash id 1 at block 1" not in message:  # the chain check names requests, not lines
        assert str(caught.value).startswith(f"{path}:2: ")


def test_an_empty_trace_and_a_bad_limit_are_errors(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(TraceError, match="no requests"):
        load_trace(empty)
    with pytest.raises(ValueError, match="limit must be > 0"):
        load_trace(limit=0)


def test_block_tokens_are_a_function_of_the_id_alone() -> None:
    # Pinned: figures recorded from this trace stay comparable only if the tokens do.
    assert block_token_ids([0, 1], VOCAB)[:, :6].tolist() == [
        [3503, 7361, 5838, 4077, 2762, 858],
        [1126, 5145, 3290, 762, 3852, 2235],
    ]
    together = block_token_ids([5, 9, 5], VOCAB)
    assert together.shape == (3, TRACE_BLOCK_TOKENS) and together.dtype == np.uint32
    assert np.array_equal(together[0], together[2])
    assert np.array_equal(together[1], block_token_ids([9], VOCAB)[0])
    assert not np.array_equal(together[0], together[1])
    assert int(together.max()) < VOCAB
    wide = block_token_ids(range(1000), WIDE_VOCAB)
    assert len(set(wide[:, 0].tolist())) == 1000  # every id starts differently
    with pytest.raises(ValueError, match="hash ids must be in"):
        block_token_ids([-1], VOCAB)
    with pytest.raises(ValueError, match="vocab_size must be > 0"):
        block_token_ids([1], 0)


def test_prompts_share_exactly_the_blocks_their_ids_share(trace: list[TraceRequest]) -> None:
    """Over every pair among the first 300 requests: with k leading ids equal, the prompts
    share exactly min(512 k, both lengths) tokens, and their 64-token block hashes agree on
    exactly the complete blocks inside that."""
    prompts = PromptHashes(MODEL, WIDE_VOCAB)
    sample = trace[:300]
    tokens = [prompt_token_ids(r, WIDE_VOCAB) for r in sample]
    hashes = [prompts.hasher.hashes(t) for t in tokens]
    num_deep = 0
    for i, a in enumerate(sample):
        for j in range(i + 1, len(sample)):
            b = sample[j]
            k = _shared_ids(a, b)
            expected = min(TRACE_BLOCK_TOKENS * k, a.input_length, b.input_length)
            assert _common_prefix(tokens[i], tokens[j]) == expected, (a.index, b.index)
            ha, hb = (np.array(h, dtype=np.uint64) for h in (hashes[i], hashes[j]))
            assert _common_prefix(ha, hb) == expected // 64
            num_deep += k >= 2
    assert num_deep > 0  # some pairs share more than the common first block


def test_prompt_hashes_are_what_the_caller_would_compute(trace: list[TraceRequest]) -> None:
    prompts = PromptHashes(MODEL, VOCAB)
    sample = [*trace[:40], *(r.cut(1000) for r in trace[40:60]), trace[1999]]
    partial = [r for r in sample if r.input_length % TRACE_BLOCK_TOKENS]
    assert partial and any(r.input_length % 64 for r in partial)
    for request in sample:
        ids = prompt_token_ids(request, VOCAB)
        assert len(ids) == request.input_length
        built = build_request(ids, model=MODEL, block_size_tokens=64)
        from_request = unpack_block_hashes(built.block_hashes).tolist()
        assert prompts.hashes(request) == from_request
        blocks = prompts.blocks(request)
        assert (
            blocks.hashes
            == RequestBlocks.hash_prompt(ids, model=MODEL, block_size_tokens=64).hashes
        )
        assert blocks.num_prompt_tokens == request.input_length
    with pytest.raises(ValueError, match="must divide 512"):
        PromptHashes(MODEL, VOCAB, block_size_tokens=48)


def test_cutting_keeps_the_prefix(trace: list[TraceRequest]) -> None:
    long = max(trace, key=lambda r: r.input_length)
    cut = long.cut(5000)
    assert (cut.input_length, len(cut.hash_ids)) == (5000, 10)
    assert cut.hash_ids == long.hash_ids[:10] and cut.output_length == long.output_length
    assert np.array_equal(prompt_token_ids(cut, VOCAB), prompt_token_ids(long, VOCAB)[:5000])
    assert long.cut(long.input_length) is long
    with pytest.raises(ValueError, match="max_input_tokens must be > 0"):
        long.cut(0)


def test_time_scaling(trace: list[TraceRequest]) -> None:
    later = trace[100:200]
    at_1x, at_4x = arrivals_s(later), arrivals_s(later, speed=4.0)
    assert at_1x[0] == at_4x[0] == 0.0  # from the first request replayed
    assert at_1x[-1] == (later[-1].timestamp_ms - later[0].timestamp_ms) / 1000
    assert at_4x == pytest.approx([t / 4 for t in at_1x])
    assert at_1x == sorted(at_1x)
    with pytest.raises(ValueError, match="speed must be > 0"):
        arrivals_s(later, speed=0)
