"""The connector's scheduler side, without vLLM: which stored blocks a request loads, and
which of its blocks are saved when it finishes.

Each token is hashed once per request. A request the vllm-worker sends carries its prompt's
chain, hashed by the caller, and the router's kv-index match (`params.RoutedPrefix`): its
prompt is not hashed here and kv-index is not asked. A request sent to vLLM directly carries
neither: its prompt is hashed here, up to the last complete block before its last token, and
kv-index is asked. Either way the chain is kept until the request finishes, and then only
the blocks past it -- the answer's -- are hashed, continuing it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from services.vllm_worker.connector.config import ConnectorConfig
from services.vllm_worker.connector.params import RoutedPrefixError, from_kv_transfer_params
from shared.block_hashing import BlockHasher
from shared.blocks import RequestBlocks, num_blocks_before_last
from shared.kv_index_client import PrefixMatch
from shared.logging import get_logger
from shared.schema import BlockLocation, ServiceError
from worker.kvstore.slots import SlotRef

log = get_logger(__name__)

STORE_TIER = "ssd"  # the tier the connector reads and writes (`KvEventPublisher`'s)

# kv-index's longest prefix per tier for these hashes; raises ServiceError or TimeoutError.
Match = Callable[[list[int]], dict[str, PrefixMatch]]


class VllmRequest(Protocol):
    """What this side reads of vLLM's `Request`."""

    request_id: str
    prompt_token_ids: list[int] | None
    cache_salt: str | None
    kv_transfer_params: dict[str, Any] | None
    num_computed_tokens: int

    @property
    def all_token_ids(self) -> Sequence[int]: ...


@dataclass(frozen=True)
class LoadJob:
    request_id: str
    block_ids: list[int]  # vLLM blocks to fill, in order
    refs: list[SlotRef]  # where each one's KV is, in the same order


@dataclass(frozen=True)
class SaveJob:
    request_id: str
    block_ids: list[int]  # vLLM blocks holding blocks first_block.. of the sequence
    block_hashes: list[int]  # their chained hashes
    parent_block_hash: int | None


@dataclass
class _RequestState:
    """A request's chain and match, from its first look until it finishes."""

    chain: RequestBlocks  # hashed so far: the prompt's blocks, the answer's added at the end
    routed: bool  # the chain and `stored` came with the request: never hashed nor matched here
    stored: list[BlockLocation]  # the store's prefix, as kv-index last matched it
    num_local_blocks: int | None = None  # vLLM's own prefix cache; None: not admitted yet
    num_stored_blocks: int = 0  # the store's prefix, up to the prompt's prefill blocks
    refs: list[SlotRef] = field(default_factory=list)  # blocks num_local_blocks.. of it


