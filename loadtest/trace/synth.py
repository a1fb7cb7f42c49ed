"""A request trace (loadtest/data/README.md) and the synthetic prompts that replay it.

The trace names each 512-token block of a prompt by a hash id and carries no tokens. Here
each id becomes 512 token ids computed from the id alone (splitmix64 of id x 512 + position,
modulo the vocabulary), and a prompt is its ids' blocks concatenated and cut to
`input_length`. Two requests therefore share exactly the prefix blocks the trace says they
share, and kvfabric's own 64-token chained block hashes (`BlockHasher`) agree on exactly
those blocks.

`PromptHashes` gives a request's 64-token block hashes without building its prompt: ids are
chained (an id always follows the same id), so each id's eight block hashes are computed
once and reused by every request holding it; `load_trace` checks that property. The full
trace has 183K distinct ids against 1.4M occurrences.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shared.blocks import RequestBlocks
from shared.schema.tokens import pack_token_ids

TRACE_BLOCK_TOKENS = 512
DEFAULT_TRACE = Path(__file__).resolve().parents[1] / "data" / "conversation_trace.jsonl.gz"
_MAX_HASH_ID = 1 << 54  # id x 512 + position must fit in 64 bits


class TraceError(ValueError):
    """A trace line that is not a well-formed request (the message names file and line)."""


@dataclass(frozen=True)
class TraceRequest:
    index: int  # position in the trace, from 0
    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    def block_tokens(self, position: int) -> int:
        """Tokens of the prompt in trace block `position` (512 but for a partial last one)."""
        return min(TRACE_BLOCK_TOKENS, self.input_length - TRACE_BLOCK_TOKENS * position)

    def cut(self, max_input_tokens: int) -> TraceRequest:
        """The same request with its prompt cut to at most `max_input_tokens` (a prefix of
        the original, so what it shares with others stays shared up to the cut)."""
        if max_input_tokens <= 0:
            raise ValueError(f"max_input_tokens must be > 0, got {max_input_tokens}")
        if self.input_length <= max_input_tokens:
            return self
        num_blocks = math.ceil(max_input_tokens / TRACE_BLOCK_TOKENS)
        return dataclasses.replace(
            self, input_length=max_input_tokens, hash_ids=self.hash_ids[:num_blocks]
        )


_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_line(line: str, index: int) -> TraceRequest:
    """One trace line; ValueError saying what is wrong with it."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(row, dict):
        raise ValueError(f"expected a JSON object, got {type(row).__name__}")
    missing = [name for name in _FIELDS if name not in row]
    if missing:
        raise ValueError(f"missing field(s) {', '.join(missing)}")
    for name in ("timestamp", "input_length", "output_length"):
        if not _is_int(row[name]) or row[name] < 0:
            raise ValueError(f"{name} must be a non-negative integer, got {row[name]!r}")
    if row["input_length"] == 0:
        raise ValueError("input_length must be > 0")
    ids = row["hash_ids"]
    if not isinstance(ids, list) or not all(_is_int(i) and 0 <= i < _MAX_HASH_ID for i in ids):
        raise ValueError(f"hash_ids must be a list of integers in [0, 2**54), got {ids!r:.80}")
    expected = math.ceil(row["input_length"] / TRACE_BLOCK_TOKENS)
    if len(ids) != expected:
        raise ValueError(
            f"{len(ids)} hash_ids for input_length {row['input_length']}: expected {expected} "
            f"(one per {TRACE_BLOCK_TOKENS}-token block)"
        )
    return TraceRequest(
        index, row["timestamp"], row["input_length"], row["output_length"], tuple(ids)
    )


def load_trace(path: Path = DEFAULT_TRACE, limit: int | None = None) -> list[TraceRequest]:
    """The first `limit` requests (all when None) of a JSONL trace, gzipped or not; a
    TraceError naming the line for the first malformed one."""
    if limit is not None and limit <= 0:
        raise ValueError(f"limit must be > 0, got {limit}")
    requests: list[TraceRequest] = []
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as lines:
        for line_no, line in enumerate(lines, start=1):
            if limit is not None and len(requests) == limit:
                break
            if not line.strip():
                continue
            try:
                request = parse_line(line, len(requests))
                if requests and request.timestamp_ms < requests[-1].timestamp_ms:
                    raise ValueError(
                        f"timestamp {request.timestamp_ms} before the previous line's "
                        f"{requests[-1].timestamp_ms}: a trace is in arrival order"
                    )
            except ValueError as exc:
                raise TraceError(f"{path}:{line_no}: {exc}") from None
            requests.append(request)
    if not requests:
        raise TraceError(f"{path}: no requests")
    check_chained(requests, str(path))
    return requests


def check_chained(requests: Iterable[TraceRequest], source: str = "trace") -> None:
    """TraceError unless every hash id always stands at the same position after the same id
    (what "equal ids mean an equal prefix" requires, and what `PromptHashes` relies on)."""
    seen: dict[int, tuple[int, int | None]] = {}
    for request in requests:
        parent = None
        for position, hash_id in enumerate(request.hash_ids):
            place = seen.setdefault(hash_id, (position, parent))
            if place != (position, parent):
                raise TraceError(
                    f"{source}: request {request.index} has hash id {hash_id} at block "
                    f"{position} after {parent}; an earlier one at block {place[0]} after "
                    f"{place[1]} (ids must name their whole prefix)"
                )
            parent = hash_id


