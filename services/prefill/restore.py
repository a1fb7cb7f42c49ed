"""A prefill job's starting point: the cached prefix's pages from the store and the
sliding-window state at its end (docs/design.md, 'Sliding-window state').

Window state, best first: the snapshot in the node's swa-memcache (exact, free); else a
replay of the last R tokens through the sliding layers -- bounded (R = one window by default,
approximate) or exact (R = k x W). Every replayed token is counted and reported.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from shared import telemetry
from shared.blocks import RequestBlocks
from shared.logging import get_logger
from shared.schema import ServiceError
from shared.schema.inference import BlockLocations
from worker.engine.errors import SequenceStateError
from worker.engine.kv_cache import SlidingWindowState
from worker.engine.runner import ModelRunner
from worker.engine.swa_restore import exact_replay_tokens, replay_window, snapshot_from_bytes
from worker.engine.worker import ModelThread
from worker.kvstore.store import KvStore
from worker.serving.pages import LoadedPrefix, take_prefix
from worker.swa_client import SwaClient

log = get_logger(__name__)


@dataclass(frozen=True)
class RestorePolicy:
    use_memcache: bool = True
    replay: str = "bounded"  # or "exact"
    replay_tokens: int = 0  # bounded replay's R; 0: one window


@dataclass
class Restored:
    pages: list[int]  # pool pages of blocks 0..n-1 of the prefix (the caller owns them)
    window: SlidingWindowState | None  # at len(pages) * block size; None when nothing cached
    mode: str  # snapshot | exact | bounded | none
    num_replay_tokens: int
    load_ms: float
    restore_ms: float
    num_local_blocks: int = 0  # of `pages`, the leading ones the pool still held

    @property
    def num_blocks(self) -> int:
        return len(self.pages)


class PrefixRestorer:
    def __init__(
        self,
        runner: ModelRunner,
        store: KvStore,
        swa: SwaClient | None,
        policy: RestorePolicy,
        compute_lock: asyncio.Lock,
        model_thread: ModelThread,
    ) -> None:
        self.runner = runner
        self.model_thread = model_thread
        self.store = store
        self.swa = swa
        self.policy = policy
        self.compute_lock = compute_lock  # model calls run one at a time, off the event loop

    def num_replay_tokens(self, exact: bool = False) -> int:
        config = self.runner.config
        if exact or self.policy.replay == "exact":
            return exact_replay_tokens(config)
        return self.policy.replay_tokens or (config.sliding_window or 0)

    async def restore(
        self,
        token_ids: list[int],
        blocks: RequestBlocks,
        locations: BlockLocations,
        num_blocks: int,
        *,
        exact: bool = False,
    ) -> Restored:
        """The first `num_blocks` cached blocks and the window at their end (`exact`: a
        replay, when there is no snapshot, is an exact one whatever the policy)."""
        started = time.perf_counter()
        prefix = await self._load(blocks, locations, num_blocks)
        loaded = time.perf_counter()
        if prefix.num_blocks < num_blocks:
            log.warning(
                "cached prefix cut short by a store miss",
                asked=num_blocks,
                loaded=prefix.num_blocks,
            )
        if prefix.num_blocks == 0:
            return Restored([], None, "none", 0, (loaded - started) * 1000, 0.0)
        boundary = prefix.num_blocks * self.runner.layout.block_size_tokens
        try:
            with telemetry.span("prefill window") as span:
                window, mode, num_replayed = await self._window(
                    token_ids, blocks.hashes[prefix.num_blocks - 1], prefix.pages, boundary, exact
                )
                if span.is_recording():
                    span.set_attributes(
                        {"kvfabric.swa_restore": mode, "kvfabric.num_replay_tokens": num_replayed}
                    )
        except BaseException:
            self.runner.allocator.free(prefix.pages)
            raise
        restored = time.perf_counter()
        return Restored(
            prefix.pages,
            window,
            mode,
            num_replayed,
            (loaded - started) * 1000,
            (restored - loaded) * 1000,
            prefix.num_local,
        )

    async def _load(
        self, blocks: RequestBlocks, locations: BlockLocations, num_blocks: int
    ) -> LoadedPrefix:
        """The first `num_blocks` cached blocks (fewer after a miss): the leading ones this
        worker's pool still holds from an earlier job (tagged in `tag_blocks`), the rest
        from the store."""
        if num_blocks == 0:
            return LoadedPrefix([])
        with telemetry.span("prefill load"):
            return await take_prefix(
                self.store,
                self.runner.pool,
                self.runner.allocator,
                locations,
                blocks.hashes,
                num_blocks,
                host=self.runner.host_tier,
                # Pages short (other jobs hold them): a shorter prefix, the rest computed
                # when the scheduler has pages, as for a job with no prefix at all.
                fit_pool=True,
            )

    async def _window(
        self,
        token_ids: list[int],
        boundary_hash: int,
        pages: list[int],
        boundary: int,
        exact: bool,
    ) -> tuple[SlidingWindowState, str, int]:
        config = self.runner.config
        if not config.sliding_layer_ids:
            return self.runner.empty_window(boundary), "none", 0
        if self.policy.use_memcache and self.swa is not None:
            snapshot = await self._snapshot(boundary_hash)
            if snapshot is not None:
                try:
                    window = snapshot_from_bytes(config, snapshot)
                except SequenceStateError as exc:
                    log.warning("unusable sliding-window snapshot", error=str(exc))
                else:
                    if window.end_position == boundary and window.kv.dtype == self.runner.dtype:
                        return window, "snapshot", 0
        num_replay = min(self.num_replay_tokens(exact), boundary)
        async with self.compute_lock:
            window = await self.model_thread.run(
                replay_window,
                self.runner.model,
                self.runner.pool,
                pages,
                token_ids,
                boundary,
                num_replay,
                self.runner.dtype,
            )
        mode = "exact" if num_replay >= exact_replay_tokens(config) else "bounded"
        return window, mode, num_replay

    async def _snapshot(self, boundary_hash: int) -> bytes | None:
        assert self.swa is not None
        try:
            return await self.swa.get(boundary_hash)
        except ServiceError as exc:  # no memcache on this node right now: replay instead
            log.warning("swa-memcache unavailable", error=str(exc))
            return None
