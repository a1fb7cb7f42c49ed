"""Store slots into vLLM's paged cache: the worker side's load, without vLLM itself.

The store reads each slot straight into its row of a buffer, which the converter then
scatters into vLLM's blocks -- one copy between the file and the cache. A prefix goes in
parts of `part_bytes`, through two buffers: while one part is scattered (torch, in the
caller's thread), the next is read into the other buffer (the store, on the loop thread),
so the shorter of the two hides behind the longer. The buffers are made once, touched at
start and kept (a new one's pages would be faulted in on every load: tens of ms for a long
prompt).

A slot that fails its checks (or a read that fails) ends the loaded prefix there: that block
and every one after it are the caller's to recompute, never wrong KV. No read is left running
into a buffer when `load` returns.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.vllm_worker.connector.layout import VllmBlockConverter
from services.vllm_worker.connector.loop import LoopThread
from shared.logging import get_logger
from worker.kvstore.slots import SlotRef
from worker.kvstore.store import KvStore

log = get_logger(__name__)

# A part: 64 MiB is 21 blocks of SmolLM2's (2.9 MB); a 30-block prefix goes in 2 parts, the
# second read while the first is scattered. Smaller parts overlap more, but each of their
# scatters ran beside a read on 2 cores, its two OpenMP threads sharing them with the
# reading threads: `kvfabric bench connector` loaded 30 blocks at 0.46 GB/s in 16 MiB parts,
# 0.59 in 64 MiB parts, 0.64 in one part (a 2-core AVX2 VM); on an H200's host, Llama-8B
# blocks went at 2.9 and 2.8 GB/s in 16 and 64 MiB parts.
PART_BYTES = 64 << 20
READ_TIMEOUT_S = 60.0  # one part's reads


@dataclass(frozen=True)
class Loaded:
    num_blocks: int  # the prefix of the job's blocks now in vLLM's cache
    read_s: float  # waiting for reads (what the scatters did not hide)
    scatter_s: float


class BlockLoader:
    def __init__(
        self,
        store: KvStore,
        converter: VllmBlockConverter,
        loop: LoopThread,
        *,
        part_bytes: int = PART_BYTES,
    ) -> None:
        self.store = store
        self.converter = converter
        self.loop = loop
        layout = converter.layout
        self.blocks_per_part = max(1, min(part_bytes // layout.block_nbytes, converter.num_blocks))
        # Zero-filled now, so their pages are in memory before the first request needs them;
        # pinned for a GPU's caches (one DMA copy each to the device).
        pinned = converter.device.type == "cuda"
        self._buffers = [
            torch.zeros(
                (self.blocks_per_part, *layout.block_shape), dtype=layout.dtype, pin_memory=pinned
            )
            for _ in range(2)
        ]

    def load(self, refs: Sequence[SlotRef], block_ids: Sequence[int], request_id: str) -> Loaded:
        """Slots `refs` into vLLM blocks `block_ids` (the same order), up to the first that
        fails."""
        if len(refs) != len(block_ids):
            raise ValueError(f"{len(refs)} slots for {len(block_ids)} vLLM blocks")
        n = self.blocks_per_part
        starts = range(0, len(refs), n)
        read_s = scatter_s = 0.0
        num_loaded = 0
        pending = self._read(refs[:n], 0) if refs else None
        try:
            for index, start in enumerate(starts):
                part = refs[start : start + n]
                waited = time.perf_counter()
                assert pending is not None
                payloads = self._payloads(pending, len(part), len(refs) - start, request_id)
                pending = None
                read_s += time.perf_counter() - waited
                num_ok = next((i for i, p in enumerate(payloads) if p is None), len(payloads))
                if num_ok == len(part) and start + n < len(refs):  # the next part meanwhile
                    pending = self._read(refs[start + n : start + 2 * n], (index + 1) % 2)
                scattered = time.perf_counter()
                if num_ok:
                    pages = self._buffers[index % 2][:num_ok]
                    self.converter.scatter(block_ids[start : start + num_ok], pages)
                scatter_s += time.perf_counter() - scattered
                num_loaded += num_ok
                if num_ok < len(part):
                    break
        finally:
            if pending is not None:  # the scatter failed: let the read land before we go
                with contextlib.suppress(Exception):
                    pending.result(READ_TIMEOUT_S)
        return Loaded(num_loaded, read_s, scatter_s)

    def _read(self, part: Sequence[SlotRef], buffer: int) -> concurrent.futures.Future:
        rows = self._buffers[buffer][: len(part)].view(torch.uint8).numpy().reshape(len(part), -1)
        return self.loop.submit(self.store.read_blocks(part, [memoryview(r) for r in rows]))

    def _payloads(
        self, pending: concurrent.futures.Future, num_blocks: int, num_left: int, request_id: str
    ) -> list:
        """The part's payloads (None for each miss); all None when the store failed."""
        try:
            return pending.result(READ_TIMEOUT_S)
        except Exception as exc:  # the store failed or timed out: the rest is recomputed
            if isinstance(exc, concurrent.futures.TimeoutError):
                pending.cancel()
            log.warning(
                "store read failed: recomputing",
                request_id=request_id,
                num_blocks=num_left,
                error=repr(exc),
            )
            return [None] * num_blocks