# -- time ------------------------------------------------------------------------------------
def arrivals_s(requests: Sequence[TraceRequest], speed: float = 1.0) -> list[float]:
    """Each request's arrival in seconds after the first's, replayed at `speed` x."""
    if not speed > 0:
        raise ValueError(f"speed must be > 0, got {speed}")
    if not requests:
        return []
    start = requests[0].timestamp_ms
    return [(r.timestamp_ms - start) / 1000.0 / speed for r in requests]


# -- tokens ----------------------------------------------------------------------------------
_SPLITMIX = (
    np.uint64(0x9E3779B97F4A7C15),
    np.uint64(0xBF58476D1CE4E5B9),
    np.uint64(0x94D049BB133111EB),
)
_POSITIONS = np.arange(TRACE_BLOCK_TOKENS, dtype=np.uint64)


def block_token_ids(hash_ids: Sequence[int], vocab_size: int) -> np.ndarray:
    """The 512 token ids (uint32) of each trace block in `hash_ids`, one row per id: a
    function of the id alone. Vectorized over the ids (one id at a time costs ~50 us of
    numpy call overhead, measured)."""
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be > 0, got {vocab_size}")
    ids = np.asarray(hash_ids, dtype=np.int64).reshape(-1, 1)
    if ids.size and not (ids.min() >= 0 and ids.max() < _MAX_HASH_ID):
        raise ValueError("hash ids must be in [0, 2**54)")
    z = (ids.astype(np.uint64) << np.uint64(9)) + _POSITIONS + _SPLITMIX[0]
    z = (z ^ (z >> np.uint64(30))) * _SPLITMIX[1]
    z = (z ^ (z >> np.uint64(27))) * _SPLITMIX[2]
    z ^= z >> np.uint64(31)
    return (z % np.uint64(vocab_size)).astype(np.uint32)


def prompt_token_ids(request: TraceRequest, vocab_size: int) -> np.ndarray:
    """The request's synthetic prompt: its blocks' tokens, cut to `input_length`."""
    return block_token_ids(request.hash_ids, vocab_size).reshape(-1)[: request.input_length]


class PromptHashes:
    """kvfabric's 64-token block hashes of synthetic prompts (the ones `build_request` would
    compute from `prompt_token_ids`), each trace id hashed once."""

    def __init__(self, model: str, vocab_size: int, block_size_tokens: int = 64) -> None:
        if TRACE_BLOCK_TOKENS % block_size_tokens:
            raise ValueError(
                f"block_size_tokens {block_size_tokens} must divide {TRACE_BLOCK_TOKENS}"
            )
        self.hasher = RequestBlocks.namespace(model, block_size_tokens)
        self.vocab_size = vocab_size
        self._of_id: dict[int, list[int]] = {}  # trace id -> its blocks' chained hashes

    @property
    def block_size(self) -> int:
        return self.hasher.block_size_tokens

    def hashes(self, request: TraceRequest) -> list[int]:
        """The hashes of every complete block of the request's prompt."""
        new_ids = [h for h in request.hash_ids if h not in self._of_id]
        packed = pack_token_ids(block_token_ids(new_ids, self.vocab_size))
        stride = 4 * TRACE_BLOCK_TOKENS
        tokens = {h: packed[i * stride : (i + 1) * stride] for i, h in enumerate(new_ids)}
        out: list[int] = []
        parent = 0
        for position, hash_id in enumerate(request.hash_ids):
            chain = self._of_id.get(hash_id)
            if chain is None:
                chain = self.hasher.hashes(tokens[hash_id], parent_hash=parent)
                self._of_id[hash_id] = chain
            out += chain[: request.block_tokens(position) // self.block_size]
            parent = chain[-1]
        return out

    def blocks(self, request: TraceRequest) -> RequestBlocks:
        """The request's block layout, as its caller would have hashed it."""
        return RequestBlocks(self.hasher, request.input_length, self.hashes(request))


def upper_bound_hits(requests: Sequence[TraceRequest], block_size: int = 64) -> list[int]:
    """Each request's cached tokens with one unlimited cache that already holds every block
    of every earlier request: its longest prefix of complete `block_size` blocks seen
    before, capped at the blocks before its last token (what a job may reuse). From the
    hash ids alone, no cache involved."""
    stored: dict[int, int] = {}  # trace id -> tokens of its block held (whole blocks)
    hits = []
    for request in requests:
        num_hit = 0
        for position, hash_id in enumerate(request.hash_ids):
            have = stored.get(hash_id, 0)
            mine = request.block_tokens(position)
            num_hit += min(have, mine - mine % block_size)
            if have < mine:
                break  # the prefix ends inside this block
        hits.append(min(num_hit, (request.input_length - 1) // block_size * block_size))
        for position, hash_id in enumerate(request.hash_ids):
            mine = request.block_tokens(position)
            stored[hash_id] = max(stored.get(hash_id, 0), mine - mine % block_size)
    return hits
