"""Store slots into vLLM's paged cache: the worker side's load, without vLLM itself.

The store reads each slot straight into its row of one buffer, which the converter then
scatters into vLLM's blocks -- one copy between the file and the cache. The buffer is made
once, touched at start and kept (a new one's pages would be faulted in on every load: tens
of ms for a long prompt), and bounded: a longer prefix is read and scattered in parts.

A slot that fails its checks (or a read that fails) ends the loaded prefix there: that block
and every one after it are the caller's to recompute, never wrong KV.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shared.kvstore.slots import SlotRef
from shared.kvstore.store import KvStore
from shared.logging import get_logger
from shared.vllm_connector.layout import VllmBlockConverter
from shared.vllm_connector.loop import LoopThread

log = get_logger(__name__)

MAX_LOAD_BUFFER_BYTES = 128 << 20
READ_TIMEOUT_S = 60.0  # one part's reads


@dataclass(frozen=True)
class Loaded:
    num_blocks: int  # the prefix of the job's blocks now in vLLM's cache
    read_s: float
    scatter_s: float


class BlockLoader:
    def __init__(
        self,
        store: KvStore,
        converter: VllmBlockConverter,
        loop: LoopThread,
        *,
        max_buffer_bytes: int = MAX_LOAD_BUFFER_BYTES,
    ) -> None:
        self.store = store
        self.converter = converter
        self.loop = loop
        layout = converter.layout
        self.blocks_per_part = max(1, min(max_buffer_bytes // layout.block_nbytes,
                                          converter.num_blocks))  # fmt: skip
        # Zero-filled now, so its pages are in memory before the first request needs them.
        self._pages = torch.zeros((self.blocks_per_part, *layout.block_shape), dtype=layout.dtype)

    def load(self, refs: Sequence[SlotRef], block_ids: Sequence[int], request_id: str) -> Loaded:
        """Slots `refs` into vLLM blocks `block_ids` (the same order), up to the first that
        fails."""
        if len(refs) != len(block_ids):
            raise ValueError(f"{len(refs)} slots for {len(block_ids)} vLLM blocks")
        read_s = scatter_s = 0.0
        num_loaded = 0
        while num_loaded < len(refs):
            part = refs[num_loaded : num_loaded + self.blocks_per_part]
            pages = self._pages[: len(part)]
            rows = pages.view(torch.uint8).numpy().reshape(len(part), -1)
            started = time.perf_counter()
            try:
                payloads = self.loop.call(
                    self.store.read_blocks(part, [memoryview(r) for r in rows]),
                    timeout_s=READ_TIMEOUT_S,
                )
            except Exception as exc:  # the store failed: the rest is recomputed
                log.warning("store read failed: recomputing", request_id=request_id,
                            num_blocks=len(refs) - num_loaded, error=repr(exc))  # fmt: skip
                payloads = [None] * len(part)
            read_done = time.perf_counter()
            read_s += read_done - started
            num_ok = next((i for i, p in enumerate(payloads) if p is None), len(payloads))
            if num_ok:
                self.converter.scatter(block_ids[num_loaded : num_loaded + num_ok], pages[:num_ok])
            scatter_s += time.perf_counter() - read_done
            num_loaded += num_ok
            if num_ok < len(part):
                break
        return Loaded(num_loaded, read_s, scatter_s)