class SchedulerSide:
    def __init__(self, config: ConnectorConfig, block_size: int, match: Match) -> None:
        self.config = config
        self.block_size = block_size
        self._match = match
        self._hashers: dict[str, BlockHasher] = {}
        self._requests: dict[str, _RequestState] = {}
        # Allocated, to go in the next metadata: (vLLM's own prefix in blocks, the slots past it).
        self._loads: dict[str, tuple[int, list[SlotRef]]] = {}
        self._saves: list[SaveJob] = []
        self.counts = {
            "routed_requests": 0,  # came with their chain and the router's match
            "hashed_blocks": 0,  # hashed here: direct requests' prompts, every answer
            "matches": 0,
            "match_failures": 0,
            "offered_blocks": 0,
            "saved_requests": 0,
        }

    def _hasher(self, salt: str | None) -> BlockHasher:
        salt = salt or ""
        hasher = self._hashers.get(salt)
        if hasher is None:
            hasher = RequestBlocks.namespace(self.config.model, self.block_size, salt)
            self._hashers[salt] = hasher
        return hasher

    # -- get_num_new_matched_tokens ------------------------------------------------------
    def num_new_matched_tokens(self, request: VllmRequest, num_computed_tokens: int) -> int:
        """Tokens past vLLM's own prefix (`num_computed_tokens`) the store offers. Asked at
        every scheduling attempt: answered again only when vLLM's own prefix changed."""
        prompt = request.prompt_token_ids or []
        num_local = num_computed_tokens // self.block_size
        state = self._requests.get(request.request_id)
        if state is None:
            state = self._requests[request.request_id] = self._start(request, prompt)
        if state.num_local_blocks != num_local:
            self._admit(request, state, prompt, num_local)
        return len(state.refs) * self.block_size

    def _start(self, request: VllmRequest, prompt: Sequence[int]) -> _RequestState:
        hasher = self._hasher(request.cache_salt)
        try:
            routed = from_kv_transfer_params(request.kv_transfer_params)
        except RoutedPrefixError as exc:
            log.warning(
                "unreadable routed prefix: hashing the prompt",
                request_id=request.request_id,
                error=str(exc),
            )
            routed = None
        if routed is not None:
            hashes = routed.hashes()
            if len(hashes) == hasher.num_blocks(len(prompt)):
                self.counts["routed_requests"] += 1
                cached = routed.cached_blocks
                rows = cached.rows() if cached.tier == STORE_TIER else []
                return _RequestState(RequestBlocks(hasher, len(prompt), hashes), True, rows)
            log.warning(
                "the routed chain does not fit the prompt: hashing it",
                request_id=request.request_id,
                num_block_hashes=len(hashes),
                num_prompt_tokens=len(prompt),
            )
        return _RequestState(RequestBlocks(hasher, len(prompt), []), False, [])

    def _admit(
        self, request: VllmRequest, state: _RequestState, prompt: Sequence[int], num_local: int
    ) -> None:
        num_prefill_blocks = num_blocks_before_last(len(prompt), self.block_size)
        state.num_local_blocks, state.num_stored_blocks, state.refs = num_local, 0, []
        if not self.config.load or num_prefill_blocks <= num_local:
            return
        if not state.routed:
            hashes = self._extend(state.chain, prompt, num_prefill_blocks)
            state.stored = self._matched(request, hashes)
        state.num_stored_blocks = num_stored = min(len(state.stored), num_prefill_blocks)
        state.refs = [SlotRef.from_location(r) for r in state.stored[num_local:num_stored]]
        log.debug(
            "admitted",
            request_id=request.request_id,
            routed=state.routed,
            num_local_blocks=num_local,
            num_stored_blocks=num_stored,
        )

    def _matched(self, request: VllmRequest, hashes: list[int]) -> list[BlockLocation]:
        """The store's prefix of `hashes`, asking kv-index; empty when it fails or is late."""
        self.counts["matches"] += 1
        started = time.perf_counter()
        try:
            matches = self._match(hashes)
        except (ServiceError, TimeoutError) as exc:
            self.counts["match_failures"] += 1
            log.warning(
                "kv-index did not answer: computing the prompt",
                request_id=request.request_id,
                error=str(exc),
            )
            return []
        stored = matches.get(STORE_TIER)
        log.debug(
            "matched",
            request_id=request.request_id,
            num_stored_blocks=stored.num_blocks if stored is not None else 0,
            ms=round((time.perf_counter() - started) * 1e3, 2),
        )
        return stored.locations.rows() if stored is not None else []

    def _extend(self, chain: RequestBlocks, token_ids: Sequence[int], num_blocks: int) -> list[int]:
        num_hashed = len(chain.hashes)
        hashes = chain.extend(token_ids, num_blocks)
        self.counts["hashed_blocks"] += len(chain.hashes) - num_hashed
        return hashes

    # -- update_state_after_alloc, build_connector_meta ----------------------------------
    def allocated(self, request_id: str, num_external_tokens: int) -> None:
        """vLLM took `num_external_tokens` of the offer: they load in the next step."""
        state = self._requests.get(request_id)
        if state is None or state.num_local_blocks is None or num_external_tokens == 0:
            return
        num_blocks = num_external_tokens // self.block_size
        self._loads[request_id] = (state.num_local_blocks, state.refs[:num_blocks])
        self.counts["offered_blocks"] += num_blocks

    def take_load(self, request_id: str, block_ids: list[int]) -> LoadJob | None:
        """The allocated load of a request scheduled in this step, into its `block_ids`."""
        first, refs = self._loads.pop(request_id, (0, []))
        if not refs:
            return None
        targets = block_ids[first : first + len(refs)]
        return LoadJob(request_id, list(targets), refs[: len(targets)])

    def take_saves(self) -> list[SaveJob]:
        saves, self._saves = self._saves, []
        return saves

    # -- request_finished ----------------------------------------------------------------
    def finished(self, request: VllmRequest, block_ids: list[int]) -> bool:
        """Queue the save of the request's complete blocks past the stored prefix -- prompt
        and output, so an agent's next turn hits its own answer; whether vLLM must hold
        `block_ids` until the worker side copied them."""
        state = self._requests.pop(request.request_id, None)
        self._loads.pop(request.request_id, None)
        if not self.config.save:
            return False
        b = self.block_size
        tokens = request.all_token_ids
        num_complete = min(request.num_computed_tokens, len(tokens), len(block_ids) * b) // b
        # What is on the store already: the prefix it matched, and vLLM's own cached prefix
        # (blocks of a request before this one on this worker, saved when that one finished).
        first = 0
        if state is not None:
            first = max(state.num_stored_blocks, state.num_local_blocks or 0)
        if num_complete <= first:
            return False
        if state is None:  # finished before its first look: its chain, if it came with one
            prompt = request.prompt_token_ids or []
            state = self._start(request, prompt)
        hashes = self._extend(state.chain, tokens, num_complete)
        self._saves.append(
            SaveJob(
                request.request_id,
                list(block_ids[first:num_complete]),
                hashes[first:num_complete],
                hashes[first - 1] if first else None,
            )
        )
        self.counts["saved_requests"] += 1
        return True
